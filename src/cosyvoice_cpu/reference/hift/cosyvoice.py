"""HiFT vocoder (HiFTNet: neural source filter + iSTFTNet) of CosyVoice-300M and CosyVoice2, inference only.

mel ``(B, 80, T)`` -> F0 ``(B, T)`` -> harmonic source ``(B, 1, T*480)`` -> conv stack fused with the source's
STFT at every resolution -> 9 log-magnitudes + 9 phases per hop -> inverse STFT -> wave ``(B, T*480)``.

Parameter names follow the official ``cosyvoice.hifigan.generator.HiFTGenerator`` so the released ``hift.pt``
loads into :class:`HiFT`; weight norm is folded into plain ``weight`` tensors at load
(:meth:`HiFT.load_checkpoint_state`).

Variants: v2 (24 kHz, ``SineGen2``) is the default and parity-tested. v1 (CosyVoice-300M, 22.05 kHz,
upsample ``[8, 8]``) differs only in the sine generator, chosen like upstream by ``sampling_rate == 22050``
(:mod:`.source`). v3 (CosyVoice3 ``CausalHiFTGenerator``, causal convs + causal F0 predictor) is the
sibling :class:`~cosyvoice_cpu.reference.hift.cosyvoice3.CausalHiFT`; both share the checkpoint folding and the
STFT/iSTFT ends (:class:`~cosyvoice_cpu.reference.hift.common.HiFTBase`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.hift.common import GeneratorConfig, HiFTBase, ResBlock, generator_kwargs
from cosyvoice_cpu.reference.hift.source import F0Predictor, HarmonicSource, SourceNoise

logger = logging.getLogger(__name__)


@dataclass
class HiFTConfig(GeneratorConfig):
    """Constructor arguments of the official ``HiFTGenerator``; defaults are the CosyVoice2-0.5B release."""

    @property
    def sine_type(self) -> str:
        """``"v1"`` at 22050 Hz (CosyVoice-300M), else ``"v2"`` — the official rule."""
        return "v1" if self.sampling_rate == 22050 else "v2"

    @classmethod
    def from_yaml(cls, node: Any) -> HiFTConfig:
        """Build from the ``hift: !new:cosyvoice.hifigan.generator.HiFTGenerator`` :class:`Tagged` node.

        Keys absent from the yaml take the *official constructor's* defaults (the 22.05 kHz v1 values), as
        HyperPyYAML would, not this dataclass's CosyVoice2 defaults.
        """
        if node.class_name != "HiFTGenerator":
            raise ConfigError(
                f"hift: {node.target} is not HiFTGenerator "
                "(CausalHiFTGenerator is v3: use reference.hift.cosyvoice3.CausalHiFTConfig)"
            )
        cfg = cls(**generator_kwargs(node))
        cfg.validate()
        return cfg


class HiFT(HiFTBase):
    """The HiFT generator; ``state_dict`` keys equal ``hift.pt``'s with weight norm folded into ``weight``."""

    def __init__(self, cfg: HiFTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or HiFTConfig()
        cfg.validate()
        self.cfg = cfg
        c, n_fft = cfg.base_channels, cfg.istft_n_fft
        self.m_source = HarmonicSource(
            cfg.sampling_rate,
            cfg.upsample,
            cfg.nb_harmonics,
            cfg.nsf_alpha,
            cfg.nsf_sigma,
            cfg.nsf_voiced_threshold,
            cfg.sine_type,
        )
        self.conv_pre = nn.Conv1d(cfg.in_channels, c, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(c >> i, c >> (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        # the source STFT (hop rate of the output) is strided down to each upsampling stage's rate
        rates = cfg.upsample_rates
        strides = [math.prod(rates[i + 1 :]) for i in range(len(rates))]
        self.source_downs = nn.ModuleList(
            nn.Conv1d(n_fft + 2, c >> (i + 1), 1) if s == 1 else nn.Conv1d(n_fft + 2, c >> (i + 1), 2 * s, s, s // 2)
            for i, s in enumerate(strides)
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(c >> (i + 1), k, d)
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes))
        )
        self.resblocks = nn.ModuleList(
            ResBlock(c >> (i + 1), k, d)
            for i in range(len(rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.conv_post = nn.Conv1d(c >> len(rates), n_fft + 2, 7, padding=3)
        self.f0_predictor = F0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        # periodic Hann computed in float64 like scipy.signal.get_window("hann", n, fftbins=True), then fp32
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Conv stack + iSTFT: ``mel (B, 80, T)``, ``source (B, 1, T * upsample)`` -> wave ``(B, T * upsample)``."""
        self._check_mel(mel)
        if source.dim() != 3 or source.shape[1] != 1:
            raise ConfigError(f"hift decode expects source (B, 1, L), got {tuple(source.shape)}")
        s = self.source_spectrum(source)
        x = self.conv_post_input(self.conv_pre(mel), s)
        return self.spectrum_to_wave(self.conv_post(x)).clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    @torch.inference_mode()
    def inference(
        self,
        mel: torch.Tensor,
        noise: SourceNoise | torch.Generator | None = None,
        cache_source: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mel (B, 80, T)`` -> ``(wave (B, T*480), source (B, 1, T*480))``, like official ``inference``.

        ``cache_source (B or 1, 1, n)``, the source returned for the previous chunk's overlap, overwrites the
        first ``n`` source samples (avoids glitches at streaming chunk boundaries); the returned source holds it.
        """
        source = self.source(self.f0(mel), noise)
        if cache_source is not None and cache_source.shape[-1] != 0:
            if cache_source.dim() != 3 or cache_source.shape[-1] > source.shape[-1]:
                raise ConfigError(
                    f"cache_source {tuple(cache_source.shape)} must be (B, 1, n) with n <= {source.shape[-1]}"
                )
            source[:, :, : cache_source.shape[-1]] = cache_source
        return self.decode(mel, source), source

    def forward(
        self,
        mel: torch.Tensor,
        noise: SourceNoise | torch.Generator | None = None,
        cache_source: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same as :meth:`inference`."""
        return self.inference(mel, noise, cache_source)
