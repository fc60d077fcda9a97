"""The v1 flow's length regulator (official ``cosyvoice.flow.length_regulator.InterpolateRegulator``).

CosyVoice-300M speech tokens come at 50 Hz and its mel at 22050 / 256 = 86.13 Hz, so token features are stretched
by linear interpolation (``F.interpolate(mode='linear')``, ``align_corners=False``) to the mel length, then
refined by ``len(sampling_ratios)`` x [Conv1d k3 + GroupNorm + Mish] and a 1x1 Conv1d.

At inference the prompt part and the new part are interpolated *separately*, so the prompt/new boundary falls
exactly on a mel frame; a new part longer than 40 tokens is further split into head (20 tokens), middle and
tail (20 tokens), head and tail each becoming ``int(20 / 50 * 22050 / 256) = 34`` frames, so that streaming
chunks that overlap by 20 tokens produce the same frames at the overlap. The official code hard-codes
22050 / 256 here and in the flow (``frames_for_tokens``), whatever the yaml's mel settings.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MEL_FRAMES_PER_SECOND = 22050 / 256  # hard-coded by the official flow and length regulator
OVERLAP_TOKENS = 20  # the official ``token_overlap_len`` of v1 streaming, hard-coded in the regulator
SPLIT_ABOVE_TOKENS = 2 * OVERLAP_TOKENS


def frames_for_tokens(n_tokens: int, input_frame_rate: int) -> int:
    """Mel frames for ``n_tokens`` speech tokens, as the official ``int(n / rate * 22050 / 256)`` (same float ops)."""
    return int(n_tokens / input_frame_rate * 22050 / 256)


def _stretch(x: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, T, C) -> (B, C, frames) by linear interpolation."""
    return F.interpolate(x.transpose(1, 2).contiguous(), size=frames, mode="linear")


class InterpolateRegulator(nn.Module):
    """Interpolation to mel length + conv refinement; ``model.*`` keys equal the official module's."""

    def __init__(self, channels: int = 80, n_blocks: int = 4, out_channels: int | None = None, groups: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(n_blocks):
            layers += [nn.Conv1d(channels, channels, 3, 1, 1), nn.GroupNorm(groups, channels), nn.Mish()]
        layers.append(nn.Conv1d(channels, out_channels or channels, 1, 1))
        self.model = nn.Sequential(*layers)

    def stretch(
        self, x1: torch.Tensor, x2: torch.Tensor, mel_len1: int, mel_len2: int, input_frame_rate: int = 50
    ) -> torch.Tensor:
        """The interpolation alone: prompt x1 (1, T1, C) -> mel_len1 frames, new x2 (1, T2, C) -> mel_len2 frames.

        Returns:
            (1, C, mel_len1 + mel_len2), before the conv stack. With T2 > 40 the new part is stretched as
            head / middle / tail (20 / T2-40 / 20 tokens -> 34 / mel_len2-68 / 34 frames at 50 Hz).
        """
        if x2.shape[1] > SPLIT_ABOVE_TOKENS:
            edge = frames_for_tokens(OVERLAP_TOKENS, input_frame_rate)
            if mel_len2 - 2 * edge <= 0:
                raise ValueError(f"mel_len2 {mel_len2} leaves no frames for the middle of {x2.shape[1]} tokens")
            k = OVERLAP_TOKENS
            parts = [_stretch(x2[:, :k], edge), _stretch(x2[:, k:-k], mel_len2 - 2 * edge), _stretch(x2[:, -k:], edge)]
            new = torch.cat(parts, dim=2)
        else:
            new = _stretch(x2, mel_len2)
        if x1.shape[1] == 0:
            return new
        return torch.cat([_stretch(x1, mel_len1), new], dim=2)

    def inference(
        self, x1: torch.Tensor, x2: torch.Tensor, mel_len1: int, mel_len2: int, input_frame_rate: int = 50
    ) -> tuple[torch.Tensor, int]:
        """Official ``inference``: (1, T1, C), (1, T2, C) -> ((1, mel_len1 + mel_len2, C_out), total frames).

        The conv stack runs over prompt and new frames together (its kernels see across the boundary).
        """
        x = self.stretch(x1, x2, mel_len1, mel_len2, input_frame_rate)
        return self.model(x).transpose(1, 2).contiguous(), mel_len1 + mel_len2

    def forward(self, x: torch.Tensor, ylens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Official ``forward`` (one uniform stretch, as in training): x (B, T, C), ylens (B,) -> (B, max, C_out)."""
        mask = (torch.arange(int(ylens.max())).unsqueeze(0) < ylens.unsqueeze(1)).to(x).unsqueeze(-1)
        h = _stretch(x, int(ylens.max()))
        return self.model(h).transpose(1, 2).contiguous() * mask, ylens
