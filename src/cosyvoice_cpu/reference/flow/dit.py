"""Flow-matching estimator of Fun-CosyVoice3: the official ``DiT`` (``cosyvoice/flow/DiT``), inference only.

A diffusion transformer predicting the velocity field ``v(x_t, t | mu, spks, cond)`` under the official
estimator contract (the one ``export_onnx.py`` exports)::

    t (B,) --sinusoid(256, scale 1000)--> Linear, SiLU, Linear --> t_emb (B, D)
    cat[x, cond, mu, spks (broadcast over time)] (B, T, 80+80+80+80) --Linear--> (B, T, D)
        + causal conv position embedding (2 x [left pad 30, grouped Conv1d k=31, Mish])
    depth x DiTBlock: AdaLayerNormZero(t_emb) -> self-attention (RoPE, bool mask) -> gated residual
                      -> LayerNorm modulated by t_emb -> FFN (GELU-tanh) -> gated residual
    AdaLayerNormZero_Final(t_emb) --> Linear(D, 80) --> (B, 80, T)

Facts of the official code reproduced here (x_transformers 2.11.24 ``RotaryEmbedding`` / ``apply_rotary_pos_emb``):

* RoPE is *interleaved* (pairs ``(2i, 2i+1)`` rotate together) and is applied to the projected query/key
  ``(B, T, heads * dim_head)`` *before* the head split, with a ``dim_head``-wide table: only the first
  ``dim_head`` channels, i.e. head 0, are rotated; the other heads see no position at all (F5-TTS heritage).
* The mask is boolean: ``streaming=False`` lets every query see every real key; ``streaming=True`` uses the
  chunk-causal mask (key j visible from query i iff ``j < (i // static_chunk_size + 1) * static_chunk_size``;
  ``num_decoding_left_chunks`` is read but ignored, all left context stays visible). The attention output is
  zeroed on padded frames (the mask's last query row); the conv position embedding is not masked.

``state_dict`` keys equal the official ``decoder.estimator.*`` ones, including the persistent buffer
``rotary_embed.inv_freq``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.flow.causal_unet import timestep_embedding
from cosyvoice_cpu.reference.flow.encoder import attention_mask

logger = logging.getLogger(__name__)

TIME_FREQ_DIM = 256  # official TimestepEmbedding(freq_embed_dim=256)
POS_CONV_KERNEL = 31  # official CausalConvPositionEmbedding(kernel_size=31, groups=16)
POS_CONV_GROUPS = 16
ROPE_BASE = 10000.0


@dataclass
class DiTConfig:
    """Constructor arguments of the official ``DiT``; defaults are the Fun-CosyVoice3-0.5B release."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: float = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80  # 0: no speaker input (official spk_dim=None)
    out_channels: int = 80
    long_skip_connection: bool = False
    static_chunk_size: int = 50  # frames (chunk_size 25 tokens * token_mel_ratio 2)
    num_decoding_left_chunks: int = -1  # read, but the official mask ignores it

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first inconsistent field."""
        for name in ("dim", "depth", "heads", "dim_head", "mel_dim", "mu_dim", "static_chunk_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"flow estimator (DiT) {name} must be > 0, got {getattr(self, name)}")
        if self.spk_dim < 0 or self.ff_mult <= 0:
            raise ConfigError("flow estimator (DiT) spk_dim must be >= 0 and ff_mult > 0")
        if self.dim_head % 2:
            raise ConfigError(f"flow estimator (DiT) dim_head must be even (RoPE pairs), got {self.dim_head}")
        if self.dim % POS_CONV_GROUPS:
            raise ConfigError(f"flow estimator (DiT) dim must be divisible by {POS_CONV_GROUPS} (conv groups)")

    @classmethod
    def from_yaml(cls, node: Any) -> DiTConfig:
        """Read ``flow.decoder.estimator`` (``!new:cosyvoice.flow.DiT.dit.DiT``); absent keys take the official
        constructor's defaults (depth 8, heads 8, ff_mult 4, no speaker input, ...)."""
        if getattr(node, "class_name", None) != "DiT":
            name = getattr(node, "class_name", type(node).__name__)
            raise ConfigError(f"flow config: flow.decoder.estimator is {name}, expected DiT")
        a = dict(node.args) if isinstance(node.args, dict) else {}
        if "dim" not in a:
            raise ConfigError("flow config: flow.decoder.estimator (DiT) needs 'dim' (it has no default upstream)")
        mel_dim = int(a.get("mel_dim", 80))
        cfg = cls(
            dim=int(a["dim"]),
            depth=int(a.get("depth", 8)),
            heads=int(a.get("heads", 8)),
            dim_head=int(a.get("dim_head", 64)),
            ff_mult=float(a.get("ff_mult", 4)),
            mel_dim=mel_dim,
            mu_dim=int(a.get("mu_dim") or mel_dim),
            spk_dim=int(a.get("spk_dim") or 0),
            out_channels=int(a.get("out_channels") or mel_dim),
            long_skip_connection=bool(a.get("long_skip_connection", False)),
            static_chunk_size=int(a.get("static_chunk_size", 50)),
            num_decoding_left_chunks=int(a.get("num_decoding_left_chunks", 2)),
        )
        cfg.validate()
        return cfg


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotate-half: ``(..., 2d)`` pairs ``(a, b)`` -> ``(-b, a)``."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-b, a), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """Interleaved RoPE table (x_transformers layout); ``inv_freq`` is a persistent buffer as upstream."""

    def __init__(self, dim: int, base: float = ROPE_BASE) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq_len: int) -> torch.Tensor:
        """-> angles ``(1, seq_len, dim)``: ``pos * inv_freq`` with every frequency repeated twice."""
        pos = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = pos[:, None] * self.inv_freq[None, :]
        return freqs.repeat_interleave(2, dim=-1).unsqueeze(0)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``freqs.size(-1)`` channels of ``x (B, T, C)``; the rest pass through (upstream)."""
    n = freqs.size(-1)
    head, tail = x[..., :n], x[..., n:]
    return torch.cat((head * freqs.cos() + rotate_pairs(head) * freqs.sin(), tail), dim=-1)


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convs (kernel 31, left zero pad 30, Mish); keys ``conv1.0``, ``conv2.0``."""

    def __init__(self, dim: int, kernel_size: int = POS_CONV_KERNEL, groups: int = POS_CONV_GROUPS) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, D)`` -> ``(B, T, D)``."""
        h = self.conv1(F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel_size - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    """``proj(cat[x, cond, mu, spks])`` plus its causal conv position embedding."""

    def __init__(self, in_dim: int, dim: int, spk_dim: int) -> None:
        super().__init__()
        self.spk_dim = spk_dim
        self.proj = nn.Linear(in_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """x, cond, mu ``(B, T, 80)``, spks ``(B, S)`` -> ``(B, T, D)``."""
        parts = [x, cond, mu]
        if self.spk_dim > 0:
            parts.append(spks.unsqueeze(1).expand(-1, x.size(1), -1))
        h = self.proj(torch.cat(parts, dim=-1))
        return self.conv_pos_embed(h) + h


class Attention(nn.Module):
    """Biased q/k/v/out projections, RoPE on the flattened q/k, SDPA with a bool mask, padded rows zeroed."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, visible: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """x ``(B, T, D)``, visible bool ``(B, 1, T, T)``, freqs ``(1, T, dim_head)`` -> ``(B, T, D)``."""
        b, size, _ = x.shape
        q, k = apply_rope(self.to_q(x), freqs), apply_rope(self.to_k(x), freqs)
        v = self.to_v(x)
        q, k, v = (h.view(b, size, self.heads, -1).transpose(1, 2) for h in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        out = self.to_out[0](out.transpose(1, 2).reshape(b, size, -1))
        return out.masked_fill(~visible[:, 0, -1].unsqueeze(-1), 0.0)


class AdaLayerNorm(nn.Module):
    """``Linear(SiLU(t_emb))`` -> ``n_chunks`` modulation vectors; LayerNorm without affine, eps 1e-6."""

    def __init__(self, dim: int, n_chunks: int) -> None:
        super().__init__()
        self.n_chunks = n_chunks
        self.linear = nn.Linear(dim, dim * n_chunks)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def modulation(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(B, D)`` -> ``n_chunks`` tensors ``(B, D)``."""
        return self.linear(F.silu(t_emb)).chunk(self.n_chunks, dim=1)


class DiTBlock(nn.Module):
    """AdaLN-zero transformer block (keys ``attn_norm.linear``, ``attn.*``, ``ff.ff.0.0``, ``ff.ff.2``)."""

    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: float) -> None:
        super().__init__()
        inner = int(dim * ff_mult)
        self.attn_norm = AdaLayerNorm(dim, 6)
        self.attn = Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = nn.Module()
        self.ff.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(), nn.Linear(inner, dim)
        )

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, visible: torch.Tensor, freqs: torch.Tensor):
        """x ``(B, T, D)``, t_emb ``(B, D)`` -> ``(B, T, D)``."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm.modulation(t_emb)
        h = self.attn_norm.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        x = x + gate_msa.unsqueeze(1) * self.attn(h, visible, freqs)
        h = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff.ff(h)


class DiT(nn.Module):
    """The v3 flow estimator; ``forward(x, mask, mu, t, spks, cond, streaming)`` -> ``(B, 80, T)``."""

    def __init__(self, cfg: DiTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or DiTConfig()
        cfg.validate()
        self.static_chunk_size = cfg.static_chunk_size
        self.time_embed = nn.Module()
        self.time_embed.time_mlp = nn.Sequential(
            nn.Linear(TIME_FREQ_DIM, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim)
        )
        in_dim = 2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim
        self.input_embed = InputEmbedding(in_dim, cfg.dim, cfg.spk_dim)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(
            DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult) for _ in range(cfg.depth)
        )
        self.long_skip_connection = nn.Linear(2 * cfg.dim, cfg.dim, bias=False) if cfg.long_skip_connection else None
        self.norm_out = AdaLayerNorm(cfg.dim, 2)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def visibility(self, mask: torch.Tensor, streaming: bool, chunk_id: torch.Tensor | None = None) -> torch.Tensor:
        """``mask (B, 1, T)`` 0/1 -> bool ``(B, 1, T, T)``: query i may attend key j.

        ``chunk_id`` (B, T) int (streaming only): key j visible from i iff ``chunk_id[j] <= chunk_id[i]``
        (the default is the official ``i // static_chunk_size``); rows with no visible key are opened, as upstream.
        """
        valid = mask[:, 0].bool()
        size = valid.size(1)
        if streaming and chunk_id is not None:
            visible = valid.unsqueeze(1) & (chunk_id.unsqueeze(1) <= chunk_id.unsqueeze(2))
            empty = visible.sum(dim=-1) == 0
            visible = torch.where(empty.unsqueeze(-1), torch.ones_like(visible), visible)
        else:
            visible = attention_mask(valid, self.static_chunk_size if streaming else 0)
        return visible.expand(-1, size, -1).unsqueeze(1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor | None = None,
        cond: torch.Tensor | None = None,
        streaming: bool = False,
        chunk_id: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity at time t.

        Args:
            x: (B, 80, T) noisy mel; mask: (B, 1, T) float 0/1; mu: (B, 80, T) token condition;
            t: (B,) or () flow time in [0, 1]; spks: (B, 80) speaker; cond: (B, 80, T) prompt mel then zeros.
            streaming: chunk-causal attention of ``static_chunk_size`` frames (else full attention).
            chunk_id: (B, T) int chunk index per frame (streaming only; see :meth:`visibility`).
        Returns:
            (B, 80, T).
        """
        if x.dim() != 3 or mu.shape != x.shape or mask.shape != (x.size(0), 1, x.size(2)):
            raise ValueError(
                f"DiT expects x and mu (B, {self.cfg.mel_dim}, T) and mask (B, 1, T), got "
                f"{tuple(x.shape)}, {tuple(mu.shape)}, {tuple(mask.shape)}"
            )
        b, _, size = x.shape
        if t.ndim == 0:
            t = t.repeat(b)
        if cond is None:
            cond = torch.zeros_like(x)
        if spks is None:
            spks = x.new_zeros(b, self.cfg.spk_dim)
        t_emb = self.time_embed.time_mlp(timestep_embedding(t, TIME_FREQ_DIM))
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        residual = h
        freqs = self.rotary_embed(size)
        visible = self.visibility(mask, streaming, chunk_id)
        for block in self.transformer_blocks:
            h = block(h, t_emb, visible, freqs)
        if self.long_skip_connection is not None:
            h = self.long_skip_connection(torch.cat((h, residual), dim=-1))
        scale, shift = self.norm_out.modulation(t_emb)
        h = self.norm_out.norm(h) * (1 + scale)[:, None, :] + shift[:, None, :]
        return self.proj_out(h).transpose(1, 2)
