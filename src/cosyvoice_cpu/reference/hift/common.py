"""What the HiFT generators of every family share (:class:`~.cosyvoice.HiFT`: CosyVoice-300M and CosyVoice2;
:class:`~.cosyvoice3.CausalHiFT`: Fun-CosyVoice3): the constructor arguments (:class:`GeneratorConfig`), the Snake
residual blocks, the checkpoint loading that folds weight norm (:meth:`HiFTBase.load_checkpoint_state`), the F0 and
harmonic-source steps and the STFT/iSTFT ends of the conv stack.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.reference.hift.source import SourceNoise

logger = logging.getLogger(__name__)

_WN_NEW = (".parametrizations.weight.original0", ".parametrizations.weight.original1")  # (g, v)
_WN_OLD = (".weight_g", ".weight_v")


def _dilations() -> list[list[int]]:
    return [[1, 3, 5], [1, 3, 5], [1, 3, 5]]


@dataclass
class GeneratorConfig:
    """The constructor arguments the official ``HiFTGenerator`` and ``CausalHiFTGenerator`` share; defaults are the
    CosyVoice2-0.5B release."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 3])
    upsample_kernel_sizes: list[int] = field(default_factory=lambda: [16, 11, 7])
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: list[int] = field(default_factory=lambda: [3, 7, 11])
    resblock_dilation_sizes: list[list[int]] = field(default_factory=_dilations)
    source_resblock_kernel_sizes: list[int] = field(default_factory=lambda: [7, 7, 11])
    source_resblock_dilation_sizes: list[list[int]] = field(default_factory=_dilations)
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_in_channels: int = 80
    f0_cond_channels: int = 512
    f0_num_class: int = 1

    @property
    def sine_type(self) -> str:
        """The harmonic source's sine generator (:mod:`.source`): the family's rule."""
        raise NotImplementedError

    @property
    def upsample(self) -> int:
        """Output samples per mel frame (480 for CosyVoice2)."""
        return math.prod(self.upsample_rates) * self.istft_hop_len

    def validate(self) -> None:
        """Raise :class:`ConfigError` (a ``ValueError``) naming the first inconsistent field."""
        for name in ("in_channels", "base_channels", "sampling_rate", "istft_n_fft", "istft_hop_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hift {name} must be positive, got {getattr(self, name)}")
        for name in ("nb_harmonics", "nsf_alpha", "nsf_sigma", "lrelu_slope"):
            if getattr(self, name) < 0:
                raise ConfigError(f"hift {name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.audio_limit <= 1:
            raise ConfigError(f"hift audio_limit must be in (0, 1], got {self.audio_limit}")
        if self.istft_n_fft % 2:
            raise ConfigError(f"hift istft_n_fft must be even, got {self.istft_n_fft}")
        n_up = len(self.upsample_rates)
        for name in ("upsample_kernel_sizes", "source_resblock_kernel_sizes", "source_resblock_dilation_sizes"):
            if len(getattr(self, name)) != n_up:
                raise ConfigError(f"hift {name} needs one entry per upsample rate ({n_up}), got {getattr(self, name)}")
        if n_up == 0 or len(self.resblock_kernel_sizes) == 0:
            raise ConfigError("hift upsample_rates and resblock_kernel_sizes must not be empty")
        if len(self.resblock_dilation_sizes) != len(self.resblock_kernel_sizes):
            raise ConfigError("hift resblock_dilation_sizes needs one list per resblock kernel size")
        for u, k in zip(self.upsample_rates, self.upsample_kernel_sizes):
            if u <= 0 or k < u or (k - u) % 2:
                raise ConfigError(f"hift upsample_kernel_sizes: kernel {k} for rate {u} must be >= rate, same parity")
        if self.base_channels % 2**n_up:
            raise ConfigError(f"hift base_channels {self.base_channels} must be divisible by 2**{n_up}")
        if self.f0_in_channels != self.in_channels:
            raise ConfigError(f"hift f0_in_channels {self.f0_in_channels} must equal in_channels {self.in_channels}")
        if self.f0_num_class != 1 or self.f0_cond_channels <= 0:
            raise ConfigError("hift f0 predictor needs num_class 1 and positive cond_channels")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def generator_kwargs(node: Any) -> dict[str, Any]:
    """:class:`HiFTConfig` fields from a ``HiFTGenerator``/``CausalHiFTGenerator`` :class:`Tagged` node; keys absent
    from the yaml take the official constructors' defaults (both classes share them: the 22.05 kHz v1 values)."""
    istft = node.get("istft_params", {"n_fft": 16, "hop_len": 4})
    f0 = node.get("f0_predictor")
    f0_args = f0.args if f0 is not None and isinstance(f0.args, dict) else {}
    return dict(
        in_channels=node.get("in_channels", 80),
        base_channels=node.get("base_channels", 512),
        nb_harmonics=node.get("nb_harmonics", 8),
        sampling_rate=node.get("sampling_rate", 22050),
        nsf_alpha=node.get("nsf_alpha", 0.1),
        nsf_sigma=node.get("nsf_sigma", 0.003),
        nsf_voiced_threshold=node.get("nsf_voiced_threshold", 10),
        upsample_rates=list(node.get("upsample_rates", [8, 8])),
        upsample_kernel_sizes=list(node.get("upsample_kernel_sizes", [16, 16])),
        istft_n_fft=istft.get("n_fft", 16),
        istft_hop_len=istft.get("hop_len", 4),
        resblock_kernel_sizes=list(node.get("resblock_kernel_sizes", [3, 7, 11])),
        resblock_dilation_sizes=[list(d) for d in node.get("resblock_dilation_sizes", _dilations())],
        source_resblock_kernel_sizes=list(node.get("source_resblock_kernel_sizes", [7, 11])),
        source_resblock_dilation_sizes=[
            list(d) for d in node.get("source_resblock_dilation_sizes", [[1, 3, 5], [1, 3, 5]])
        ],
        lrelu_slope=node.get("lrelu_slope", 0.1),
        audio_limit=node.get("audio_limit", 0.99),
        f0_in_channels=f0_args.get("in_channels", 80),
        f0_cond_channels=f0_args.get("cond_channels", 512),
        f0_num_class=f0_args.get("num_class", 1),
    )


class Snake(nn.Module):
    """``x + sin(alpha * x)^2 / (alpha + 1e-9)`` with a learned per-channel ``alpha`` (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, T)`` -> ``(B, C, T)``."""
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Per dilation d: ``x += conv_k(snake(conv_{k,d}(snake(x))))``, length-preserving."""

    def __init__(self, channels: int, kernel: int, dilations: list[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2) for d in dilations
        )
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, T)`` -> ``(B, C, T)``."""
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + c2(a2(c1(a1(x))))
        return x


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``W = g * v / ||v||`` with the norm over every axis but 0 (PyTorch ``weight_norm(dim=0)``).

    Axis 0 of the stored tensor is the output channel of a ``Conv1d`` and the *input* channel of a
    ``ConvTranspose1d`` (``(C_in, C_out, k)``); upstream uses ``dim=0`` for both, so ``g`` is ``(C0, 1, 1)``.
    ``torch._weight_norm`` is the kernel PyTorch's weight-norm parametrization itself runs on every forward
    (its CPU kernel accumulates the norm in float64), so the folded weight is bit-identical to the official
    module's; a float32 ``v * (g / vector_norm(v))`` differs by an ulp, which the F0 -> phase integration
    amplifies to ~1e-4 relative in the source.
    """
    if g.shape != (v.shape[0],) + (1,) * (v.dim() - 1):
        raise ModelDirError(f"weight norm g {tuple(g.shape)} does not fit v {tuple(v.shape)} (dim 0)")
    return torch._weight_norm(v, g, 0)


class HiFTBase(nn.Module):
    """The parts of a HiFT generator every family shares; a family's subclass builds the modules (the released
    keys: ``m_source``, ``conv_pre``, ``ups``, ``source_downs``, ``source_resblocks``, ``resblocks``,
    ``conv_post``, ``f0_predictor``) and gives ``decode``/``inference``."""

    cfg: GeneratorConfig
    m_source: nn.Module
    f0_predictor: nn.Module
    ups: nn.ModuleList
    source_downs: nn.ModuleList
    source_resblocks: nn.ModuleList
    resblocks: nn.ModuleList
    stft_window: torch.Tensor

    # ---------------------------------------------------------------- checkpoint

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a ``hift.pt`` state dict strictly, folding weight norm into plain ``weight``.

        Accepts ``<m>.parametrizations.weight.original0/1`` (torch >= 2.1 ``parametrizations.weight_norm``),
        ``<m>.weight_g/weight_v`` (old ``nn.utils.weight_norm``) or an already folded ``<m>.weight``; keys may
        carry the ``generator.`` prefix of training checkpoints.

        Raises:
            ModelDirError: a key is missing or unexpected, a g/v pair is incomplete, or a shape differs.
        """
        state = {k.removeprefix("generator."): v for k, v in state.items()}
        folded: dict[str, torch.Tensor] = {}
        pairs: dict[str, dict[int, torch.Tensor]] = {}
        for key, value in state.items():
            suffix = next((s for s in _WN_NEW + _WN_OLD if key.endswith(s)), None)
            if suffix is None:
                folded[key] = value
                continue
            idx = (_WN_NEW + _WN_OLD).index(suffix) % 2
            pairs.setdefault(key[: -len(suffix)], {})[idx] = value
        own = self.state_dict()
        for module, gv in pairs.items():
            if len(gv) != 2:
                raise ModelDirError(f"hift checkpoint: weight norm of {module} has only {'gv'[next(iter(gv))]}")
            if f"{module}.weight" in folded:
                raise ModelDirError(f"hift checkpoint: {module} has both a plain and a weight-normed weight")
            # fold in the parameter's own dtype (float64 for v3's F0 predictor, as upstream runs it)
            target = own.get(f"{module}.weight")
            dtype = target.dtype if target is not None else gv[1].dtype
            folded[f"{module}.weight"] = fold_weight_norm(gv[0].to(dtype), gv[1].to(dtype))
        missing = sorted(set(own) - set(folded))
        unexpected = sorted(set(folded) - set(own))
        if missing or unexpected:
            raise ModelDirError(
                f"hift checkpoint does not match HiFT({self.cfg.sampling_rate} Hz, "
                f"base_channels={self.cfg.base_channels}): missing keys {missing[:8]}, unexpected keys "
                f"{unexpected[:8]} ({len(missing)}/{len(unexpected)} in all); yaml and hift.pt of one model?"
            )
        for key, value in folded.items():
            if value.shape != own[key].shape:
                raise ModelDirError(
                    f"hift checkpoint: {key} has shape {tuple(value.shape)}, expected {tuple(own[key].shape)}"
                )
        self.load_state_dict(folded, strict=True)
        logger.debug("loaded hift checkpoint: %d tensors, %d weight norms folded", len(folded), len(pairs))

    # ---------------------------------------------------------------- forward pieces

    def _check_mel(self, mel: torch.Tensor) -> None:
        if mel.dim() != 3 or mel.shape[1] != self.cfg.in_channels:
            raise ConfigError(f"hift expects mel (B, {self.cfg.in_channels}, T), got {tuple(mel.shape)}")

    def f0(self, mel: torch.Tensor) -> torch.Tensor:
        """F0 predictor: ``mel (B, 80, T)`` -> F0 in Hz ``(B, T)``."""
        self._check_mel(mel)
        return self.f0_predictor(mel)

    def source(self, f0: torch.Tensor, noise: SourceNoise | torch.Generator | None = None) -> torch.Tensor:
        """Harmonic excitation: ``f0 (B, T)`` -> ``(B, 1, T * upsample)`` (``upsample`` = 480 for v2).

        ``noise`` is a :class:`SourceNoise`, a ``torch.Generator`` to draw it from, or ``None`` for torch's
        global RNG (same draws, same order as the official ``SourceModuleHnNSF2``).
        """
        if f0.dim() != 2:
            raise ConfigError(f"hift source expects f0 (B, T), got {tuple(f0.shape)}")
        # nearest-neighbour repeat through F.interpolate, exactly as the official nn.Upsample
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.cfg.upsample), mode="nearest")[:, 0]
        batch, length = f0_up.shape
        if not isinstance(noise, SourceNoise):
            noise = SourceNoise.draw(batch, length, self.m_source.harmonics, self.cfg.sine_type, generator=noise)
        expected = (batch, length, self.m_source.harmonics)
        if tuple(noise.sine_noise.shape) != expected or tuple(noise.initial_phase.shape) != expected[::2]:
            raise ConfigError(
                f"SourceNoise shapes {tuple(noise.initial_phase.shape)}/{tuple(noise.sine_noise.shape)} do not "
                f"match {expected[::2]}/{expected}"
            )
        return self.m_source(f0_up, noise).transpose(1, 2)

    def conv_post_input(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The upsampling stack: ``conv_pre`` output ``(B, C, T)`` and the source spectrum ``(B, n_fft + 2, F)``
        -> ``(B, C >> n_up, F)``, already through the final LeakyReLU (slope 0.01, as upstream)."""
        cfg = self.cfg
        n_res = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one more frame, to match the STFT's L / hop + 1
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            xs = self.resblocks[i * n_res](x)
            for j in range(1, n_res):
                xs = xs + self.resblocks[i * n_res + j](x)
            x = xs / n_res
        return F.leaky_relu(x)  # NB: default slope 0.01 here, as upstream

    def source_spectrum(self, source: torch.Tensor) -> torch.Tensor:
        """STFT of the source: ``(B, 1, L)`` -> ``(B, n_fft + 2, L / hop + 1)`` (real parts, then imaginary)."""
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop_len
        spec = torch.stft(source[:, 0], n_fft, hop, n_fft, window=self.stft_window, return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def spectrum_to_wave(self, x: torch.Tensor) -> torch.Tensor:
        """``conv_post`` output ``(B, n_fft + 2, F)`` -> wave ``(B, (F - 1) * hop)`` (unclamped):
        ``exp`` log-magnitudes clipped at 1e2, ``sin`` of the phase channels, inverse STFT."""
        n_fft, hop = self.cfg.istft_n_fft, self.cfg.istft_hop_len
        half = n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clamp(max=1e2)
        phase = torch.sin(x[:, half:])  # upstream's sin() on the predicted phase
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, n_fft, hop, n_fft, window=self.stft_window)
