"""Flow graph pieces every family's export shares: the encoder's traceable masks and position encodings, the
query blocking of its attention, the tracing of the encoder (the CosyVoice2 contract, Fun-CosyVoice3's too) and of
the estimator (the official contract, every family), the random estimator feeds the gates use, and the float16
caches of the int8 recipes' stream graphs (:func:`half_cache_io`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cosyvoice_cpu.export.common import save_onnx, torch_export
from cosyvoice_cpu.export.fused_ops import unmasked_when_unpadded
from cosyvoice_cpu.reference.flow.encoder import RelPositionAttention

logger = logging.getLogger(__name__)

# The encoder's self-attention runs its query rows in this many blocks (RelPositionAttention.query_blocks): the
# same numbers, with score tensors of T/4 rows, which the attention's ~8 live score-sized tensors per layer grow
# with (T^2). Full-size CosyVoice2, fp32 encoder alone, 2 threads, Zen 3 (dev. probe; blocks 1 -> 4 -> 8): arena
# growth 110 -> 61 -> 53 MB at 325 tokens (10 s + a 3 s prompt), 702 -> 151 MB at 825, 2439 -> 412 -> 262 MB at
# 1575; 456 -> 381 -> 401 ms and 7.6 -> 6.7 -> 6.8 s per call; outputs bitwise equal; +10 / +22 MB of graph at load.
ENCODER_QUERY_BLOCKS = 4


@contextmanager
def query_blocks(module: nn.Module, blocks: int) -> Iterator[None]:
    """Set ``query_blocks`` of every :class:`RelPositionAttention` in ``module`` (not its subclasses, which
    have their own forward) for the duration, e.g. of an export."""
    layers = [m for m in module.modules() if type(m) is RelPositionAttention]
    before = [m.query_blocks for m in layers]
    for m in layers:
        m.query_blocks = blocks
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m.query_blocks = b


def chunk_visibility(size: Any, chunk: torch.Tensor) -> torch.Tensor:
    """Traceable chunk-causal mask, bool (size, size): key j visible from query i iff ``j < (i//chunk+1)*chunk``."""
    pos = torch.arange(size)
    end = (torch.div(pos, chunk, rounding_mode="floor") + 1) * chunk
    return pos.unsqueeze(0) < end.unsqueeze(1)


def rel_position_encoding(size: Any, d_model: int) -> torch.Tensor:
    """Traceable form of :func:`~cosyvoice_cpu.reference.flow.encoder.relative_position_encoding`: (1, 2T-1, D)."""
    position = (size - 1 - torch.arange(2 * size - 1)).to(torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    angle = position * div_term
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).unsqueeze(0)  # sin even, cos odd channels


def estimator_inputs(rng: np.random.Generator, lengths: list[int], size: int) -> dict[str, np.ndarray]:
    """Random estimator feeds, batch len(lengths), row b valid on its first lengths[b] of ``size`` frames."""
    b = len(lengths)
    mask = (np.arange(size)[None, None, :] < np.asarray(lengths)[:, None, None]).astype(np.float32)
    feeds = {
        "x": rng.standard_normal((b, 80, size)),
        "mask": mask,
        "mu": rng.standard_normal((b, 80, size)) * mask,
        "t": rng.uniform(0, 1, b),
        "spks": rng.standard_normal((b, 80)),
        "cond": rng.standard_normal((b, 80, size)) * mask,
    }
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()}


def pin_output_shape(path: Path, name: str, shape: list[int | str]) -> None:
    """Write a graph output's declared shape (the tracer leaves batch-1 dims symbolic); weights stay put."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    out = next(o for o in model.graph.output if o.name == name)
    for dim, value in zip(out.type.tensor_type.shape.dim, shape):
        dim.Clear()
        if isinstance(value, str):
            dim.dim_param = value
        else:
            dim.dim_value = value
    onnx.save_model(model, str(path))


@torch.inference_mode()
def export_encoder(graph: nn.Module, cfg: Any, path: Path, chunk_size: int) -> None:
    """Trace a ``flow_encoder.onnx`` under the CosyVoice2 contract (``token``, ``context``, ``embedding``,
    ``chunk_size`` -> ``mu``, ``spks``; CosyVoice2 and Fun-CosyVoice3); ``cfg`` is the flow config."""
    args = (
        torch.randint(0, cfg.vocab_size, (1, 37)),
        torch.randint(0, cfg.vocab_size, (1, max(cfg.pre_lookahead_len - 1, 1))),
        torch.randn(1, cfg.spk_embed_dim),
        torch.tensor(chunk_size, dtype=torch.int64),
    )
    torch_export(
        graph,
        args,
        path,
        input_names=["token", "context", "embedding", "chunk_size"],
        output_names=["mu", "spks"],
        dynamic_axes={"token": {1: "tokens"}, "context": {1: "context"}, "mu": {2: "frames"}},
    )
    pin_output_shape(path, "mu", [1, cfg.output_size, "frames"])


def export_estimator(graph: nn.Module, path: Path) -> None:
    """Trace a ``flow_estimator.onnx`` under the official contract (``x, mask, mu, t, spks, cond`` ->
    ``estimator_out``), batch and time dynamic (the UNets of CosyVoice-300M/CosyVoice2 and the DiT)."""
    rng = np.random.default_rng(0)
    args = tuple(torch.from_numpy(v) for v in estimator_inputs(rng, [71, 60], 71).values())
    names = ["x", "mask", "mu", "t", "spks", "cond"]
    axes: dict[str, dict[int, str]] = {n: {0: "batch", 2: "time"} for n in ("x", "mask", "mu", "cond")}
    axes.update(t={0: "batch"}, spks={0: "batch"}, estimator_out={0: "batch", 2: "time"})
    torch_export(graph, args, path, input_names=names, output_names=["estimator_out"], dynamic_axes=axes)
    pin_output_shape(path, "estimator_out", ["batch", 80, "time"])  # the tracer cannot infer through fused ops
    unmasked_when_unpadded(path)


# the stream graphs' cache inputs and outputs: CosyVoice2's (norm1 outputs, .cosyvoice2_stream) and
# Fun-CosyVoice3's (keys/values of the DiT, .cosyvoice3_stream)
CACHE_IO = (
    (("prompt_h", "context_h"), ("new_h",)),
    (("prompt_k", "prompt_v", "context_k", "context_v"), ("new_k", "new_v")),
)


def cache_io(input_names: set[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The (cache inputs, cache outputs) of a stream graph with these input names, or None (not a stream graph)."""
    return next((io for io in CACHE_IO if set(io[0]) <= input_names), None)


def half_cache_io(path: Path, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """Make the graph at ``path`` take its cache ``inputs`` and return its cache ``outputs`` in float16 (in place).

    A ``Cast`` to float32 follows each such input and a ``Cast`` to float16 precedes each such output; everything
    inside stays float32. The runtime then stores the per-voice prompt cache and each stream's context in half
    the memory (full-size CosyVoice2, 3 s voice: 173 -> 87 MB and 57 -> 28 MB per stream; Fun-CosyVoice3's
    keys/values 365 -> 185 MB) and feeds them as they are: ORT's vectorized Cast widens CosyVoice2's prompt
    cache in ~0.3 ms per call, where NumPy's ``astype`` took ~6 ms. Applied to the int8 estimators' stream graphs
    only (the rounding, ~5e-4 relative on the cached activations, is far below their quantization error); the
    fp32 graphs keep float32 caches and stay exact.
    """
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=True)
    graph = model.graph
    head, tail = [], []
    for value in graph.input:
        if value.name in inputs:
            wide = value.name + "_fp32"
            for node in graph.node:
                node.input[:] = [wide if i == value.name else i for i in node.input]
            head.append(helper.make_node("Cast", [value.name], [wide], to=TensorProto.FLOAT, name=f"{wide}_cast"))
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    for value in graph.output:
        if value.name in outputs:
            wide = value.name + "_fp32"
            for node in graph.node:
                node.output[:] = [wide if o == value.name else o for o in node.output]
            tail.append(helper.make_node("Cast", [wide], [value.name], to=TensorProto.FLOAT16, name=f"{wide}_cast"))
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    if len(head) != len(inputs) or len(tail) != len(outputs):
        raise ValueError(f"{path} lacks some of the cache inputs {inputs} / outputs {outputs}")
    nodes = [*head, *graph.node, *tail]
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    save_onnx(model, Path(path))
