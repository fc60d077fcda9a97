"""The flow graphs' contracts (inputs with dtype and rank, outputs) and the checked opening of a flow graph;
what the stream estimators' cache inputs say about their layout and dtype, and how their caches grow.

The contracts shared by families are here (the encoder of the chunk-streamed families, the official estimator); each
family module holds its own (:data:`cosyvoice_cpu.flow.cosyvoice2.STREAM_IO`, ...). They are the exporter's
(:mod:`cosyvoice_cpu.export.flow`); a model directory whose graph differs gets a
:class:`~cosyvoice_cpu.errors.ModelDirError` naming the input when the graph is opened.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import GraphSession, Padding, SessionConfig, as_config, check_io
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.backends.row_groups import rows_apart
from cosyvoice_cpu.errors import ModelDirError

# ({input: (dtypes, rank)}, (output | (output, dtypes))); dtypes like "float|float16"
IO = tuple[dict[str, tuple[str, int]], tuple[str | tuple[str, str], ...]]

ENCODER_IO: IO = (
    {"token": ("int64", 2), "context": ("int64", 2), "embedding": ("float", 2), "chunk_size": ("int64", 0)},
    ("mu", "spks"),
)
ESTIMATOR_IO: IO = (
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

# The estimator's frame axis: x, mu, cond and mask zero-padded (mask 0 marks absent frames) give the unpadded
# output for graphs whose ``pad_exact`` attr says so (the export measures it)
ESTIMATOR_PADDING = Padding(inputs=("x", "mu", "cond", "mask"), axis=2)


@dataclass(frozen=True)
class ShapedGraph:
    """A whole-sentence estimator to open on another backend: ``path`` (e.g. the OpenVINO model), ``backend`` (its
    name in :data:`~cosyvoice_cpu.backends.base.BACKEND_NAMES`), and ``pad``: whether calls may be padded to
    shared frame counts (the graph's ``pad_exact`` attr: padding leaves its output alone)."""

    path: Path
    backend: str = "openvino"
    pad: bool = True


def estimator_shapes(
    frames: int, rows: int = 2, time: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """The input shapes of a ``rows``-row estimator call of ``frames`` frames (two rows: one guided call); ``time``:
    the time input's name and shape where it is not ``t`` (rows,) (a graph taking its time table)."""
    return {
        "x": (rows, 80, frames),
        "mask": (rows, 1, frames),
        "mu": (rows, 80, frames),
        **(time or {"t": (rows,)}),
        "spks": (rows, 80),
        "cond": (rows, 80, frames),
    }


def open_checked(path: Path, threads: int | SessionConfig, io: IO, *alternatives: IO) -> GraphSession:
    """A session on a flow graph whose inputs (dtype, rank) and output names are checked against ``io``, or
    against one of ``alternatives`` (the contracts a graph of this role may have); a graph that has none of them
    gets the :class:`~cosyvoice_cpu.errors.ModelDirError` of ``io``."""
    sess = open_graph(path, as_config(threads))
    errors = []
    for contract in (io, *alternatives):
        try:
            _check(sess, path, contract)
            return sess
        except ModelDirError as e:
            errors.append(e)
    raise errors[0]


def _check(sess: GraphSession, path: Path, io: IO) -> None:
    inputs, outputs = io
    want_in = {n: (_types(dt), rank) for n, (dt, rank) in inputs.items()}
    out_rank = {o.name: len(o.shape) for o in sess.get_outputs()}
    want_out = dict(o if isinstance(o, tuple) else (o, "float") for o in outputs)
    check_io(sess, path, want_in, {n: (_types(dt), out_rank.get(n, 0)) for n, dt in want_out.items()})


def _types(dtypes: str) -> str:
    """``"float|float16"`` -> ``"tensor(float)|tensor(float16)"`` (alternatives :func:`check_io` accepts)."""
    return "|".join(f"tensor({d})" for d in dtypes.split("|"))


def cache_dtype(sess: GraphSession, name: str = "prompt_h") -> type[np.floating]:
    """The dtype a stream estimator takes its caches in (the type of its input ``name``) and returns the new
    ones in: float32, or float16 (the int8 recipes' graphs, ``export.flow.common.half_cache_io``)."""
    kind = next(i.type for i in sess.get_inputs() if i.name == name)
    return np.float16 if kind == "tensor(float16)" else np.float32


def cache_storage(
    sess: GraphSession, name: str, requested: type[np.floating]
) -> tuple[type[np.floating], type[np.floating]]:
    """(the graph's cache dtype, the dtype to store a prompt cache in): ``requested`` (float32, or float16 for
    half the memory, widened per call) for a float32 graph; always float16 for a graph that takes float16."""
    wire = cache_dtype(sess, name)
    return wire, wire if wire == np.float16 else requested


def extend_cache(sess: GraphSession, cache: np.ndarray, new: np.ndarray, keep: int | None = None) -> np.ndarray:
    """A stream estimator's (L, B, T, W) cache followed by its (L, B, N, W) new frames along the frame axis, only the
    last ``keep`` frames where ``keep`` is not None: one copy (none where the result is ``new`` as it is), laid out as
    ``sess`` takes it without another (each batch row contiguous where the session splits calls by rows:
    ``GraphSession.rows_apart``)."""
    total = cache.shape[2] + new.shape[2]
    frames = total if keep is None else min(keep, total)
    dtype = np.result_type(cache, new)
    if frames == cache.shape[2] and new.shape[2] == 0:
        return cache.astype(dtype, copy=False)
    taken = np.moveaxis(new, 1, 0) if sess.rows_apart else new  # C-contiguous when laid out as the session takes it
    if frames == new.shape[2] and new.dtype == dtype and taken.flags.c_contiguous:
        return new  # the new frames alone (a chunk as long as the bound), already in the session's layout
    shape = (cache.shape[0], cache.shape[1], frames, cache.shape[3])
    out = rows_apart(shape, dtype, 1) if sess.rows_apart else np.empty(shape, dtype)
    old = max(0, cache.shape[2] - (total - frames))  # the cached frames kept, then the last new ones
    out[:, :, :old] = cache[:, :, cache.shape[2] - old :]
    out[:, :, old:] = new[:, :, new.shape[2] - (frames - old) :]
    return out
