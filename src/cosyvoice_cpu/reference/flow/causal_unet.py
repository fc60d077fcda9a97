"""Flow-matching estimator of CosyVoice2: the official ``CausalConditionalDecoder``, inference only.

A single-resolution causal 1-D "UNet" predicting the velocity field ``v(x_t, t | mu, spks, cond)``:

    cat[x, mu, spks (broadcast over time), cond] (B, 320, T) --> down: CausalResnetBlock + n_blocks
    transformer blocks + CausalConv1d(k=3) --> num_mid_blocks x (CausalResnetBlock + n_blocks transformer
    blocks) --> up: cat[h, skip] CausalResnetBlock + n_blocks transformer blocks + CausalConv1d(k=3) -->
    CausalBlock --> 1x1 Conv --> (B, 80, T)

Convolutions only look left (left zero pad k-1), so the only look-ahead is inside attention: full attention
over the real frames, or chunk-causal (``streaming``: frame i sees every frame before the end of its
``static_chunk_size``-frame chunk). Attention masks are additive biases ``(1 - mask) * -1e10``, as in the
official code (its ONNX export has the same contract). State-dict keys match ``decoder.estimator.*``.

v1 (``ConditionalDecoder``: non-causal convs, GroupNorm, down/up-sampling between resolutions) is
:mod:`.unet`, which reuses this module's transformer block and time embedding; v3 (``DiT``) will be
another estimator with the same ``forward`` contract.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.reference.flow.encoder import chunk_mask

logger = logging.getLogger(__name__)

MASK_BIAS = -1.0e10  # the official ``mask_to_bias`` value (not -inf, not finfo.min)


def timestep_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal embedding of flow time: (B,) -> (B, dim) = cat[sin, cos] of ``scale*t*10000^(-k/(dim/2-1))``."""
    if t.ndim < 1:
        t = t.unsqueeze(0)
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    args = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((args.sin(), args.cos()), dim=-1).to(t.dtype)


class CausalConv1d(nn.Conv1d):
    """Conv1d with ``kernel_size-1`` zeros padded on the left only (output length = input length)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class Transpose(nn.Module):
    """Swap two dims (lets a LayerNorm over channels sit in an ``nn.Sequential`` over (B, C, T))."""

    def __init__(self, dim0: int, dim1: int) -> None:
        super().__init__()
        self.dim0, self.dim1 = dim0, dim1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(self.dim0, self.dim1)


class CausalBlock(nn.Module):
    """``mask * Mish(LayerNorm_C(CausalConv1d_k3(x * mask)))`` on (B, C, T)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), Transpose(1, 2), nn.LayerNorm(dim_out), Transpose(1, 2), nn.Mish()
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock(nn.Module):
    """Two causal blocks with the time embedding added in between, plus a 1x1 residual projection.

    ``block`` is the conv block class (CosyVoice-300M's UNet uses the same layout with GroupNorm blocks)."""

    block: type[nn.Module] = CausalBlock

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = self.block(dim, dim_out)
        self.block2 = self.block(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        """x (B, C_in, T), mask (B, 1, T), t_emb (B, E) -> (B, C_out, T)."""
        h = self.block1(x, mask) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class TimestepMLP(nn.Module):
    """``linear_2(SiLU(linear_1(emb)))``."""

    def __init__(self, in_channels: int, time_embed_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class SelfAttention(nn.Module):
    """Multi-head self-attention (no q/k/v bias, biased output projection), additive float mask."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, C), bias (B, T, T) additive -> (B, T, C)."""
        b, size, _ = x.shape

        def split(h: torch.Tensor) -> torch.Tensor:
            return h.view(b, size, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(1))
        return self.to_out[0](out.transpose(1, 2).reshape(b, size, -1))


class GeluProj(nn.Module):
    """``GELU(proj(x))`` (exact erf GELU), the first half of the transformer FFN."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(LN1(x))`` then ``x + FFN(LN3(x))``; FFN = Linear(C,4C), GELU, Linear(4C,C)."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, dim_head)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([GeluProj(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, C), bias (B, T, T) -> (B, T, C)."""
        x = x + self.attn1(self.norm1(x), bias)
        h = self.norm3(x)
        for layer in self.ff.net:
            h = layer(h)
        return x + h


class FlowEstimator(nn.Module):
    """Inference-only equivalent of the official ``CausalConditionalDecoder`` (single resolution)."""

    def __init__(
        self,
        in_channels: int = 320,
        out_channels: int = 80,
        channels: int = 256,
        attention_head_dim: int = 64,
        n_blocks: int = 4,
        num_mid_blocks: int = 12,
        num_heads: int = 8,
        static_chunk_size: int = 50,
        num_decoding_left_chunks: int = -1,
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.static_chunk_size = static_chunk_size
        # The official decoder always builds its chunk mask with all left chunks visible, whatever the yaml
        # says; kept here for a future bounded-cache streaming mode (pass it to chunk_mask to use it).
        self.num_decoding_left_chunks = num_decoding_left_chunks
        time_dim = channels * 4
        self.time_mlp = TimestepMLP(in_channels, time_dim)

        def stage(dim: int, post_conv: bool) -> nn.ModuleList:
            # official key layout: <i>.0 resnet block, <i>.1.<j> transformer blocks, <i>.2 post conv
            blocks = [TransformerBlock(channels, num_heads, attention_head_dim) for _ in range(n_blocks)]
            parts = [CausalResnetBlock(dim, channels, time_dim), nn.ModuleList(blocks)]
            return nn.ModuleList(parts + ([CausalConv1d(channels, channels, 3)] if post_conv else []))

        self.down_blocks = nn.ModuleList([stage(in_channels, post_conv=True)])
        self.mid_blocks = nn.ModuleList([stage(channels, post_conv=False) for _ in range(num_mid_blocks)])
        self.up_blocks = nn.ModuleList([stage(2 * channels, post_conv=True)])
        self.final_block = CausalBlock(channels, channels)
        self.final_proj = nn.Conv1d(channels, out_channels, 1)

    def attention_bias(self, mask: torch.Tensor, streaming: bool, chunk_id: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 1, T) float 0/1 mask -> (B, T, T) additive bias: 0 where visible, -1e10 elsewhere.

        ``chunk_id`` (B, T) int (streaming only): key j visible from query i iff ``chunk_id[j] <= chunk_id[i]``;
        the default ``i // static_chunk_size`` is the official chunk-causal mask.
        """
        visible = mask.bool().expand(-1, mask.size(-1), -1)
        if streaming and chunk_id is not None:
            visible = visible & (chunk_id.unsqueeze(1) <= chunk_id.unsqueeze(2))
        elif streaming:
            visible = visible & chunk_mask(mask.size(-1), self.static_chunk_size, -1, mask.device).unsqueeze(0)
        if streaming:
            empty = visible.sum(dim=-1) == 0  # official add_optional_chunk_mask re-opens empty rows
            if bool(empty.any()):
                visible = visible.clone()
                visible[empty] = True
        return (1.0 - visible.to(mask.dtype)) * MASK_BIAS

    @staticmethod
    def _run(
        blocks: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Resnet block on (B, C, T), then the transformer blocks on (B, T, C); returns (B, C, T)."""
        x = blocks[0](x, mask, t_emb).transpose(1, 2)
        for block in blocks[1]:
            x = block(x, bias)
        return x.transpose(1, 2)

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
        """Velocity estimate (the official ONNX estimator contract).

        Args:
            x: (B, 80, T) current sample x_t.
            mask: (B, 1, T) float, 1 on real frames.
            mu: (B, 80, T) encoder condition.
            t: (B,) flow time in [0, 1].
            spks: (B, 80) projected speaker embedding.
            cond: (B, 80, T) prompt mel (zeros after the prompt).
            streaming: chunk-causal attention (``static_chunk_size`` frames) instead of full attention.
            chunk_id: (B, T) int chunk index per frame (streaming only; see :meth:`attention_bias`).
        Returns:
            (B, 80, T) velocity, zero on padded frames.
        """
        t_emb = self.time_mlp(timestep_embedding(t, self.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)
        bias = self.attention_bias(mask, streaming, chunk_id)

        down = self.down_blocks[0]
        h = self._run(down, h, mask, t_emb, bias)
        skip = h
        h = down[2](h * mask)
        for mid in self.mid_blocks:
            h = self._run(mid, h, mask, t_emb, bias)
        up = self.up_blocks[0]
        h = self._run(up, torch.cat([h[:, :, : skip.size(-1)], skip], dim=1), mask, t_emb, bias)
        h = up[2](h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask
