"""ESPnet/WeNet-style encoders of CosyVoice-300M (v1), inference only.

Two stacks share the relative-position self-attention of :mod:`.flow.encoder` (``rel_pos_espnet``:
Transformer-XL scores ``(q + u)·k + (q + v)·W_pos·pe(i - j)`` with learned ``pos_bias_u``/``pos_bias_v``):

- :class:`ConformerEncoder` — the official ``cosyvoice.transformer.encoder.ConformerEncoder`` as v1 configures it
  (``input_layer: linear`` = Linear + LayerNorm, then ``x * sqrt(D)``; pre-LN layers with rel-pos attention and
  a SiLU FFN; no macaron FFN, no convolution module; ``after_norm``). It is the LM's 6-layer text encoder
  (causal: ``static_chunk_size: 1``) and the flow's 6-layer token encoder (full attention).
- :class:`TransformerStack` — the official ``TransformerEncoder`` the v1 LM uses as its 14-layer decoder
  (``input_layer: linear_legacy`` = Linear + LayerNorm + ReLU, then ``x * sqrt(D)``; ReLU FFN; ``norm1``/``norm2``),
  run causally with an explicit KV cache (the official ``forward_chunk`` keeps K and V concatenated in one
  ``(layers, heads, t, 2*d_k)`` tensor; we keep them apart).

State-dict keys equal the official modules' (``embed.out.{0,1}``, ``after_norm``, ``encoders.N.self_attn.
{linear_q,linear_k,linear_v,linear_out,linear_pos,pos_bias_u,pos_bias_v}``, ``feed_forward.{w_1,w_2}``, ...).
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
from cosyvoice_cpu.reference.flow.encoder import (
    ConformerLayer,
    LinearEmbed,
    RelPositionAttention,
    attention_mask,
    relative_position_encoding,
    valid_mask,
)
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

# What v1 configures; anything else in a yaml is refused rather than silently computed differently.
# (key, official constructor default, the only value we implement)
_COMMON = (
    ("pos_enc_layer_type", None, "rel_pos_espnet"),
    ("selfattention_layer_type", None, "rel_selfattn"),
    ("normalize_before", True, True),
    ("key_bias", True, True),
    ("global_cmvn", None, None),
)
_CONFORMER = _COMMON + (
    ("input_layer", "conv2d", "linear"),
    ("use_cnn_module", True, False),
    ("macaron_style", True, False),
    ("activation_type", "swish", "swish"),
)
_TRANSFORMER = _COMMON + (("input_layer", "conv2d", "linear_legacy"), ("activation_type", "relu", "relu"))
_DEFAULT_POS = {"ConformerEncoder": "rel_pos", "TransformerEncoder": "abs_pos"}


@dataclass
class EncoderConfig:
    """A ``ConformerEncoder`` or ``TransformerEncoder`` yaml entry, as far as inference needs it.

    ``chunk_size`` is the attention chunk the official *caller* ends up with (0 = full attention, 1 = causal);
    see :meth:`from_yaml`.
    """

    input_size: int
    output_size: int = 256
    attention_heads: int = 4
    linear_units: int = 2048
    num_blocks: int = 6
    chunk_size: int = 0

    def validate(self, where: str) -> None:
        for name in ("input_size", "output_size", "attention_heads", "linear_units", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be > 0, got {getattr(self, name)}")
        if self.output_size % self.attention_heads:
            raise ConfigError(f"{where}.attention_heads ({self.attention_heads}) must divide output_size")
        if self.chunk_size < 0:
            raise ConfigError(f"{where}: attention chunk must be >= 0, got {self.chunk_size}")

    @classmethod
    def from_yaml(cls, node: Any, expected: str, where: str, decoding_chunk_size: int = 0) -> EncoderConfig:
        """Read a ``!new:cosyvoice.transformer.encoder.<expected>`` node.

        ``decoding_chunk_size`` is what the official caller passes to ``forward`` (the LM's text encoder: 1, the
        flow's encoder: 0). With ``use_dynamic_chunk`` it picks the chunk (0 would draw a random training chunk,
        refused); otherwise ``static_chunk_size`` (0 = full attention) decides, as ``add_optional_chunk_mask``.
        """
        if not isinstance(node, Tagged) or node.class_name != expected:
            name = node.class_name if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(f"{where} is {name}, expected {expected}")
        a = dict(node.args) if isinstance(node.args, dict) else {}
        rules = _CONFORMER if expected == "ConformerEncoder" else _TRANSFORMER
        for key, default, want in rules:
            default = _DEFAULT_POS[expected] if key == "pos_enc_layer_type" else default
            got = a.get(key, default)
            if got != want:
                raise ConfigError(f"{where}.{key} = {got!r} is not supported (CosyVoice-300M uses {want!r})")
        if a.get("use_dynamic_chunk", False):
            if decoding_chunk_size == 0:
                raise ConfigError(f"{where}: use_dynamic_chunk with a random training chunk is not an inference mode")
            chunk = 0 if decoding_chunk_size < 0 else decoding_chunk_size
        else:
            chunk = int(a.get("static_chunk_size", 0))
        cfg = cls(
            input_size=int(a["input_size"]) if "input_size" in a else 0,
            output_size=int(a.get("output_size", 256)),
            attention_heads=int(a.get("attention_heads", 4)),
            linear_units=int(a.get("linear_units", 2048)),
            num_blocks=int(a.get("num_blocks", 6)),
            chunk_size=chunk,
        )
        cfg.validate(where)
        return cfg


class ConformerEncoder(nn.Module):
    """The v1 Conformer encoder: ``(B, T, D_in)`` embedded tokens -> ``(B, T, D)``."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        cfg.validate("conformer encoder")
        self.cfg = cfg
        self.embed = LinearEmbed(cfg.input_size, cfg.output_size)
        self.after_norm = nn.LayerNorm(cfg.output_size, eps=1e-5)
        self.encoders = nn.ModuleList(
            ConformerLayer(cfg.output_size, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )

    @property
    def output_size(self) -> int:
        return self.cfg.output_size

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``xs (B, T, D_in)`` with lengths ``xs_lens (B,)``.

        Returns:
            ``(B, T, D)`` after the final LayerNorm and the bool valid mask ``(B, 1, T)``. Attention is full over
            the real frames, or chunk-causal with ``cfg.chunk_size`` (1 = plain causal).
        """
        size = xs.size(1)
        valid = valid_mask(xs_lens, size)
        xs = self.embed(xs)
        mask = attention_mask(valid, self.cfg.chunk_size)
        pos_emb = relative_position_encoding(size, self.cfg.output_size, xs.device, xs.dtype)
        for layer in self.encoders:
            xs = layer(xs, mask, pos_emb)
        return self.after_norm(xs), valid.unsqueeze(1)


def sinusoid_rows(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """ESPnet sinusoids for relative positions ``positions (N,)`` -> ``(N, d_model)`` (sin even, cos odd)."""
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    pos = positions.to(torch.float32).unsqueeze(1)
    pe = torch.zeros(positions.numel(), d_model)
    pe[:, 0::2] = torch.sin(pos * div_term)
    pe[:, 1::2] = torch.cos(pos * div_term)
    return pe


class LegacyLinearEmbed(nn.Module):
    """``input_layer: linear_legacy``: Linear, LayerNorm, (dropout), ReLU, then ``x * sqrt(D)``."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.out = nn.Sequential(
            nn.Linear(input_size, output_size), nn.LayerNorm(output_size, eps=1e-5), nn.Identity(), nn.ReLU()
        )
        self.xscale = math.sqrt(output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D_in) -> (B, T, D)."""
        return self.out(x) * self.xscale


class ReluFeedForward(nn.Module):
    """``w_2(ReLU(w_1(x)))``."""

    def __init__(self, size: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.relu(self.w_1(x)))


class KVCache:
    """Keys/values ``(layers, 1, H, max_len, d_k)`` and the projected relative-position rows per layer.

    ``W_pos · pe(r)`` depends only on the relative position r, so row r (r >= 0; the LM is causal) is computed
    once and kept: one row per layer per decoded position, like K and V themselves.
    """

    def __init__(self, layers: int, heads: int, d_k: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (layers, 1, heads, max_len, d_k)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.pos = torch.zeros(layers, max_len, heads * d_k, dtype=dtype)
        self.pos_rows = [0] * layers
        self.max_len = max_len


class CachedRelPositionAttention(RelPositionAttention):
    """Causal rel-pos attention over a KV cache (same parameters as :class:`RelPositionAttention`)."""

    def forward_cached(self, x: torch.Tensor, start: int, cache: KVCache, layer: int) -> torch.Tensor:
        """Queries at positions ``start .. start+n-1`` see keys ``0 .. start+n-1``; x (1, n, D) -> (1, n, D)."""
        n, end = x.size(1), start + x.size(1)
        if end > cache.max_len:
            raise ConfigError(f"KV cache holds {cache.max_len} positions, position {end - 1} requested")
        q = self._heads(self.linear_q(x))  # (1, n, H, d_k)
        cache.k[layer, :, :, start:end] = self._heads(self.linear_k(x)).transpose(1, 2)
        cache.v[layer, :, :, start:end] = self._heads(self.linear_v(x)).transpose(1, 2)
        k, v = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]
        have = cache.pos_rows[layer]
        if have < end:  # W_pos * pe(r) for the relative positions r = have .. end-1 not yet projected
            rows = sinusoid_rows(torch.arange(have, end), self.h * self.d_k).to(x.dtype)
            cache.pos[layer, have:end] = self.linear_pos(rows)
            cache.pos_rows[layer] = end
        p = cache.pos[layer, :end].view(end, self.h, self.d_k).transpose(0, 1)  # (H, end, d_k): row r = rel pos r
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))  # (1, H, n, end)
        by_rel = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # (1, H, n, end)
        rel = torch.arange(start, end).unsqueeze(1) - torch.arange(end).unsqueeze(0)  # (n, end): i - j
        position = torch.gather(by_rel, -1, rel.clamp(min=0).expand(1, self.h, n, end))
        scores = (content + position) / math.sqrt(self.d_k)
        hidden = rel < 0  # future keys
        attn = torch.softmax(scores.masked_fill(hidden, -float("inf")), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(1, n, self.h * self.d_k)
        return self.linear_out(out)


class TransformerLayer(nn.Module):
    """Pre-LN layer ``x + attn(norm1(x))``, then ``x + FFN(norm2(x))`` (LayerNorm eps 1e-12)."""

    def __init__(self, size: int, n_head: int, linear_units: int) -> None:
        super().__init__()
        self.self_attn = CachedRelPositionAttention(n_head, size)
        self.feed_forward = ReluFeedForward(size, linear_units)
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: torch.Tensor, start: int, cache: KVCache, layer: int) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.norm1(x), start, cache, layer)
        return x + self.feed_forward(self.norm2(x))


class TransformerStack(nn.Module):
    """The v1 LM's decoder (official ``TransformerEncoder`` driven through ``forward_chunk``), with a KV cache."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        cfg.validate("llm")
        self.cfg = cfg
        self.embed = LegacyLinearEmbed(cfg.input_size, cfg.output_size)
        self.after_norm = nn.LayerNorm(cfg.output_size, eps=1e-5)
        self.encoders = nn.ModuleList(
            TransformerLayer(cfg.output_size, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )
        self.cache: KVCache | None = None

    def setup_cache(self, max_len: int, dtype: torch.dtype = torch.float32) -> KVCache:
        """Allocate an empty cache for ``max_len`` positions (replacing any previous one)."""
        heads = self.cfg.attention_heads
        self.cache = KVCache(self.cfg.num_blocks, heads, self.cfg.output_size // heads, max_len, dtype)
        return self.cache

    def forward(self, xs: torch.Tensor, start: int) -> torch.Tensor:
        """Run positions ``start .. start+n-1`` (``xs (1, n, D_in)``) causally on top of the cache -> (1, n, D).

        The cache must hold positions ``0 .. start-1`` (see :meth:`setup_cache`); it is extended in place.
        """
        if self.cache is None:
            raise ConfigError("call setup_cache(max_len) before running the LM decoder")
        if xs.dim() != 3 or xs.size(0) != 1:
            raise ConfigError(f"the LM decoder takes (1, n, D) inputs, got {tuple(xs.shape)}")
        h = self.embed(xs)
        for i, layer in enumerate(self.encoders):
            h = layer(h, start, self.cache, i)
        return self.after_norm(h)
