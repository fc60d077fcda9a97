"""The flow graphs' contracts (inputs with dtype and rank, outputs) and the checked opening of a flow graph;
what the stream estimators' cache inputs say about their layout and dtype.

The contracts are the exporter's (:mod:`cosyvoice_cpu.export.flow_graph` and the family modules); a model directory
whose graph differs gets a :class:`~cosyvoice_cpu.errors.ModelDirError` naming the input when the graph is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig, as_config, check_io
from cosyvoice_cpu.backends.registry import open_graph

IO = tuple[dict[str, tuple[str, int]], tuple[Any, ...]]  # ({input: (dtypes, rank)}, (output | (output, dtypes)))

ENCODER_IO = (
    {"token": ("int64", 2), "context": ("int64", 2), "embedding": ("float", 2), "chunk_size": ("int64", 0)},
    ("mu", "spks"),
)
ESTIMATOR_IO = (
    {
        "x": ("float", 3),
        "mask": ("float", 3),
        "mu": ("float", 3),
        "t": ("float", 1),
        "spks": ("float", 2),
        "cond": ("float", 3),
    },
    ("estimator_out",),
)
STREAM_IO = (
    {
        "x": ("float", 3),
        "mu": ("float", 3),
        "t": ("float", 1),
        "spks": ("float", 2),
        "cond": ("float", 3),
        "prompt_h": ("float|float16", 4),
        "context_h": ("float|float16", 4),
        "conv_state": ("float", 3),
        "keep_frames": ("int64", 0),
    },
    ("velocity", ("new_h", "float|float16"), "new_conv_state"),
)


def open_checked(path: Path, threads: int | SessionConfig, io: IO) -> Any:
    """A session on a flow graph whose inputs (dtype, rank) and output names are checked against ``io``."""
    sess = open_graph(path, as_config(threads))
    inputs, outputs = io
    want_in = {n: (_types(dt), rank) for n, (dt, rank) in inputs.items()}
    out_rank = {o.name: len(o.shape) for o in sess.get_outputs()}
    want_out = dict(o if isinstance(o, tuple) else (o, "float") for o in outputs)
    check_io(sess, path, want_in, {n: (_types(dt), out_rank.get(n, 0)) for n, dt in want_out.items()})
    return sess


def _types(dtypes: str) -> str:
    """``"float|float16"`` -> ``"tensor(float)|tensor(float16)"`` (alternatives :func:`check_io` accepts)."""
    return "|".join(f"tensor({d})" for d in dtypes.split("|"))


def stream_layout(sess: Any) -> tuple[int, int, int]:
    """(L, width, S) of a v2 stream estimator from its input shapes (prompt_h (L, B, T, width), conv (B, S, 2))."""
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    return int(shapes["prompt_h"][0]), int(shapes["prompt_h"][3]), int(shapes["conv_state"][1])


def cache_dtype(sess: Any, name: str = "prompt_h") -> type:
    """The dtype a stream estimator takes its caches in (the type of its input ``name``) and returns the new
    ones in: float32, or float16 (the int8 recipes' graphs, ``export.flow_stream_graph.half_cache_io``)."""
    kind = next(i.type for i in sess.get_inputs() if i.name == name)
    return np.float16 if kind == "tensor(float16)" else np.float32


def cache_storage(sess: Any, name: str, requested: Any) -> tuple[type, Any]:
    """(the graph's cache dtype, the dtype to store a prompt cache in): ``requested`` (float32, or float16 for
    half the memory, widened per call) for a float32 graph; always float16 for a graph that takes float16."""
    wire = cache_dtype(sess, name)
    return wire, wire if wire == np.float16 else requested
