"""Token encoder of the CosyVoice2 flow: the official ``UpsampleConformerEncoder``, inference only.

Pipeline (B batch, T tokens, D = ``output_size``; the token embedding is done by the caller):

    (B, T, D_in) --embed (Linear+LayerNorm, x*sqrt(D))--> PreLookahead (sees ``pre_lookahead_len`` future
    tokens, or the ``context`` tokens when the chunk is not final) --> ``num_blocks`` Conformer layers
    (rel-pos self-attention + FFN, pre-LN) --> Upsample x2 (nearest, causal Conv1d k=5) --> up_embed -->
    ``num_up_blocks`` Conformer layers --> after_norm --> (B, 2T, D)

Attention masks: full (padding only) or chunk-causal ("streaming"): query i sees every key j with
``j < (i // chunk + 1) * chunk``, chunk = ``static_chunk_size`` tokens before the upsampling and
``static_chunk_size * stride`` frames after it. State-dict keys match the official module.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def valid_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(B,)`` lengths -> bool ``(B, max_len)``, True on real frames (lengths above max_len saturate)."""
    return torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1, device: torch.device | None = None):
    """Chunk-causal visibility, bool ``(size, size)``: row i (query) may attend column j (key).

    Key j is visible iff it lies before the end of query i's chunk: ``j < (i // chunk + 1) * chunk``. With
    ``num_left_chunks >= 0`` keys older than that many chunks before i's chunk are hidden too. NOTE: the
    official ``subsequent_chunk_mask`` ignores ``num_left_chunks`` (all left context is always visible);
    callers that want official behaviour pass -1.
    """
    pos = torch.arange(size, device=device)
    chunk_idx = torch.div(pos, chunk_size, rounding_mode="trunc")
    visible = pos.unsqueeze(0) < ((chunk_idx + 1) * chunk_size).unsqueeze(1)
    if num_left_chunks >= 0:
        start = ((chunk_idx - num_left_chunks).clamp(min=0) * chunk_size).unsqueeze(1)
        visible &= pos.unsqueeze(0) >= start
    return visible


def attention_mask(valid: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Self-attention mask from a bool ``(B, T)`` valid mask: ``(B, 1, T)`` if ``chunk_size <= 0`` (full
    attention over real keys), else ``(B, T, T)`` chunk-causal. Rows with no visible key are opened
    entirely, as the official ``add_optional_chunk_mask`` does (those rows are padding)."""
    mask = valid.unsqueeze(1)
    if chunk_size > 0:
        mask = mask & chunk_mask(valid.size(1), chunk_size, -1, valid.device).unsqueeze(0)
    empty = mask.sum(dim=-1) == 0
    if bool(empty.any()):
        mask = mask.clone()
        mask[empty] = True
    return mask


def relative_position_encoding(size: int, d_model: int, device=None, dtype=None) -> torch.Tensor:
    """ESPnet relative positional encoding for ``size`` frames: ``(1, 2*size-1, d_model)``.

    Row k encodes relative position ``size-1-k`` (from +(size-1) down to -(size-1)); even channels are
    sin, odd channels cos, frequencies ``10000^(-2i/d_model)``.
    """
    position = torch.arange(size - 1, -size, -1, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pe = torch.zeros(2 * size - 1, d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.unsqueeze(0).to(device=device, dtype=dtype)


class LinearEmbed(nn.Module):
    """``input_layer: linear``: Linear + LayerNorm, then the rel-pos scaling ``x * sqrt(D)``."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(input_size, output_size), nn.LayerNorm(output_size, eps=1e-5))
        self.xscale = math.sqrt(output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D_in) -> (B, T, D)."""
        return self.out(x) * self.xscale


def pad_rel_rows(p: torch.Tensor) -> torch.Tensor:
    """(..., 2T-1, d) projected relative encodings -> (..., 2T, d) with a zero row appended, for :func:`rel_shift`."""
    return torch.cat([p, torch.zeros_like(p[..., :1, :])], dim=-2)


def rel_shift(scores: torch.Tensor, size: Any = None) -> torch.Tensor:
    """Relative shift: (B, H, Q, T+Q) scores of the Q query rows ``[a, a+Q)`` against the ``T+Q-1`` encodings of
    the relative positions they need (``a+Q-1`` down to ``a-(T-1)``) plus one zero row (:func:`block_encodings`)
    -> (B, H, Q, T), ``out[..., r, j]`` the score against the encoding of ``(a + r) - j``. ``size`` is T
    (default Q: all rows, the (B, H, T, 2T) scores against :func:`pad_rel_rows`).

    Row-major, that element sits at flat offset ``r*(T+Q) + Q-1-r+j = Q-1 + r*(T+Q-1) + j`` of each (Q, T+Q)
    matrix, so the shift is a view with row stride T+Q-1 starting at Q-1: one contiguous slice, a reshape and a
    column slice. The exported graph copies ~1.5 score matrices instead of building an expanded (B, H, Q, T)
    int64 index for a ``GatherElements`` (27 MB and ~14 ms per layer at 650 frames, full-size CosyVoice2).
    """
    b, h, rows = scores.size(0), scores.size(1), scores.size(2)
    size = rows if size is None else size
    flat = scores.reshape(b, h, -1)[:, :, rows - 1 : rows - 1 + rows * (size + rows - 1)]
    return flat.reshape(b, h, rows, size + rows - 1)[..., :size]


def block_encodings(p: torch.Tensor, size: Any, a: Any, b: Any) -> torch.Tensor:
    """The projected encodings (..., 2T, d) (:func:`pad_rel_rows`: relative positions T-1 .. -(T-1), then a zero
    row) that the query rows ``[a, b)`` read, with the zero row: (..., T + b - a, d), for :func:`rel_shift`."""
    return torch.cat([p[..., size - b : 2 * size - 1 - a, :], p[..., -1:, :]], dim=-2)


class RelPositionAttention(nn.Module):
    """Transformer-XL style multi-head self-attention with learned ``pos_bias_u``/``pos_bias_v``."""

    def __init__(self, n_head: int, n_feat: int) -> None:
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        # query rows in this many blocks, one after the other: the same numbers (each row's products and softmax
        # are its own), with score tensors of T/blocks rows (the export sets it: see export.flow.common)
        self.query_blocks = 1
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_head, self.d_k))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, H, d_k)
        return x.view(x.size(0), -1, self.h, self.d_k)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), bool mask (B, 1|T, T), pos_emb (1, 2T-1, D) -> (B, T, D)."""
        size = x.size(1)
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x)).transpose(1, 2)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        p = pad_rel_rows(self._heads(self.linear_pos(pos_emb)).transpose(1, 2))  # (1, H, 2T, d_k)
        qu, qv = (q + self.pos_bias_u).transpose(1, 2), (q + self.pos_bias_v).transpose(1, 2)  # (B, H, T, d_k)
        n = self.query_blocks
        parts = []
        for i in range(n):
            # block i's rows [a, b) are computed as rows [lo, hi), which hold them and are never empty (an empty
            # block would need zero-size reshapes, which ONNX's Reshape reads as "copy the input's dimension"):
            # lo <= a and lo <= T - 1; hi = b + 1 <= T before the last block. Extra work: <= 2 rows per block.
            a, b, lo, hi = 0, size, 0, size
            if n > 1:
                a, b, lo = size * i // n, size * (i + 1) // n, (size - 1) * i // n
                hi = size if i == n - 1 else b + 1
            content = torch.matmul(qu[:, :, lo:hi], k.transpose(-2, -1))  # (B, H, hi-lo, T)
            position = torch.matmul(qv[:, :, lo:hi], block_encodings(p, size, lo, hi).transpose(-2, -1))
            scores = (content + rel_shift(position, size)) / math.sqrt(self.d_k)
            hidden = ~(mask if mask.size(1) == 1 else mask[:, lo:hi]).unsqueeze(1)  # (B, 1, 1|hi-lo, T)
            attn = torch.softmax(scores.masked_fill(hidden, -float("inf")), dim=-1).masked_fill(hidden, 0.0)
            out = torch.matmul(attn, v)
            parts.append(out if n == 1 else out[:, :, a - lo : b - lo])
        out = parts[0] if n == 1 else torch.cat(parts, dim=2)
        return self.linear_out(out.transpose(1, 2).reshape(x.size(0), size, self.h * self.d_k))


class FeedForward(nn.Module):
    """Position-wise FFN ``w_2(SiLU(w_1(x)))``."""

    def __init__(self, size: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-LN Conformer layer as configured in CosyVoice2: no macaron FFN, no convolution module."""

    def __init__(self, size: int, n_head: int, linear_units: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(n_head, size)
        self.feed_forward = FeedForward(size, linear_units)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D)."""
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Look-ahead conv: Conv1d(k=L+1) over the next L tokens (zeros or ``context``), LeakyReLU, causal
    Conv1d(k=3), residual."""

    def __init__(self, channels: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D), context (B, L', D) with L' <= L future tokens or None -> (B, T, D)."""
        h = x.transpose(1, 2)
        n_ctx = 0
        if context is not None and context.size(1) > 0:
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
            n_ctx = context.size(1)
        h = F.pad(h, (0, self.pre_lookahead_len - n_ctx))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest-neighbour repeat by ``stride`` then a causal Conv1d(k = 2*stride+1)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D, T) -> (B, D, stride*T)."""
        h = torch.repeat_interleave(x, self.stride, dim=2)
        return self.conv(F.pad(h, (2 * self.stride, 0)))


class FlowEncoder(nn.Module):
    """Inference-only equivalent of the official ``UpsampleConformerEncoder`` (keys match ``encoder.*``)."""

    def __init__(
        self,
        input_size: int = 512,
        output_size: int = 512,
        attention_heads: int = 8,
        linear_units: int = 2048,
        num_blocks: int = 6,
        num_up_blocks: int = 4,
        static_chunk_size: int = 25,
        pre_lookahead_len: int = 3,
        upsample_stride: int = 2,
    ) -> None:
        super().__init__()
        self.output_size = output_size
        self.static_chunk_size = static_chunk_size
        self.embed = LinearEmbed(input_size, output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(output_size, pre_lookahead_len)
        self.encoders = nn.ModuleList(
            [ConformerLayer(output_size, attention_heads, linear_units) for _ in range(num_blocks)]
        )
        self.up_layer = Upsample(output_size, upsample_stride)
        self.up_embed = LinearEmbed(output_size, output_size)
        self.up_encoders = nn.ModuleList(
            [ConformerLayer(output_size, attention_heads, linear_units) for _ in range(num_up_blocks)]
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def forward(
        self,
        xs: torch.Tensor,
        xs_lens: torch.Tensor,
        context: torch.Tensor | None = None,
        streaming: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode embedded tokens.

        Args:
            xs: (B, T, D_in) embedded tokens (padding rows zeroed by the caller).
            xs_lens: (B,) token counts; values above T (the official non-final call passes the length
                including the look-ahead context) count as T.
            context: (B, L, D_in) embedded look-ahead tokens that follow ``xs`` (non-final chunk), or None.
            streaming: chunk-causal masks (``static_chunk_size`` tokens, ``static_chunk_size*stride``
                frames) instead of full attention.
        Returns:
            (B, stride*T, D) encoder output and its (B, 1, stride*T) bool valid mask.
        """
        size = xs.size(1)
        valid = valid_mask(xs_lens, size)
        xs = self.embed(xs)
        ctx = self.embed(context) if context is not None and context.size(1) > 0 else None
        chunk = self.static_chunk_size if streaming else 0
        mask = attention_mask(valid, chunk)
        pos_emb = relative_position_encoding(size, self.output_size, xs.device, xs.dtype)
        xs = self.pre_lookahead_layer(xs, ctx)
        for layer in self.encoders:
            xs = layer(xs, mask, pos_emb)

        stride = self.up_layer.stride
        xs = self.up_layer(xs.transpose(1, 2)).transpose(1, 2)
        size = xs.size(1)
        valid = valid_mask(xs_lens * stride, size)
        xs = self.up_embed(xs)
        mask = attention_mask(valid, chunk * stride)
        pos_emb = relative_position_encoding(size, self.output_size, xs.device, xs.dtype)
        for layer in self.up_encoders:
            xs = layer(xs, mask, pos_emb)
        return self.after_norm(xs), valid.unsqueeze(1)
