"""The graph-session seam: what a stage needs from an inference backend, and the options it opens graphs with.

Stages open every graph through :func:`~cosyvoice_cpu.backends.registry.open_graph` with a :class:`SessionConfig`;
the config's ``backend`` names the :class:`Backend` that opens it (one of :data:`BACKEND_NAMES`). A backend returns
a :class:`GraphSession`: named inputs and outputs with types and shapes, ``run``, and what a stage would otherwise
have to know about the backend: the graph's metadata, giving working memory back after a call
(``run(..., release_memory=True)``), compiling shapes ahead (``prepare``) and running a decoder's KV cache in place
(``bind_in_place``). :func:`check_io` holds any session to the contract the stage feeds it, so a graph that does not
match fails at load with a message naming the file and the difference.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

from cosyvoice_cpu.errors import ConfigError, ModelDirError

logger = logging.getLogger(__name__)

# The inference backends, by the name a SessionConfig, ``--backend`` and the plan use (the one list of them;
# backends.registry maps each to its Backend, backends.plan adds the choice ``auto``)
ONNXRUNTIME = "onnxruntime"
OPENVINO = "openvino"
BACKEND_NAMES = (ONNXRUNTIME, OPENVINO)


class NodeInfo(Protocol):
    """One input or output of a graph: its name, type (``"tensor(float)"``) and shape (ints or axis names)."""

    name: str
    type: str
    shape: list[int | str | None]


class BoundRun(Protocol):
    """Runs of one graph with some inputs bound in place to caller-owned buffers (:meth:`GraphSession.bind_in_place`).

    ``run(feeds, outputs)``: ``feeds`` are the other inputs (name -> array); ``outputs`` name -> a preallocated
    array that receives that output. After the call every bound buffer holds the graph's output paired with it.
    """

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None: ...


class GraphSession(ABC):
    """An opened graph, as every stage uses it: what differs between backends lives here, not in the stages.

    Every session answers ``get_inputs`` / ``get_outputs`` / ``run``; the rest has a default that is right for a
    backend with nothing to do (no metadata, no memory to give back, nothing to compile ahead, in-place binding by
    copying).

    **A decoder's KV cache.** The LM graph (:mod:`cosyvoice_cpu.lm.bound_graph`) takes each layer's cache as an input
    ``past_*`` and returns it as ``present_*`` of the same shape (B rows, Hkv, M positions, Dh). The LM keeps the
    cache in buffers of its own (:class:`~cosyvoice_cpu.lm.kv_cache.KVCache`: rows that come and go with the
    scheduler's requests, prefix-cache entries copied in and out with ``read`` / ``write``, pages given back with
    ``release``) and asks the session for :meth:`bind_in_place` over a row range of them. ONNX Runtime binds the
    buffers as both input and output (IO binding, raw pointers), so a step copies nothing; the default here runs
    the graph and copies each ``present_*`` back (right on any backend whose graph keeps the contract, at the cost of
    moving the whole cache through every call). OpenVINO does not keep it (its GroupQueryAttention returns the
    cache cut to the positions in use) and says so (``OpenVinoSession.bind_in_place``).

    A *stateful* graph (OpenVINO's LLM form: the KV cache as the compiled model's state, the form Intel tunes) has
    no ``past_*`` inputs to bind: its session says :attr:`stateful` and hands out :class:`ModelState` s
    (:meth:`open_state`), each an inference request with a state of its own, which the LM drives as its cache
    (:mod:`cosyvoice_cpu.lm.state_graph`).
    """

    @abstractmethod
    def get_inputs(self) -> list[NodeInfo]:
        """The graph's inputs."""

    @abstractmethod
    def get_outputs(self) -> list[NodeInfo]:
        """The graph's outputs."""

    @abstractmethod
    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        """Outputs (all, or ``output_names``, in that order) for ``feeds`` (every input by name).

        ``release_memory``: give the working memory the call grew back to the OS when it ends (for calls far larger
        than the usual ones; ONNX Runtime: its arena's free regions; a no-op where the backend keeps none).
        """

    def metadata(self) -> dict[str, str]:
        """The graph file's custom metadata (key -> value); empty where the backend does not read it."""
        return {}

    def prepare(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Get ready for calls with these input shapes (a compiling backend compiles them now); nothing by
        default."""
        return None

    def bind_in_place(self, pairs: Mapping[str, tuple[str, np.ndarray]]) -> BoundRun:
        """Runs with each input ``name`` of ``pairs`` bound to its buffer, which the paired output overwrites
        (``name -> (output name, buffer)``; a buffer is C-contiguous and of the input's shape for that run).

        The buffers must stay alive as long as the returned :class:`BoundRun`. This default runs the graph and
        copies each paired output back into its buffer; a backend that can share one buffer between an input and
        an output (ONNX Runtime) overrides it to copy nothing.
        """
        return CopyingRun(self, pairs)

    @property
    def stateful(self) -> bool:
        """Whether the graph keeps state between calls (read and written through :meth:`open_state`)."""
        return False

    @property
    def keeps_working_memory(self) -> bool:
        """Whether the working memory of this graph's largest call stays with the graph until a call with
        ``release_memory`` gives it back (OpenVINO: each compiled model's intermediate buffers, which no other graph
        reuses). False where the backend pools that memory across graphs (ONNX Runtime's one arena, which the next
        graph's call reuses)."""
        return False

    @property
    def rows_apart(self) -> bool:
        """Whether a batched input whose batch axis is not its first is best laid out with each batch row contiguous
        (:func:`~cosyvoice_cpu.backends.row_groups.rows_apart`). True for a session that splits calls by rows: each
        group's call then takes its row as a view, not a copy. False for one that runs whole calls, which takes a
        C-ordered input without a copy (ONNX Runtime copies one that is not C-contiguous)."""
        return False

    def open_state(self) -> ModelState:
        """A new inference request of this stateful graph, with an empty state of its own."""
        raise ConfigError("this graph keeps no state between calls; it has no ModelState to open")


class ModelState(ABC):
    """One inference request of a stateful graph and the state it carries from call to call.

    The state is a set of named tensors (for the LM: each layer's keys and values, (B, Hkv, P, Dh)) that every
    :meth:`run` reads and extends. A request is used by one thread at a time.
    """

    @abstractmethod
    def run(self, feeds: Mapping[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        """Outputs ``output_names`` for ``feeds`` (every input by name); the state advances."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the state (the next call starts from the graph's initial state)."""

    @abstractmethod
    def read(self) -> dict[str, np.ndarray]:
        """A copy of every state tensor, by name."""

    @abstractmethod
    def write(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Make ``tensors`` (every state name -> an array of the state's type) the state."""


class WrappedSession(GraphSession):
    """A session over another (``wrapped``) that changes how calls run (pads them, splits their rows) but not what the
    graph is: its inputs, outputs, metadata, compiles ahead, working memory and preferred input layout are the wrapped
    session's. ``run`` is the wrapper's own; in-place binding and state are not passed through (a wrapper that changes
    calls decides)."""

    def __init__(self, wrapped: GraphSession) -> None:
        self.wrapped = wrapped

    def get_inputs(self) -> list[NodeInfo]:
        return self.wrapped.get_inputs()

    def get_outputs(self) -> list[NodeInfo]:
        return self.wrapped.get_outputs()

    def metadata(self) -> dict[str, str]:
        return self.wrapped.metadata()

    def prepare(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.wrapped.prepare(shapes)

    @property
    def keeps_working_memory(self) -> bool:
        return self.wrapped.keeps_working_memory

    @property
    def rows_apart(self) -> bool:
        return self.wrapped.rows_apart


class CopyingRun:
    """:class:`BoundRun` for any :class:`GraphSession`: feeds the buffers, copies the paired outputs back."""

    def __init__(self, session: GraphSession, pairs: Mapping[str, tuple[str, np.ndarray]]) -> None:
        self.session, self.pairs = session, dict(pairs)

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        bound = [out for out, _ in self.pairs.values()]
        names = [*outputs, *bound]
        values = self.session.run(names, {**feeds, **{k: buf for k, (_, buf) in self.pairs.items()}})
        targets = [*outputs.values(), *(buf for _, buf in self.pairs.values())]
        for name, target, value in zip(names, targets, values):
            if value.shape != target.shape:
                raise ConfigError(
                    f"{name} came back with shape {value.shape}, not its buffer's {target.shape}: this backend does "
                    "not run the graph with the contract it binds in place"
                )
            np.copyto(target, value)


class Backend(ABC):
    """An inference engine that opens graph files as :class:`GraphSession` s."""

    name: ClassVar[str]

    @abstractmethod
    def available(self) -> bool:
        """Whether the backend's library can be used in this process."""

    @abstractmethod
    def open(self, path: Path, config: SessionConfig) -> GraphSession:
        """Open the graph at ``path``; a missing or unreadable file is a :class:`ModelDirError`."""

    def version(self) -> str | None:
        """The backend library's version (``doctor``, bench reports); None when the library is not installed.
        Imports the library: call it once the CPU is known to run it."""
        return None

    def release_idle_memory(self) -> None:
        """Give back the working memory the backend keeps for the whole process, once none of its sessions is
        open any more (``--unload-after``); nothing by default."""
        return None


@dataclass(frozen=True)
class Padding:
    """Which inputs of a graph may be zero-padded along one axis to a shared size without changing the outputs
    (cut back along the same axis): ``inputs`` (the first one's size is the call's), ``axis``. A backend that
    compiles per shape pads to :func:`~cosyvoice_cpu.backends.buckets.bucket` sizes; others ignore it."""

    inputs: tuple[str, ...]
    axis: int = 2


@dataclass(frozen=True)
class SessionConfig:
    """Options for one graph session (a backend applies those it has; the arena and order options are ORT's).

    Attributes:
        threads: intra-op threads (0 = the backend's default, all cores).
        backend: the name of the :class:`Backend` that opens the graph (one of :data:`BACKEND_NAMES`).
        spinning: let idle pool threads spin (lower latency for one stream; off when several run concurrently).
        mem_pattern: ORT's per-shape memory planning (off for graphs fed many shapes: it caches a plan each).
        shared_arena: allocate activations from one CPU arena shared by every session of the process that sets
            it (see :func:`_register_shared_arena`), instead of one arena per session.
        priority_order: ORT's priority-based node order instead of its default, for graphs with side outputs
            gathered from every layer (the stream estimator's caches): it frees each layer's input early. Per
            session, because other graphs grow the arena a little more with it.
        release_weight_pages: once the session is built, have the kernel reclaim the pages of the graph's weight
            file that building it touched (:func:`~cosyvoice_cpu.hardware.pages.release_file_pages`): ORT's
            ``<graph>.data``, OpenVINO's ``.bin`` after each compile. Kernels that read the file at run time
            touch their pages again.
        max_shapes: for a backend that compiles (OpenVINO): 0 compiles each graph once with its dynamic axes; N > 0
            compiles per input shape and keeps N shapes compiled per session.
        padding: inputs a backend that compiles per shape may pad to shared sizes (:class:`Padding`; None: run
            every shape as it comes). The session pads and cuts back itself (:mod:`~cosyvoice_cpu.backends.buckets`).
        row_groups: 0 runs each call as one; N >= 2 splits a call's batch rows into N groups that run at once,
            each a call on one intra-op thread (:mod:`~cosyvoice_cpu.backends.row_groups`: for graphs called at
            small shapes, the flow estimators' CFG rows). Only where ``threads`` is N (calls at once on one
            session share its one pool, so more threads would not reach the groups); ONNX Runtime's (other
            backends run each call as one).

    ORT's CPU memory arena stays on for every graph, and by default one arena is shared by every session of the
    process, so the LM, the flow and the vocoder, which run one after the other, reuse one another's memory
    instead of each keeping its own peak. Why each option is set as it is, with the measurements:
    docs/benchmarks-log.md, "Memory".
    """

    threads: int = 0
    backend: str = ONNXRUNTIME
    spinning: bool = False
    mem_pattern: bool = False
    shared_arena: bool = True
    priority_order: bool = False
    release_weight_pages: bool = True
    max_shapes: int = 0
    padding: Padding | None = None
    row_groups: int = 0

    def validate(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = all cores), got {self.threads}")
        if self.max_shapes < 0:
            raise ConfigError(f"max_shapes must be >= 0 (0 = one dynamic compile), got {self.max_shapes}")
        if self.row_groups < 0 or self.row_groups == 1:
            raise ConfigError(f"row_groups must be 0 (one call) or >= 2, got {self.row_groups}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must name an inference backend, got {self.backend!r}")


def as_config(threads: int | SessionConfig) -> SessionConfig:
    """A stage's ``threads`` argument: a thread count (other options default) or a full :class:`SessionConfig`."""
    if isinstance(threads, SessionConfig):
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError(f"threads must be an int >= 0 (0 = all cores) or a SessionConfig, got {threads!r}")
    return SessionConfig(threads=threads)


# mel frames above which a flow-encoder call gives the arena memory it took back (EngineConfig.arena_shrink_frames)
DEFAULT_SHRINK_FRAMES = 1000


Spec = dict[str, tuple[str, "int | list[int | str]"]]  # name -> (ORT type such as "tensor(float)", rank or shape)


def check_io(session: GraphSession, path: str | Path, inputs: Spec, outputs: Spec) -> None:
    """Raise :class:`ModelDirError` unless the graph has exactly these inputs and outputs.

    Each entry is ``name -> (type, rank)`` or ``name -> (type, shape)``; ``type`` may list alternatives
    separated by ``|``; in a shape, strings are dynamic axes (anything matches) and integers must equal the
    graph's fixed size.
    """
    problems = []
    for kind, want, got in (("input", inputs, session.get_inputs()), ("output", outputs, session.get_outputs())):
        have = {a.name: (a.type, list(a.shape)) for a in got}
        problems += [f"unexpected {kind} {name}" for name in sorted(set(have) - set(want))]
        for name, (dtype, shape) in want.items():
            if name not in have:
                problems.append(f"missing {kind} {name}")
                continue
            gtype, gshape = have[name]
            if isinstance(shape, int):
                ok = len(gshape) == shape
            else:
                ok = len(gshape) == len(shape) and all(
                    not isinstance(w, int) or not isinstance(g, int) or g == w for g, w in zip(gshape, shape)
                )
            if gtype not in dtype.split("|") or not ok:
                problems.append(f"{kind} {name} is {gtype} {gshape}, expected {dtype} {shape}")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} problems)" if len(problems) > 6 else "")
        raise ModelDirError(
            f"{path} does not have the expected graph contract: {shown}. It was not written by this version of "
            "`cosyvoice-cpu export`; re-export the model directory"
        )
