"""Causal HiFT vocoder of Fun-CosyVoice3 (official ``CausalHiFTGenerator``), inference only.

mel ``(B, 80, T)`` --causal F0 predictor (float64)--> F0 ``(B, T')`` --repeat x480--> harmonic source
``(B, 1, T' * 480)`` --STFT (16/4)--> fused into the causal conv stack --> 9 log-magnitudes + 9 phases
--> iSTFT --> wave ``(B, T * 480)`` (``finalize``) or ``(B, (T - 8) * 480)`` (a non-final streaming call).

Differences from CosyVoice2's :class:`~cosyvoice_cpu.reference.hift.cosyvoice.HiFT` (everything else, including
the state-dict layout, is shared through their base :class:`~cosyvoice_cpu.reference.hift.common.HiFTBase`):

* Convolutions only look left (zero pad ``(k - 1) * d`` on the left), except ``conv_pre`` (kernel 5, looks 4 frames
  right) and the F0 predictor's first conv (kernel 4, looks 3 frames right). With ``finalize=False`` those
  right contexts come from the last mel frames instead of zeros: F0 loses 3 frames, ``conv_pre`` another 4, and
  the output drops one more frame (480 samples) at its end.
* Up-sampling is nearest-neighbour repeat + causal ``Conv1d`` (weights ``(C_out, C_in, k)``, not transposed);
  the source down-sampling convs pad ``stride - 1`` on the left.
* The source (:mod:`.source` sine type ``"v3"``): the frame-rate phase is held over each frame's samples,
  and upstream's noise is not drawn per call but sliced from tables drawn once at construction
  (``SineGen2.sine_waves = rand(1, 300 * 24000, 9)``, uniform, 259 MB; ``rand_ini = rand(1, 9)``; the
  ``SourceModuleHnNSF.uv`` table (29 MB) feeds an output nobody uses). Each call uses rows ``[0, L)``, so
  streaming calls over a growing mel see the same noise prefix. Here that randomness is an input
  (:class:`~cosyvoice_cpu.reference.hift.source.SourceNoise`, rows beyond L ignored) and never a weight.
* The F0 predictor runs in float64 (upstream casts the module and the mel); ``f0_dtype`` selects it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.hift.common import GeneratorConfig, HiFTBase, ResBlock, Snake, generator_kwargs
from cosyvoice_cpu.reference.hift.source import HarmonicSource, SourceNoise

logger = logging.getLogger(__name__)

F0_LOOK_RIGHT = 3  # CausalConvRNNF0Predictor: first conv kernel 4, right-causal


@dataclass
class CausalHiFTConfig(GeneratorConfig):
    """Constructor arguments of the official ``CausalHiFTGenerator`` (defaults: Fun-CosyVoice3-0.5B)."""

    conv_pre_look_right: int = 4

    @property
    def sine_type(self) -> str:
        return "v3"

    def validate(self) -> None:
        super().validate()
        if self.sampling_rate == 22050:
            raise ConfigError("hift: CausalHiFTGenerator at 22050 Hz would use the v1 sine generator; not supported")
        if self.conv_pre_look_right < 1:
            raise ConfigError(f"hift conv_pre_look_right must be >= 1, got {self.conv_pre_look_right}")

    @classmethod
    def from_yaml(cls, node: Any) -> CausalHiFTConfig:
        """Build from the ``hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator`` :class:`Tagged` node
        (absent keys take the official constructor's defaults)."""
        if getattr(node, "class_name", None) != "CausalHiFTGenerator":
            raise ConfigError(f"hift: {getattr(node, 'target', node)!r} is not CausalHiFTGenerator (v2: HiFTConfig)")
        f0 = node.get("f0_predictor")
        if f0 is not None and getattr(f0, "class_name", None) != "CausalConvRNNF0Predictor":
            raise ConfigError(f"hift: f0_predictor {getattr(f0, 'target', f0)!r} is not CausalConvRNNF0Predictor")
        cfg = cls(**generator_kwargs(node), conv_pre_look_right=int(node.get("conv_pre_look_right", 4)))
        cfg.validate()
        return cfg


def causal_padding(kernel: int, dilation: int = 1) -> int:
    """The official ``CausalConv1d.causal_padding``: ``(k - 1) * d`` for odd k, ``k - 1`` for even k (d = 1)."""
    return (kernel * dilation - dilation) // 2 * 2 + (kernel + 1) % 2


class CausalConv(nn.Conv1d):
    """Conv1d padded on one side only: ``left`` (causal) or ``right`` (look-ahead, optionally real context)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int = 1, side: str = "left") -> None:
        super().__init__(c_in, c_out, kernel, dilation=dilation)
        self.causal_padding = causal_padding(kernel, dilation)
        self.side = side

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, C, T)`` -> ``(B, C_out, T)``; ``context (B, C, causal_padding)`` replaces the right zeros."""
        if context is not None:
            return super().forward(torch.cat([x, context], dim=2))
        pad = (self.causal_padding, 0) if self.side == "left" else (0, self.causal_padding)
        return super().forward(F.pad(x, pad))


class CausalUpsample(nn.Conv1d):
    """Nearest-neighbour repeat by ``stride``, then a left-causal Conv1d of kernel ``k``."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__(c_in, c_out, kernel)
        self.stride_up = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C_in, T)`` -> ``(B, C_out, T * stride)``."""
        x = F.interpolate(x, scale_factor=self.stride_up, mode="nearest")
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalDownsample(nn.Conv1d):
    """Conv1d(kernel 2u, stride u) after ``u - 1`` zeros on the left."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__(c_in, c_out, 2 * stride, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


class CausalResBlock(ResBlock):
    """v2's ResBlock (same keys, same forward) with left-causal convolutions."""

    def __init__(self, channels: int, kernel: int, dilations: list[int]) -> None:
        nn.Module.__init__(self)
        self.convs1 = nn.ModuleList(CausalConv(channels, channels, kernel, d) for d in dilations)
        self.convs2 = nn.ModuleList(CausalConv(channels, channels, kernel) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)


class CausalF0Predictor(nn.Module):
    """``CausalConvRNNF0Predictor``: conv k=4 looking 3 frames right, 4 left-causal k=3 convs, ELU, linear, abs."""

    def __init__(self, in_channels: int = 80, cond_channels: int = 512, num_class: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [CausalConv(in_channels, cond_channels, F0_LOOK_RIGHT + 1, side="right"), nn.ELU()]
        for _ in range(4):
            layers += [CausalConv(cond_channels, cond_channels, 3), nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # conv indices 0, 2, 4, 6, 8 match the checkpoint keys
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """``mel (B, C_in, T)`` -> F0 in Hz ``(B, T)`` (``finalize``) or ``(B, T - 3)`` (last 3 frames = context)."""
        first = self.condnet[0]
        if finalize:
            h = first(mel)
        else:
            p = first.causal_padding
            h = first(mel[:, :, :-p], context=mel[:, :, -p:])
        for layer in self.condnet[1:]:
            h = layer(h)
        return self.classifier(h.transpose(1, 2)).squeeze(-1).abs()


class CausalHiFT(HiFTBase):
    """The v3 vocoder; ``state_dict`` keys equal the official ``CausalHiFTGenerator``'s with weight norm folded.

    Load ``hift.pt`` with :meth:`load_checkpoint_state` (new/old weight norm or plain weights; the F0 predictor's
    weights are folded in ``f0_dtype``, as upstream computes them).
    """

    def __init__(self, cfg: CausalHiFTConfig | None = None, f0_dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        cfg = cfg or CausalHiFTConfig()
        cfg.validate()
        self.cfg = cfg
        c, n_fft, rates = cfg.base_channels, cfg.istft_n_fft, cfg.upsample_rates
        self.m_source = HarmonicSource(
            cfg.sampling_rate,
            cfg.upsample,
            cfg.nb_harmonics,
            cfg.nsf_alpha,
            cfg.nsf_sigma,
            cfg.nsf_voiced_threshold,
            cfg.sine_type,
        )
        self.conv_pre = CausalConv(cfg.in_channels, c, cfg.conv_pre_look_right + 1, side="right")
        self.ups = nn.ModuleList(
            CausalUpsample(c >> i, c >> (i + 1), k, u) for i, (u, k) in enumerate(zip(rates, cfg.upsample_kernel_sizes))
        )
        strides = [math.prod(rates[i + 1 :]) for i in range(len(rates))]
        self.source_downs = nn.ModuleList(
            CausalConv(n_fft + 2, c >> (i + 1), 1) if s == 1 else CausalDownsample(n_fft + 2, c >> (i + 1), s)
            for i, s in enumerate(strides)
        )
        self.source_resblocks = nn.ModuleList(
            CausalResBlock(c >> (i + 1), k, d)
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes))
        )
        self.resblocks = nn.ModuleList(
            CausalResBlock(c >> (i + 1), k, d)
            for i in range(len(rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.conv_post = CausalConv(c >> len(rates), n_fft + 2, 7)
        self.f0_predictor = CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        self.f0_predictor.to(f0_dtype)
        self.f0_dtype = f0_dtype
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)

    @property
    def frame_samples(self) -> int:
        """Output samples per mel frame (480)."""
        return self.cfg.upsample

    def f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """F0 in Hz: ``mel (B, 80, T)`` -> ``(B, T)`` or ``(B, T - 3)`` (not ``finalize``), computed in ``f0_dtype``
        and returned in the mel's dtype."""
        self._check_mel(mel)
        return self.f0_predictor(mel.to(self.f0_dtype), finalize).to(mel.dtype)

    def source(self, f0: torch.Tensor, noise: SourceNoise | torch.Generator | None = None) -> torch.Tensor:
        """Harmonic excitation ``f0 (B, T)`` -> ``(B, 1, T * 480)``.

        ``noise`` as upstream's tables: a :class:`SourceNoise` whose ``sine_noise`` has >= ``T * 480`` rows (only
        the first are used) and batch 1 (shared, like upstream) or B; or a generator / None to draw fresh
        uniform numbers.
        """
        if isinstance(noise, SourceNoise):
            length, batch = f0.shape[1] * self.cfg.upsample, f0.shape[0]
            table = noise.sine_noise
            if table.dim() != 3 or table.shape[1] < length:
                raise ConfigError(f"SourceNoise.sine_noise {tuple(table.shape)} must be (B, >= {length}, H)")
            noise = SourceNoise(noise.initial_phase.expand(batch, -1), table[:, :length].expand(batch, -1, -1))
        return super().source(f0, noise)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Conv stack + iSTFT: ``mel (B, 80, T)``, ``source (B, 1, T * 480)`` -> wave ``(B, T * 480)``; with
        ``finalize=False`` the last 4 mel frames are ``conv_pre``'s look-ahead -> ``(B, (T - 5) * 480)``."""
        self._check_mel(mel)
        if source.dim() != 3 or source.shape[1] != 1:
            raise ConfigError(f"hift decode expects source (B, 1, L), got {tuple(source.shape)}")
        s = self.source_spectrum(source)
        if finalize:
            x = self.conv_pre(mel)
        else:
            r = self.cfg.conv_pre_look_right
            x = self.conv_pre(mel[:, :, :-r], context=mel[:, :, -r:])
            s = s[:, :, : -math.prod(self.cfg.upsample_rates) * r]
        wave = self.spectrum_to_wave(self.conv_post(self.conv_post_input(x, s)))
        if not finalize:
            wave = wave[:, : -self.frame_samples]
        return wave.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    @torch.inference_mode()
    def inference(
        self,
        mel: torch.Tensor,
        noise: SourceNoise | torch.Generator | None = None,
        finalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mel (B, 80, T)`` -> ``(wave, source)`` like the official ``CausalHiFTGenerator.inference``.

        ``finalize=True``: wave ``(B, T * 480)``, source ``(B, 1, T * 480)``. ``finalize=False`` (streaming over a
        growing mel): F0 and source cover ``T - 3`` frames, the wave ``T - 8`` frames; upstream re-vocodes the
        whole mel each chunk and emits only the samples past what it already sent.
        """
        if not finalize and mel.shape[-1] <= F0_LOOK_RIGHT + self.cfg.conv_pre_look_right + 1:
            raise ValueError(f"a non-final HiFT call needs more than 8 mel frames, got {mel.shape[-1]}")
        source = self.source(self.f0(mel, finalize), noise)
        body = mel if finalize else mel[:, :, :-F0_LOOK_RIGHT]
        return self.decode(body, source, finalize), source

    def forward(
        self, mel: torch.Tensor, noise: SourceNoise | torch.Generator | None = None, finalize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same as :meth:`inference`."""
        return self.inference(mel, noise, finalize)
