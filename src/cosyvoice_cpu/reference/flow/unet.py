"""Flow-matching estimator of CosyVoice-300M: the official ``cosyvoice.flow.decoder.ConditionalDecoder``.

A non-causal 1-D UNet over ``cat[x, mu, spks (broadcast), cond]`` (B, 320, T), one resolution per entry of
``channels`` (v1: [256, 256], i.e. T and T/2):

    down i: ResnetBlock1D -> n_blocks transformer blocks -> (skip) -> Conv1d k3 stride 2 (last: stride 1)
    mid:    num_mid_blocks x (ResnetBlock1D + n_blocks transformer blocks) at the lowest resolution
    up i:   cat[h[:, :, :T_skip], skip] -> ResnetBlock1D -> transformer blocks -> ConvTranspose1d(4, 2, 1)
            (last: Conv1d k3)
    final:  Block1D -> 1x1 Conv1d -> (B, 80, T), multiplied by the mask

Blocks are Matcha's: ``Block1D`` = Conv1d k3 + GroupNorm(8) + Mish under the mask; ``ResnetBlock1D`` adds the
time embedding (Mish + Linear) between two blocks, plus a 1x1 residual conv. Transformer blocks are the same
diffusers-style ``BasicTransformerBlock`` as v2 (:class:`.causal_unet.TransformerBlock`), full attention
over the real frames of each resolution (mask ``mask[:, :, ::2]`` after every downsampling, official rule).
State-dict keys equal ``decoder.estimator.*`` of the released ``flow.pt``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.flow.causal_unet import (
    MASK_BIAS,
    CausalResnetBlock,
    FlowEstimator,
    TimestepMLP,
    TransformerBlock,
    timestep_embedding,
)
from cosyvoice_cpu.reference.flow.cfm import class_args, need
from cosyvoice_cpu.reference.flow.common import unet_args

logger = logging.getLogger(__name__)

GROUPS = 8  # Matcha's Block1D GroupNorm groups (not configurable upstream)


@dataclass
class UNetEstimatorConfig:
    """``ConditionalDecoder`` arguments; defaults are the released CosyVoice-300M values."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256, 256)
    dropout: float = 0.0
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"

    def validate(self) -> None:
        ch = self.channels
        need(len(ch) >= 1 and all(c > 0 for c in ch), "estimator.channels", "must be positive, >= 1 entry")
        need(all(c % GROUPS == 0 for c in ch), "estimator.channels", f"must be multiples of {GROUPS} (GroupNorm)")
        need(len(set(ch)) == 1, "estimator.channels", "must all be equal (the official mid/up blocks assume it)")
        for name in ("in_channels", "out_channels", "attention_head_dim", "n_blocks", "num_heads"):
            need(getattr(self, name) > 0, f"estimator.{name}", "must be > 0")
        need(self.num_mid_blocks >= 0, "estimator.num_mid_blocks", "must be >= 0")
        need(self.act_fn == "gelu", f"estimator.act_fn = {self.act_fn!r}", "is not supported (want 'gelu')")

    @classmethod
    def from_yaml(cls, node: Any) -> UNetEstimatorConfig:
        """Read ``flow.decoder.estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder`` (official defaults)."""
        if node is None:
            raise ConfigError("flow config: flow.decoder.estimator is missing, expected ConditionalDecoder")
        a = class_args(node, "ConditionalDecoder", "flow.decoder.estimator")
        if "in_channels" not in a or "out_channels" not in a:
            raise ConfigError("flow config: flow.decoder.estimator needs in_channels and out_channels")
        cfg = cls(in_channels=int(a["in_channels"]), out_channels=int(a["out_channels"]), **unet_args(a))
        cfg.validate()
        return cfg


class Block1D(nn.Module):
    """``mask * Mish(GroupNorm(Conv1d_k3(x * mask)))`` on (B, C, T)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(GROUPS, dim_out), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class ResnetBlock1D(CausalResnetBlock):
    """Two :class:`Block1D` with the projected time embedding added in between, plus a 1x1 residual conv."""

    block = Block1D


class Resample(nn.Module):
    """Matcha's ``Downsample1D`` (Conv1d k3 s2 p1) or ``Upsample1D`` (ConvTranspose1d k4 s2 p1): key ``conv``."""

    def __init__(self, dim: int, up: bool) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1) if up else nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T) -> (B, C, 2T) up, (B, C, ceil(T/2)) down."""
        return self.conv(x)


def full_attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, T) float 0/1 mask -> (B, T, T) additive bias: 0 on real keys, -1e10 on padding.

    As the official ``add_optional_chunk_mask(..., 0, 0, -1)`` + ``mask_to_bias``: a row without any real key
    (an all-padding batch row) is opened entirely.
    """
    visible = mask.bool().expand(-1, mask.size(-1), -1)
    empty = visible.sum(dim=-1) == 0
    if bool(empty.any()):
        visible = visible.clone()
        visible[empty] = True
    return (1.0 - visible.to(mask.dtype)) * MASK_BIAS


class UNetEstimator(nn.Module):
    """Inference-only equivalent of the official v1 ``ConditionalDecoder``."""

    def __init__(self, cfg: UNetEstimatorConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or UNetEstimatorConfig()
        cfg.validate()
        self.cfg = cfg
        channels = cfg.channels
        time_dim = channels[0] * 4
        self.time_mlp = TimestepMLP(cfg.in_channels, time_dim)

        def stage(dim_in: int, dim: int, last: nn.Module) -> nn.ModuleList:
            # official key layout: <i>.0 resnet, <i>.1.<j> transformer blocks, <i>.2 resampling conv
            blocks = nn.ModuleList(
                TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim) for _ in range(cfg.n_blocks)
            )
            parts: list[nn.Module] = [ResnetBlock1D(dim_in, dim, time_dim), blocks]
            return nn.ModuleList(parts + ([last] if last is not None else []))

        n = len(channels)
        self.down_blocks = nn.ModuleList()
        dim_in = cfg.in_channels
        for i, ch in enumerate(channels):
            last = nn.Conv1d(ch, ch, 3, padding=1) if i == n - 1 else Resample(ch, up=False)
            self.down_blocks.append(stage(dim_in, ch, last))
            dim_in = ch
        self.mid_blocks = nn.ModuleList(stage(channels[-1], channels[-1], None) for _ in range(cfg.num_mid_blocks))
        ups = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(n):
            ch = ups[i + 1]
            last = nn.Conv1d(ch, ch, 3, padding=1) if i == n - 1 else Resample(ch, up=True)
            self.up_blocks.append(stage(2 * ups[i], ch, last))
        self.final_block = Block1D(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], cfg.out_channels, 1)

    @staticmethod
    def _run(stage: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        """The v2 stage runner with full attention over this resolution's mask; returns (B, C, T)."""
        return FlowEstimator._run(stage, x, mask, t_emb, full_attention_bias(mask))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
        chunk_id: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity estimate (the official estimator contract: x, mask, mu, t, spks, cond).

        Args:
            x: (B, 80, T) current sample; mask: (B, 1, T) float, 1 on real frames; mu: (B, 80, T) encoder
            condition; t: (B,) flow time; spks: (B, 80) speaker; cond: (B, 80, T) prompt mel then zeros.
            streaming, chunk_id: accepted for the shared solver interface; v1 attention is always full (the
            official ``ConditionalDecoder`` ignores ``streaming`` too).
        Returns:
            (B, 80, T) velocity, zero on padded frames.
        """
        if chunk_id is not None:
            raise ConfigError("the v1 estimator has no chunk-causal mode; chunk_id must be None")
        t_emb = self.time_mlp(timestep_embedding(t, self.cfg.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)

        skips: list[torch.Tensor] = []
        masks = [mask]
        for stage in self.down_blocks:
            m = masks[-1]
            h = self._run(stage, h, m, t_emb)
            skips.append(h)
            h = stage[2](h * m)
            masks.append(m[:, :, ::2])
        masks.pop()  # the mask after the last (stride-1) conv is never used, as upstream
        for stage in self.mid_blocks:
            h = self._run(stage, h, masks[-1], t_emb)
        for stage in self.up_blocks:
            m, skip = masks.pop(), skips.pop()
            h = self._run(stage, torch.cat([h[:, :, : skip.size(-1)], skip], dim=1), m, t_emb)
            h = stage[2](h * m)
        h = self.final_block(h, m)
        return self.final_proj(h * m) * mask
