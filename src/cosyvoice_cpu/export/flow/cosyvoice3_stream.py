"""The Fun-CosyVoice3 DiT as ONNX graphs: the official estimator and a streamed window on a key/value cache.

Both graphs are built from :class:`~cosyvoice_cpu.reference.flow.dit.DiT` modules by :class:`DiTRun`, which applies
the DiT with fused attention (a key mask in the whole graph, a chunk-causal bias in the window), absolute RoPE
positions and causal-conv states::

    t (B,) -> t_emb (B, D) -> time table (B, L x 6D + 2D)  (in the stream graph: its ``modulation`` input)
    cat[x, cond, mu, spks] (B, T, 320) -Linear-> h (B, T, D)
    conv position embedding: [state1 | h] -conv1, Mish-> c1;  [state2 | c1] -conv2, Mish-> c2;  h = h + c2
    L x AdaLN-zero block (its 6D of the table): q, k = RoPE(to_q/to_k(n), positions offset .. offset+T-1),
                           v = to_v(n); keys = [past keys | k] (all past visible), chunk-causal bias in the window
    AdaLN final (the table's last 2D) -> Linear(D, 80) -> (B, 80, T)

``flow_time.onnx`` (format 5): everything in the DiT that depends on the flow time alone::

    t (N,) -> modulation (N, L * 6D + 2D)   per block Linear(SiLU(t_emb)) (shift, scale, gate of attention and
                                            feed-forward), then the final AdaLN's (scale, shift)

``flow_estimator_stream.onnx`` (v3 contract, format 5; batch = CFG rows and/or streams, all frames valid)::

    x, mu, cond (B, 80, T)  spks (B, 80)               the window's frames (absolute positions offset ..)
    modulation (1 or B, L * 6D + 2D)                   ``flow_time.onnx`` at the step's t (one row: every row's)
    prompt_k, prompt_v (L, B, P, I)                     cached keys (after RoPE) / values of the prompt frames
    context_k, context_v (L, B, C, I)                   ... of the committed generated frames (P, C may be 0)
    conv_state (B, 2D, 30)                              the conv position embedding's inputs (h | c1) on the 30
                                                        frames before ``offset`` (zeros before frame 0)
    offset () int64                                     absolute position of the window's first frame
    keep_frames () int64                                how many of the window's first frames the cache
                                                        outputs return
    chunk_frames () int64                               the attention chunk (50); 0 = full attention
    -> velocity (B, 80, T), new_k, new_v (L, B, K, I), conv_in (B, 2D, K) with K = min(keep_frames, T)
       (keys after RoPE, values, and h | c1 of the window's first K frames)

The official streaming mask is chunk-causal over absolute frames (key j visible from query i iff
``j < (i // 50 + 1) * 50``) and every other part of the DiT is causal, so once a 50-frame chunk is complete its
keys, values and conv inputs never change within an Euler step. The runtime
(:mod:`cosyvoice_cpu.flow.cosyvoice3_stream`)
caches them per step and CFG row and recomputes only the open chunk plus the new frames: with the whole past
cached this equals the official prefix recompute exactly (gated below). Past keys are all visible; inside the
window the chunk-causal bias applies. Each attention is ``If(bias all zero)`` (:func:`~cosyvoice_cpu.export.
fused_ops.unbiased_when_zero`): a window inside one chunk, or ``chunk_frames`` 0, takes ORT's flash kernel.

With empty caches, ``offset`` 0, ``chunk_frames`` 0 and ``keep_frames`` 0 a call *is* the official whole-sentence
estimator (``streaming=False``) on unpadded rows, returning no per-layer keys/values: a process that synthesizes
whole sentences and streams holds one copy of the DiT's weights
(:class:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow`).

The time graph (:func:`cosyvoice_cpu.export.flow.cosyvoice3.export_time_graph`) is split off because its weights
are 42 % of the DiT's (22 x 1024 x 6144 of 327 M at full size) yet an Euler schedule asks it for a handful of ``t``
values: the runtime computes a schedule's table once, keeps it (0.55 MB per step) and never holds those weights
while it synthesizes.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.export import fused_ops
from cosyvoice_cpu.export.common import GateResult, rel_err, torch_export
from cosyvoice_cpu.flow.graphs import cache_dtype
from cosyvoice_cpu.reference.flow.causal_unet import MASK_BIAS, timestep_embedding
from cosyvoice_cpu.reference.flow.dit import TIME_FREQ_DIM, DiT, DiTBlock, apply_rope

logger = logging.getLogger(__name__)

INPUTS = [
    "x",
    "mu",
    "modulation",
    "spks",
    "cond",
    "prompt_k",
    "prompt_v",
    "context_k",
    "context_v",
    "conv_state",
    "offset",
    "keep_frames",
    "chunk_frames",
]
OUTPUTS = ["velocity", "new_k", "new_v", "conv_in"]


def stream_layout(est: DiT) -> tuple[int, int, int, int]:
    """(blocks L, key/value width I = heads * dim_head, conv-state channels 2D, conv-state frames K - 1)."""
    cfg = est.cfg
    return cfg.depth, cfg.heads * cfg.dim_head, 2 * cfg.dim, est.input_embed.conv_pos_embed.kernel_size - 1


class DiTRun:
    """The DiT's forward pass in traceable pieces (shared by both graphs)."""

    def __init__(self, est: DiT) -> None:
        self.est = est
        self.heads = est.cfg.heads
        self.scale = est.cfg.dim_head**-0.5

    def embed(
        self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 80, T) inputs -> h (B, T, D) and the two convs' inputs (B, 2D, T); ``state`` (B, 2D, K-1) or None
        (zeros: the official left padding)."""
        inp = self.est.input_embed
        parts = [x, cond, mu]
        if inp.spk_dim > 0:
            parts.append(spks.unsqueeze(-1).expand(-1, -1, x.size(2)))
        h = inp.proj(torch.cat(parts, dim=1).transpose(1, 2))  # (B, T, D)
        pos = inp.conv_pos_embed
        d, pad = h.size(2), pos.kernel_size - 1
        h_ct = h.transpose(1, 2)
        s1 = F.pad(h_ct, (pad, 0)) if state is None else torch.cat([state[:, :d], h_ct], dim=2)
        c1 = pos.conv1(s1)
        s2 = F.pad(c1, (pad, 0)) if state is None else torch.cat([state[:, d:], c1], dim=2)
        c2 = pos.conv2(s2)
        return h + c2.transpose(1, 2), torch.cat([h_ct, c1], dim=1)

    def freqs(self, offset: torch.Tensor, size: Any) -> torch.Tensor:
        """RoPE angles (1, T, dim_head) at absolute positions offset .. offset + T - 1."""
        inv = self.est.rotary_embed.inv_freq
        pos = (torch.arange(size) + offset).to(inv.dtype)
        f = pos[:, None] * inv[None, :]
        return torch.stack([f, f], dim=-1).flatten(1).unsqueeze(0)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (B, T, I), k/v (B, S, I), key_mask (B, S) 0/1 or bias (T, S) additive -> (B, T, I), as one
        ``com.microsoft.MultiHeadAttention`` in the graphs (:func:`~cosyvoice_cpu.export.fused_ops.attention`)."""
        bias = None if bias is None else bias[None, None]
        return fused_ops.attention(q, k, v, self.heads, self.scale, key_mask=key_mask, bias=bias)

    def block(self, block: DiTBlock, x: torch.Tensor, mods: torch.Tensor, attention: Any) -> torch.Tensor:
        """One AdaLN-zero block on its slice of the time table, ``mods`` (B, 6D) (:meth:`block_mods`);
        ``attention(n) -> (B, T, D)`` is the attention on the modulated input."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=1)
        n = block.attn_norm.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        x = x + gate_msa.unsqueeze(1) * attention(n)
        n = block.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * block.ff.ff(n)

    def time_table(self, t: torch.Tensor) -> torch.Tensor:
        """t (N,) -> (N, L * 6D + 2D): every block's ``attn_norm.modulation`` and the final ``norm_out``'s, as
        one row per t (what ``flow_time.onnx`` returns and the stream graph takes as ``modulation``)."""
        est = self.est
        # (N, 1, D): a Linear on 3-D input is traced as MatMul (Gemm on 2-D), which the recipe's quantizer takes
        t_emb = F.silu(est.time_embed.time_mlp(timestep_embedding(t, TIME_FREQ_DIM)))[:, None]
        parts = [b.attn_norm.linear(t_emb) for b in est.transformer_blocks]
        return torch.cat([*parts, est.norm_out.linear(t_emb)], dim=2)[:, 0]

    def block_mods(self, table: torch.Tensor, i: int) -> torch.Tensor:
        """Block ``i``'s (B, 6D) slice of a time table (B, L * 6D + 2D)."""
        width = 6 * self.est.cfg.dim
        return table[:, i * width : (i + 1) * width]

    def head(self, h: torch.Tensor, residual: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Long skip (if any), final AdaLN (scale then shift, the table's last 2D columns), projection ->
        (B, 80, T)."""
        est = self.est
        if est.long_skip_connection is not None:
            h = est.long_skip_connection(torch.cat((h, residual), dim=-1))
        scale, shift = table[:, len(est.transformer_blocks) * 6 * est.cfg.dim :].chunk(2, dim=1)
        h = est.norm_out.norm(h) * (1 + scale)[:, None, :] + shift[:, None, :]
        return est.proj_out(h).transpose(1, 2)


class StreamEstimatorGraphV3(nn.Module):
    """``flow_estimator_stream.onnx`` for the DiT (contract in the module doc)."""

    def __init__(self, est: DiT) -> None:
        super().__init__()
        self.est = est
        self.run = DiTRun(est)

    def forward(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        modulation: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        prompt_k: torch.Tensor,
        prompt_v: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        conv_state: torch.Tensor,
        offset: torch.Tensor,
        keep_frames: torch.Tensor,
        chunk_frames: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        run, size = self.run, x.size(2)
        # the first min(keep_frames, T) frames, traced as a Range (a Python slice would freeze the example's size)
        keep = torch.arange(size - torch.clamp(size - keep_frames, min=0))
        h, conv_in = run.embed(x, cond, mu, spks, conv_state)
        residual = h
        freqs = run.freqs(offset, size)
        pos = torch.arange(size) + offset
        chunk = torch.clamp(chunk_frames, min=1)
        end = (torch.div(pos, chunk, rounding_mode="floor") + 1) * chunk
        visible = (pos.unsqueeze(0) < end.unsqueeze(1)) | (chunk_frames <= 0)
        inside = torch.where(visible, 0.0, MASK_BIAS)  # (T, T) chunk-causal, or all zero (full attention)
        n_past = prompt_k.size(2) + context_k.size(2)
        bias = torch.cat([torch.zeros(size, n_past), inside], dim=1)  # past keys: earlier chunks, all visible
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for i, block in enumerate(self.est.transformer_blocks):

            def attention(n: torch.Tensor, i: int = i, block: DiTBlock = block) -> torch.Tensor:
                a = block.attn
                q, k, v = apply_rope(a.to_q(n), freqs), apply_rope(a.to_k(n), freqs), a.to_v(n)
                new_k.append(k.index_select(1, keep))
                new_v.append(v.index_select(1, keep))
                keys = torch.cat([prompt_k[i], context_k[i], k], dim=1)
                values = torch.cat([prompt_v[i], context_v[i], v], dim=1)
                return a.to_out[0](run.attend(q, keys, values, bias=bias))

            h = run.block(block, h, run.block_mods(modulation, i), attention)
        return run.head(h, residual, modulation), torch.stack(new_k), torch.stack(new_v), conv_in.index_select(2, keep)


def example_inputs(
    est: DiT, rng: np.random.Generator, b: int, size: int, n_prompt: int, n_ctx: int, offset: int
) -> dict[str, np.ndarray]:
    """Random feeds for a window of ``size`` frames at ``offset`` after ``n_prompt`` + ``n_ctx`` cached frames."""
    layers, width, state, frames = stream_layout(est)
    t = torch.from_numpy(rng.uniform(0, 1, b).astype(np.float32))
    feeds: dict[str, Any] = {
        "x": rng.standard_normal((b, 80, size)),
        "mu": rng.standard_normal((b, 80, size)),
        "modulation": DiTRun(est).time_table(t).detach().numpy(),
        "spks": rng.standard_normal((b, 80)),
        "cond": np.zeros((b, 80, size)),
        "prompt_k": rng.standard_normal((layers, b, n_prompt, width)),
        "prompt_v": rng.standard_normal((layers, b, n_prompt, width)),
        "context_k": rng.standard_normal((layers, b, n_ctx, width)),
        "context_v": rng.standard_normal((layers, b, n_ctx, width)),
        "conv_state": rng.standard_normal((b, state, frames)),
    }
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()}
    out["offset"] = np.array(offset, dtype=np.int64)
    out["keep_frames"] = np.array(size, dtype=np.int64)
    out["chunk_frames"] = np.array(est.static_chunk_size, dtype=np.int64)
    return out


DYNAMIC_AXES = {
    "x": {0: "batch", 2: "time"},
    "mu": {0: "batch", 2: "time"},
    "cond": {0: "batch", 2: "time"},
    "modulation": {0: "time_rows"},
    "spks": {0: "batch"},
    "conv_state": {0: "batch"},
    "prompt_k": {1: "batch", 2: "prompt_frames"},
    "prompt_v": {1: "batch", 2: "prompt_frames"},
    "context_k": {1: "batch", 2: "context_frames"},
    "context_v": {1: "batch", 2: "context_frames"},
    "velocity": {0: "batch", 2: "time"},
    "new_k": {1: "batch", 2: "kept"},
    "new_v": {1: "batch", 2: "kept"},
    "conv_in": {0: "batch", 2: "kept"},
}


def export_stream_estimator(est: DiT, path: Any) -> None:
    """Write the v3 ``flow_estimator_stream.onnx`` (+ ``.data``) at ``path``."""
    feeds = example_inputs(est, np.random.default_rng(0), 2, 19, 11, 7, 57)
    feeds["keep_frames"] = np.array(13, np.int64)  # neither 0 nor T: no size is specialized into the graph
    args = tuple(torch.from_numpy(feeds[k]) for k in INPUTS)
    torch_export(
        StreamEstimatorGraphV3(est), args, path, input_names=INPUTS, output_names=OUTPUTS, dynamic_axes=DYNAMIC_AXES
    )
    fused_ops.unbiased_when_zero(path)


@torch.inference_mode()
def verify_stream_estimator(est: DiT, sess: Any, rng: np.random.Generator, tol: float, key: str) -> list[GateResult]:
    """The graph against the reference DiT at batch 2.

    1. Windows as the runtime makes them (chunk C = ``static_chunk_size``): a prompt pass over [0, C) (inside one
       chunk: the flash branch), then [C, 2C + 23) on the prompt cache and [2C, 3C + 11) on the prompt cache +
       the committed chunk [C, 2C) (across a boundary: the chunk-causal bias); each window's velocity vs the
       reference (``streaming=True``, the official chunk mask) over all frames up to the window's end, the
       window's first C frames committed (``keep_frames`` C).
    2. ``keep_frames``: 0 returns no keys/values/conv inputs, 7 the window's first 7, more than T all of it, the
       velocity the same.
    3. A whole sentence (empty caches, ``chunk_frames`` 0, ``keep_frames`` 0) vs the reference with full
       attention (``streaming=False``).
    """
    c = est.static_chunk_size
    windows = [(0, c), (c, 2 * c + 23), (2 * c, 3 * c + 11)]
    total, b = windows[-1][1], 2
    full = {k: rng.standard_normal((b, 80, total)).astype(np.float32) for k in ("x", "mu", "cond")}
    full["cond"][:, :, c + 7 :] = 0.0
    t = rng.uniform(0, 1, b).astype(np.float32)
    table = DiTRun(est).time_table(torch.from_numpy(t)).numpy()  # exact: this gate is the stream graph's alone
    spks = rng.standard_normal((b, 80)).astype(np.float32)
    layers, width, state, frames = stream_layout(est)
    wire = cache_dtype(sess, "prompt_k")  # float16 keys/values in the int8 graph (half_cache_io)
    empty = np.zeros((layers, b, 0, width), wire)
    cache = {"prompt_k": empty, "prompt_v": empty, "context_k": empty, "context_v": empty}
    conv = np.zeros((b, state, frames), np.float32)

    def call(s: int, e: int, keep: int, chunk: int, **caches: np.ndarray) -> list[np.ndarray]:
        feeds = {
            "x": full["x"][:, :, s:e],
            "mu": full["mu"][:, :, s:e],
            "modulation": table,
            "spks": spks,
            "cond": full["cond"][:, :, s:e],
            **caches,
            "offset": np.array(s, np.int64),
            "keep_frames": np.array(keep, np.int64),
            "chunk_frames": np.array(chunk, np.int64),
        }
        return sess.run(None, {k: np.ascontiguousarray(v) for k, v in feeds.items()})

    def reference(e: int, streaming: bool) -> np.ndarray:
        args = (
            full["x"][:, :, :e],
            np.ones((b, 1, e), np.float32),
            full["mu"][:, :, :e],
            t,
            spks,
            full["cond"][:, :, :e],
        )
        return est(*(torch.from_numpy(np.ascontiguousarray(a)) for a in args), streaming=streaming).numpy()

    results = []
    for i, (s, e) in enumerate(windows):
        velocity, new_k, new_v, conv_in = call(s, e, c, c, **cache, conv_state=conv)
        ok = new_k.dtype == new_v.dtype == wire and new_k.shape[2] == new_v.shape[2] == conv_in.shape[2] == c
        err = rel_err(velocity, reference(e, True)[:, :, s:]) if ok else float("inf")
        results.append(GateResult(key, "velocity rel err", err, tol, f"window [{s}, {e}) on {s} cached frames"))
        part = "prompt" if i == 0 else "context"  # commit the window's first complete chunk
        cache[f"{part}_k"] = np.concatenate([cache[f"{part}_k"], new_k], axis=2)
        cache[f"{part}_v"] = np.concatenate([cache[f"{part}_v"], new_v], axis=2)
        conv = np.concatenate([conv, conv_in], axis=2)[:, :, c : c + frames]
    s, e = windows[-1][0] + c, windows[-1][1] + 5
    full = {k: np.concatenate([v, rng.standard_normal((b, 80, 5)).astype(np.float32)], axis=2) for k, v in full.items()}
    everything = call(s, e, e - s + 5, c, **cache, conv_state=conv)
    first = call(s, e, 7, c, **cache, conv_state=conv)
    nothing = call(s, e, 0, c, **cache, conv_state=conv)
    err = max(rel_err(a[..., :7, :] if a.ndim == 4 else a[..., :7], w) for a, w in zip(everything[1:], first[1:]))
    err = max(err, rel_err(first[0], everything[0]), rel_err(nothing[0], everything[0]))
    shapes = [a.shape[-2 if a.ndim == 4 else -1] for run in (everything, nothing) for a in run[1:]]
    results.append(
        GateResult(
            key,
            "keep_frames 7 vs the first 7 of all (0: none)",
            err if shapes == [e - s] * 3 + [0] * 3 else float("inf"),
            tol,
            f"window [{s}, {e})",
        )
    )
    whole = call(0, total, 0, 0, **{k: empty for k in cache}, conv_state=np.zeros_like(conv))
    err = rel_err(whole[0], reference(total, False)[:, :, :total]) if whole[1].shape[2] == 0 else float("inf")
    results.append(
        GateResult(key, "velocity rel err", err, tol, f"whole sentence, {total} frames, chunk_frames=0, keep_frames=0")
    )
    return results
