"""F0 predictor and neural-source-filter excitation of the HiFT vocoder (inference only).

The vocoder predicts one F0 value per mel frame, repeats it to the sample rate and turns it into a harmonic
"source" signal: ``nb_harmonics + 1`` sines at multiples of F0, zeroed where F0 is below the voiced threshold,
plus Gaussian noise, merged into one channel by a ``Linear`` + ``tanh``. Two sine generators exist upstream:

* ``"v2"`` (CosyVoice2, any rate other than 22050 Hz): the per-sample phase increment is linearly
  *down*-sampled to the frame rate, integrated there and linearly up-sampled back, so the phase is smooth.
* ``"v1"`` (CosyVoice-300M, 22050 Hz): the phase is the running sum of the per-sample increment, wrapped.
* ``"v3"`` (Fun-CosyVoice3 ``SineGen2(causal=True)``): as ``"v2"`` but the frame-rate phase is repeated
  (nearest, not linear) back to the sample rate, and upstream takes the noise from fixed *uniform* [0, 1)
  tables instead of fresh Gaussian draws (see :meth:`SourceNoise.draw`).

All randomness is in :class:`SourceNoise`; :meth:`SourceNoise.draw` consumes torch's RNG exactly as the
official code does (same order, same shapes), so seeding both gives the same source.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

SINE_TYPES = ("v1", "v2", "v3")


@dataclass
class SourceNoise:
    """The random draws of one source computation.

    Attributes:
        initial_phase: ``(B, H)`` uniform in ``[0, 1)``, one initial phase per harmonic (``H = nb_harmonics + 1``),
            as a fraction of a turn (v2: cycles; v1: mapped to ``[-pi, pi)``); column 0 (the fundamental) is
            ignored and its phase set to 0, as upstream.
        sine_noise: ``(B, L, H)`` standard normal at the sample rate (``L = T * upsample``), scaled inside by
            ``nsf_sigma`` (voiced samples) or ``nsf_alpha / 3`` (unvoiced samples). v3: uniform [0, 1), the first
            L rows of upstream's fixed ``sine_waves`` table (the batch shares it).
    """

    initial_phase: torch.Tensor
    sine_noise: torch.Tensor

    @classmethod
    def draw(
        cls,
        batch: int,
        length: int,
        harmonics: int,
        sine_type: str = "v2",
        generator: torch.Generator | None = None,
    ) -> SourceNoise:
        """Draw the noise in the official order: initial phases, sine noise, then the unused noise branch.

        The official source module also draws a ``(B, L, 1)`` "noise branch" tensor that it returns but nobody
        uses; we draw and drop it so the RNG state after the call matches too. ``"v3"`` draws fresh uniform
        numbers of the right distribution (upstream slices tables drawn once at construction instead).
        """
        if sine_type not in SINE_TYPES:
            raise ConfigError(f"sine_type must be one of {SINE_TYPES}, got {sine_type!r}")
        if sine_type == "v3":
            phase = torch.rand(batch, harmonics, generator=generator)
            return cls(initial_phase=phase, sine_noise=torch.rand(batch, length, harmonics, generator=generator))
        if sine_type == "v2":
            phase = torch.rand(batch, harmonics, generator=generator)
            # randn_like of a (B, L, H) *view* of a (B, H, L) tensor: randn_like keeps those strides, and normal_
            # on a non-contiguous tensor takes torch's scalar (not the vectorised) path, so we draw into the very
            # same strided layout to get the same numbers
            noise = torch.empty(batch, harmonics, length).transpose(1, 2).normal_(generator=generator)
        else:  # Uniform(-pi, pi).sample((B, H, 1)), then randn_like of a contiguous (B, H, L) tensor
            phase = torch.rand(batch, harmonics, 1, generator=generator)[..., 0]
            noise = torch.randn(batch, harmonics, length, generator=generator).transpose(1, 2)
        torch.randn(batch, length, 1, generator=generator)  # official noise branch, discarded
        return cls(initial_phase=phase, sine_noise=noise)


class F0Predictor(nn.Module):
    """``ConvRNNF0Predictor``: five weight-normed k=3 convs with ELU, then a per-frame linear head, abs."""

    def __init__(self, in_channels: int = 80, cond_channels: int = 512, num_class: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # conv indices 0, 2, 4, 6, 8 match the checkpoint keys
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """``mel (B, C_in, T)`` -> non-negative F0 in Hz ``(B, T)`` (``num_class`` is 1)."""
        h = self.condnet(mel).transpose(1, 2)  # (B, T, C)
        return self.classifier(h).squeeze(-1).abs()


class HarmonicSource(nn.Module):
    """Sine generator plus the ``Linear(H, 1)`` + ``tanh`` merge (upstream ``m_source``)."""

    def __init__(
        self,
        sampling_rate: int,
        upsample: int,
        nb_harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
        sine_type: str = "v2",
    ) -> None:
        super().__init__()
        if sine_type not in SINE_TYPES:
            raise ConfigError(f"sine_type must be one of {SINE_TYPES}, got {sine_type!r}")
        self.sampling_rate = sampling_rate
        self.upsample = upsample
        self.harmonics = nb_harmonics + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.sine_type = sine_type
        self.l_linear = nn.Linear(self.harmonics, 1)

    def _phase_v2(self, f0: torch.Tensor, initial_phase: torch.Tensor) -> torch.Tensor:
        """``f0 (B, L, 1)`` -> phase in radians ``(B, H, L)``, integrated at the frame rate (v3: held constant
        over each frame's samples)."""
        k = torch.arange(1, self.harmonics + 1, dtype=f0.dtype)
        step = (f0 * k / self.sampling_rate) % 1  # (B, L, H) cycles per sample
        initial_phase = initial_phase.clone()
        initial_phase[:, 0] = 0  # the fundamental starts at phase 0
        step[:, 0, :] += initial_phase  # only sample 0; the down-sampling below never reads it when upsample > 1
        step = step.transpose(1, 2)
        frames = F.interpolate(step, scale_factor=1 / self.upsample, mode="linear")  # (B, H, T)
        phase = torch.cumsum(frames, dim=-1) * 2 * math.pi
        mode = "nearest" if self.sine_type == "v3" else "linear"
        return F.interpolate(phase * self.upsample, scale_factor=float(self.upsample), mode=mode)

    def _phase_v1(self, f0: torch.Tensor, initial_phase: torch.Tensor) -> torch.Tensor:
        """``f0 (B, L, 1)`` -> phase in radians ``(B, H, L)``, a wrapped running sum at the sample rate."""
        f0 = f0.transpose(1, 2)  # (B, 1, L)
        step = torch.cat([f0 * (i + 1) / self.sampling_rate for i in range(self.harmonics)], dim=1)
        start = -math.pi + initial_phase * (2 * math.pi)  # Uniform(-pi, pi) radians
        start[:, 0] = 0  # the fundamental starts at phase 0
        return 2 * math.pi * (torch.cumsum(step, dim=-1) % 1) + start[..., None]

    def forward(self, f0: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        """``f0 (B, L)`` in Hz at the sample rate -> merged excitation ``(B, L, 1)`` in ``[-1, 1]``."""
        f0 = f0[..., None]  # (B, L, 1)
        if self.sine_type in ("v2", "v3"):
            sines = torch.sin(self._phase_v2(f0, noise.initial_phase)) * self.sine_amp
        else:
            sines = self.sine_amp * torch.sin(self._phase_v1(f0, noise.initial_phase))
        sines = sines.transpose(1, 2)  # (B, L, H)
        uv = (f0 > self.voiced_threshold).to(f0.dtype)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        sines = sines * uv + noise_amp * noise.sine_noise
        return torch.tanh(self.l_linear(sines))
