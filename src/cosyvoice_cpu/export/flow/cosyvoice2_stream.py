"""``flow_estimator_stream.onnx``: the flow estimator for one streamed chunk, on cached activations of the past.

The estimator (:class:`~cosyvoice_cpu.reference.flow.causal_unet.FlowEstimator`) is causal in its convolutions
and, in chunk-causal streaming, in its attention: a new chunk's frames see every earlier frame and each other;
earlier frames never see later ones. So what the past contributes to a new chunk is, per Euler step and CFG row:

- for each of the L transformer blocks, the past frames' ``norm1`` output (keys and values are linear in it;
  caching it instead of K and V takes 256 instead of 2 x 512 floats per frame and block);
- for each of the kernel-3 causal convolutions, the last two frames of its input.

Contract (batch = CFG rows and/or streams, all frames valid; T_p or T_c may be 0)::

    x, mu, cond (B, 80, T)  t (B,)  spks (B, 80)      the new chunk's frames, as the official estimator
    prompt_h (L, B, T_p, 256)                          cached norm1 outputs of the prompt frames
    context_h (L, B, T_c, 256)                         ... of the context frames (the latest generated ones)
    conv_state (B, S, 2)                               the causal convolutions' last two input frames, S = sum
                                                       of their input channels (zeros at the very start)
    keep_frames ()  int64                              how many of the chunk's last frames ``new_h`` returns
    -> velocity (B, 80, T), new_h (L, B, K, 256) with K = min(keep_frames, T), new_conv_state (B, S, 2)

``keep_frames`` (format 3) lets a caller take only what it will cache: all T for the prompt pass, the context
window for a streamed chunk, none for a whole sentence. With empty caches, zero convolution states and
``keep_frames = 0`` a call *is* the whole-sentence estimator on unpadded rows (full attention over the chunk,
causal convolutions from zeros), so the runtime serves both modes with this one graph (one copy of the weights)
and the whole-sentence call keeps no per-layer activations for an output nobody reads (at 650 frames and CFG
batch 2 that output would be 56 x 1.3 MB, ~150 MB of ORT arena held during the call). Gated below against the
reference estimator and in :func:`~cosyvoice_cpu.export.flow.cosyvoice2.verify_flow`.

Attention of a new frame: keys = [prompt | context | new chunk], all visible. With the prompt alone as the
"new chunk" and empty caches this is the prompt's own pass (chunk 0 of the streaming mask), which yields the
per-voice prompt cache. Unbounded context reproduces the one-shot chunk-causal estimator exactly (gated below).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.export import fused_ops
from cosyvoice_cpu.export.common import GateResult, rel_err, torch_export
from cosyvoice_cpu.flow.graphs import cache_dtype
from cosyvoice_cpu.reference.flow.causal_unet import (
    CausalBlock,
    CausalConv1d,
    CausalResnetBlock,
    FlowEstimator,
    TransformerBlock,
    timestep_embedding,
)

logger = logging.getLogger(__name__)

INPUTS = ["x", "mu", "t", "spks", "cond", "prompt_h", "context_h", "conv_state", "keep_frames"]
OUTPUTS = ["velocity", "new_h", "new_conv_state"]


def stream_layout(est: FlowEstimator) -> tuple[int, int, int]:
    """(transformer blocks L, block width, conv-state channels S) of an estimator."""
    blocks = [m for m in est.modules() if isinstance(m, TransformerBlock)]
    convs = [m for m in est.modules() if isinstance(m, CausalConv1d)]
    return len(blocks), blocks[0].norm1.normalized_shape[0], sum(c.in_channels for c in convs)


class StreamEstimatorGraph(nn.Module):
    """One estimator call on a chunk with the past as caches (contract in the module doc)."""

    def __init__(self, estimator: FlowEstimator) -> None:
        super().__init__()
        self.est = estimator

    def forward(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        prompt_h: torch.Tensor,
        context_h: torch.Tensor,
        conv_state: torch.Tensor,
        keep_frames: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        past = torch.cat([prompt_h, context_h], dim=2)  # (L, B, T_past, C)
        return self.estimate(_Run(past, conv_state, kept_frames(x, keep_frames)), x, mu, t, spks, cond)

    def estimate(
        self, run: _Run, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The estimator's modules in forward order on the chunk, the past read and the new caches collected by
        ``run`` -> (velocity, new_h, new_conv_state)."""
        est = self.est
        t_emb = est.time_mlp(timestep_embedding(t, est.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(2)), cond], dim=1)
        down, up = est.down_blocks[0], est.up_blocks[0]
        h = run.stage(down, h, t_emb)
        skip = h
        h = run.conv(down[2], h)
        for mid in est.mid_blocks:
            h = run.stage(mid, h, t_emb)
        h = run.stage(up, torch.cat([h, skip], dim=1), t_emb)
        h = run.conv(up[2], h)
        h = run.causal_block(est.final_block, h)
        velocity = est.final_proj(h)
        return velocity, torch.stack(run.new_h), torch.cat(run.new_conv, dim=1)


def kept_frames(x: torch.Tensor, keep_frames: torch.Tensor) -> torch.Tensor:
    """The indices of the chunk frames whose caches the graph returns: the last ``keep_frames`` of ``x`` (B, 80, T),
    from its shape (traced as ops, so they stay dynamic)."""
    size = torch._shape_as_tensor(x)[2]
    return torch.arange(torch.clamp(size - keep_frames, min=0), size)


class _Run:
    """The estimator's modules applied with caches, in forward order (collects the new caches)."""

    def __init__(self, past: torch.Tensor, conv_state: torch.Tensor, keep: torch.Tensor) -> None:
        self.past, self.conv_state, self.keep = past, conv_state, keep  # keep: (K,) chunk frames to return
        self.block = 0  # next transformer block
        self.channel = 0  # next conv's first channel in conv_state
        self.new_h: list[torch.Tensor] = []
        self.new_conv: list[torch.Tensor] = []

    def conv(self, conv: CausalConv1d, x: torch.Tensor) -> torch.Tensor:
        """Causal conv with the cached last input frames in place of the zero padding."""
        c = conv.in_channels
        state = self.conv_state[:, self.channel : self.channel + c, :]
        self.channel += c
        xx = torch.cat([state, x], dim=2)
        self.new_conv.append(xx[:, :, xx.size(2) - conv.causal_padding :])
        return F.conv1d(xx, conv.weight, conv.bias)

    def causal_block(self, block: CausalBlock, x: torch.Tensor) -> torch.Tensor:
        conv, _, norm, _, act = block.block
        return act(norm(self.conv(conv, x).transpose(1, 2)).transpose(1, 2))

    def resnet(self, block: CausalResnetBlock, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        h = self.causal_block(block.block1, x) + block.mlp(t_emb).unsqueeze(-1)
        return self.causal_block(block.block2, h) + block.res_conv(x)

    def transformer(self, block: TransformerBlock, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C): attention over [cached past | x] (all visible), then the feed-forward."""
        n = block.norm1(x)
        self.new_h.append(n.index_select(1, self.keep))
        keys = torch.cat([self.past[self.block], n], dim=1)
        self.block += 1
        x = x + fused_ops.self_attention(block.attn1, n, keys)
        h = block.norm3(x)
        for layer in block.ff.net:
            h = layer(h)
        return x + h

    def stage(self, blocks: nn.ModuleList, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        x = self.resnet(blocks[0], x, t_emb).transpose(1, 2)
        for block in blocks[1]:
            x = self.transformer(block, x)
        return x.transpose(1, 2)


def example_inputs(
    est: FlowEstimator, rng: np.random.Generator, b: int, size: int, n_prompt: int, n_ctx: int
) -> dict[str, np.ndarray]:
    """Random feeds for a chunk of ``size`` frames after ``n_prompt`` + ``n_ctx`` cached frames."""
    layers, width, state = stream_layout(est)
    feeds = {
        "x": rng.standard_normal((b, 80, size)),
        "mu": rng.standard_normal((b, 80, size)),
        "t": rng.uniform(0, 1, b),
        "spks": rng.standard_normal((b, 80)),
        "cond": np.zeros((b, 80, size)),
        "prompt_h": rng.standard_normal((layers, b, n_prompt, width)),
        "context_h": rng.standard_normal((layers, b, n_ctx, width)),
        "conv_state": rng.standard_normal((b, state, 2)),
    }
    return {
        **{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()},
        "keep_frames": np.array(size, np.int64),
    }


@torch.inference_mode()
def verify_stream_estimator(
    est: FlowEstimator, sess: Any, rng: np.random.Generator, tol: float, key: str
) -> list[GateResult]:
    """The graph against the reference estimator (batch 2):

    1. the prompt pass (prompt frames as the chunk, empty caches) vs the reference on the prompt alone;
    2. two chunks, each with the caches the previous passes produced, vs the reference over
       [prompt | chunk 1 | chunk 2] with chunk ids 0, 1, 2, on each chunk's frames;
    3. ``keep_frames``: more than the chunk returns all of it, fewer returns the chunk's last frames;
    4. a whole-sentence call (empty caches, ``keep_frames = 0``) vs the reference with full attention.
    """
    sizes = [37, 23, 41]  # prompt, chunk 1, chunk 2
    total = sum(sizes)
    b = 2
    full = {k: rng.standard_normal((b, 80, total)).astype(np.float32) for k in ("x", "mu", "cond")}
    full["cond"][:, :, sizes[0] :] = 0.0
    t = rng.uniform(0, 1, b).astype(np.float32)
    spks = rng.standard_normal((b, 80)).astype(np.float32)
    ids = np.repeat(np.arange(3), sizes)[None].repeat(b, axis=0)
    args = [
        torch.from_numpy(a) for a in (full["x"], np.ones((b, 1, total), np.float32), full["mu"], t, spks, full["cond"])
    ]
    ref = est(*args, streaming=True, chunk_id=torch.from_numpy(ids)).numpy()
    layers, width, state = stream_layout(est)
    wire = cache_dtype(sess)  # float16 caches in the int8 graph (half_cache_io)
    prompt_h = np.zeros((layers, b, 0, width), wire)
    context_h = np.zeros((layers, b, 0, width), wire)
    conv = np.zeros((b, state, 2), np.float32)
    results = []
    start = 0
    for i, size in enumerate(sizes):
        sl = slice(start, start + size)
        feeds = {
            "x": full["x"][:, :, sl],
            "mu": full["mu"][:, :, sl],
            "t": t,
            "spks": spks,
            "cond": full["cond"][:, :, sl],
            "prompt_h": prompt_h,
            "context_h": context_h,
            "conv_state": conv,
            "keep_frames": np.array(size + 5, np.int64),
        }
        feeds = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
        velocity, new_h, new_conv = sess.run(None, feeds)
        what = "prompt pass, empty caches" if i == 0 else f"chunk {i} on cached prompt + {context_h.shape[2]} frames"
        results.append(GateResult(key, "velocity rel err", rel_err(velocity, ref[:, :, sl]), tol, what))
        if i == len(sizes) - 1:  # the same call keeping only the chunk's last 4 frames
            _, tail, _ = sess.run(None, {**feeds, "keep_frames": np.array(4, np.int64)})
            err = (
                rel_err(tail.astype(np.float32), new_h[:, :, size - 4 :].astype(np.float32))
                if tail.shape[2] == 4 and tail.dtype == wire
                else float("inf")
            )
            results.append(GateResult(key, "keep_frames=4 vs the kept tail", err, tol, f"new_h {tail.shape}"))
        if i == 0:
            prompt_h = new_h
        else:
            context_h = np.concatenate([context_h, new_h], axis=2)
        conv = new_conv
        start += size
    whole = est(*args).numpy()  # full attention: the whole-sentence estimator
    feeds = {k: full[k] for k in ("x", "mu", "cond")}
    velocity, new_h, _ = sess.run(
        None,
        {
            **feeds,
            "t": t,
            "spks": spks,
            "prompt_h": prompt_h[:, :, :0],
            "context_h": context_h[:, :, :0],
            "conv_state": np.zeros_like(conv),
            "keep_frames": np.array(0, np.int64),
        },
    )
    err = rel_err(velocity, whole) if new_h.shape[2] == 0 and new_h.dtype == wire else float("inf")
    results.append(GateResult(key, "velocity rel err", err, tol, f"whole sentence, {total} frames, keep_frames=0"))
    return results


def graph_inputs_for_export(est: FlowEstimator) -> tuple[torch.Tensor, ...]:
    """Tracing example (batch 2, 19 new frames after 11 prompt and 7 context frames, 6 of them kept)."""
    feeds = {**example_inputs(est, np.random.default_rng(0), 2, 19, 11, 7), "keep_frames": np.array(6, np.int64)}
    return tuple(torch.from_numpy(feeds[k]) for k in INPUTS)


DYNAMIC_AXES = {
    "x": {0: "batch", 2: "time"},
    "mu": {0: "batch", 2: "time"},
    "cond": {0: "batch", 2: "time"},
    "t": {0: "batch"},
    "spks": {0: "batch"},
    "prompt_h": {1: "batch", 2: "prompt_frames"},
    "context_h": {1: "batch", 2: "context_frames"},
    "conv_state": {0: "batch"},
    "velocity": {0: "batch", 2: "time"},
    "new_h": {1: "batch", 2: "kept_frames"},
    "new_conv_state": {0: "batch"},
}


def export_stream_estimator(est: FlowEstimator, path: Path) -> None:
    """Write ``flow_estimator_stream.onnx`` (+ ``.data``) at ``path``."""
    torch_export(
        StreamEstimatorGraph(est),
        graph_inputs_for_export(est),
        path,
        input_names=INPUTS,
        output_names=OUTPUTS,
        dynamic_axes=DYNAMIC_AXES,
    )
