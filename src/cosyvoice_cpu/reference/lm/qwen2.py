"""Qwen2 decoder backbone (gpt-fast style) with an explicit, preallocated KV cache.

This is the transformer inside CosyVoice2/3's LM. It runs on ``inputs_embeds`` only: the text embedding lookup
and the speech embedding/head live in :mod:`cosyvoice_cpu.reference.lm.cosyvoice2`. Parameter names follow
Hugging Face's ``Qwen2Model`` (``embed_tokens``, ``layers.N.self_attn.q_proj`` ...), so the released ``llm.pt``
loads strictly.

Shapes: B batch, T new positions, D hidden (896), H query heads (14), Hkv key/value heads (2), Dh head dim (64),
L cache capacity.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cosyvoice_cpu.errors import ConfigError, ModelDirError

logger = logging.getLogger(__name__)


@dataclass
class Qwen2Config:
    """The subset of a Hugging Face ``Qwen2Config`` (``CosyVoice-BlankEN/config.json``) the LM needs."""

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"qwen2 {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"qwen2 hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"qwen2 num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen2Config:
        """Read ``config.json`` of a Qwen2 checkpoint directory, as written by transformers 4 or 5.

        Unknown keys are ignored, except those that change the numerics: ``rope_theta`` is read from the top
        level or ``rope_parameters`` (:func:`_rope_theta`), RoPE scaling and a ``head_dim`` other than
        ``hidden_size // num_attention_heads`` are refused.
        """
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ModelDirError(f"{path} not found: CosyVoice-BlankEN/ must hold the Qwen2 config.json") from e
        except json.JSONDecodeError as e:
            raise ModelDirError(f"{path} is not valid JSON ({e}); re-download CosyVoice-BlankEN/") from e
        if not isinstance(raw, dict):
            raise ModelDirError(f"{path} holds a JSON {type(raw).__name__}, not an object; re-download it")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw and k != "rope_theta"}
        cfg = cls(**known, rope_theta=_rope_theta(raw, path))
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim != cfg.head_dim:
            raise ModelDirError(
                f"{path}: head_dim {head_dim} differs from hidden_size / num_attention_heads = {cfg.head_dim}; "
                "the reference implements head_dim = hidden_size // num_attention_heads only"
            )
        cfg.validate()
        return cfg

    def to_json_dict(self) -> dict:
        """The ``config.json`` Hugging Face's ``Qwen2ForCausalLM`` loads (used by the fixture writer)."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "max_window_layers": self.num_hidden_layers,
            "sliding_window": self.max_position_embeddings,
            "use_sliding_window": False,
            "use_cache": True,
            "torch_dtype": "float32",
            **{k: getattr(self, k) for k in self.__dataclass_fields__},
        }


ROPE_TYPES = (None, "default")  # plain RoPE; no linear/dynamic/yarn/llama3/... scaling


def _rope_theta(raw: dict, path: Path) -> float:
    """The RoPE base of a ``config.json`` from transformers 4 or 5, refusing scaling the reference lacks.

    transformers 4 writes ``rope_theta`` (and ``rope_scaling``, null for plain RoPE) at the top level;
    transformers 5 keeps both in ``rope_parameters`` (``{"rope_theta": ..., "rope_type": "default"}``). A
    missing value is refused rather than defaulted: transformers' own default (10000) is not CosyVoice-BlankEN's
    1e6, and a wrong base passes every export gate because the reference would read the same wrong value.
    """
    where: dict[str, float] = {}
    if raw.get("rope_theta") is not None:
        where["rope_theta"] = raw["rope_theta"]
    for field_name in ("rope_scaling", "rope_parameters"):
        params = raw.get(field_name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ModelDirError(f"{path}: {field_name} must be an object or null, got {params!r}")
        type_key = "rope_type" if "rope_type" in params else "type"  # "type": the older transformers 4 spelling
        rope_type = params.get(type_key)
        if rope_type not in ROPE_TYPES:
            raise ModelDirError(
                f"{path}: {field_name}.{type_key} is {rope_type!r}; the reference and the exported LM implement "
                "plain RoPE only (rope_type 'default' or none): this is not a CosyVoice-BlankEN config"
            )
        if params.get("rope_theta") is not None:
            where[f"{field_name}.rope_theta"] = params["rope_theta"]
    if not where:
        raise ModelDirError(
            f"{path} sets no rope_theta (neither top-level 'rope_theta' nor 'rope_parameters.rope_theta'); "
            "CosyVoice-BlankEN uses 1000000.0: re-download the config.json or add the field"
        )
    try:
        values = {k: float(v) for k, v in where.items()}
    except (TypeError, ValueError) as e:
        raise ModelDirError(f"{path}: rope_theta must be a number, got {where}") from e
    if len(set(values.values())) > 1:
        raise ModelDirError(f"{path} sets conflicting RoPE bases {values}; keep one of them")
    theta = next(iter(values.values()))
    if not theta > 0:
        raise ModelDirError(f"{path}: rope_theta must be positive, got {theta}")
    return theta


class KVCache(nn.Module):
    """A preallocated key/value cache for one layer: (B, Hkv, L, Dh) each, written at given positions."""

    def __init__(self, batch: int, n_kv: int, capacity: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(batch, n_kv, capacity, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(batch, n_kv, capacity, head_dim, dtype=dtype), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, Hkv, T, Dh) at positions ``pos`` (T,); return the cache prefix up to max(pos)+1."""
        if int(pos[-1]) >= self.k.shape[2]:
            raise ConfigError(
                f"KV cache capacity {self.k.shape[2]} exceeded at position {int(pos[-1])}; "
                "create the cache with a larger max_len"
            )
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        end = int(pos[-1]) + 1
        return self.k[:, :, :end], self.v[:, :, :end]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Qwen2 does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(cfg: Qwen2Config, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions ``pos`` (T,): cos, sin of shape (T, Dh) (halves duplicated)."""
    dh = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention with q/k/v biases and RoPE."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        d, dh = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, dh
        self.q_proj = nn.Linear(d, self.n_heads * dh, bias=True)
        self.k_proj = nn.Linear(d, self.n_kv * dh, bias=True)
        self.v_proj = nn.Linear(d, self.n_kv * dh, bias=True)
        self.o_proj = nn.Linear(self.n_heads * dh, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """x (B, T, D) at positions ``pos`` (T,) -> (B, T, D). Without a cache, attends causally within x."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(pos, k, v)
        key_pos = torch.arange(k.shape[2]) if cache is not None else pos
        mask = key_pos[None, :] <= pos[:, None]  # (T, S): causal over absolute positions
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SiLU-gated feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Token embedding table + decoder layers + final norm (HF ``Qwen2Model`` parameter names).

    ``embed_tokens`` is only used as a lookup table by the LM wrapper; :meth:`forward` takes embeddings.
    The KV cache lives on the module (gpt-fast style): one decode at a time per instance. A reference, not a
    server; the runtime keeps per-request caches in the request.
    """

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.caches: nn.ModuleList | None = None

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Allocate a fresh KV cache of ``max_len`` positions (drops any previous one)."""
        c = self.cfg
        dtype = self.embed_tokens.weight.dtype
        self.caches = nn.ModuleList(
            KVCache(batch, c.num_key_value_heads, max_len, c.head_dim, dtype) for _ in range(c.num_hidden_layers)
        )

    def forward(self, x: torch.Tensor, pos: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        """Run the decoder on embeddings.

        Args:
            x: (B, T, D) input embeddings for positions ``pos``.
            pos: (T,) int64 absolute positions, increasing; with a cache, earlier positions must be cached.
            use_cache: read/write the KV cache set up by :meth:`setup_cache`; False = causal over x only.
        Returns:
            (B, T, D) last hidden states after the final norm.
        """
        if use_cache and self.caches is None:
            raise ConfigError("call setup_cache(batch, max_len) before a cached forward")
        cos, sin = rope_cos_sin(self.cfg, pos)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pos, self.caches[i] if use_cache else None)
        return self.norm(x)
