"""The graph-session seam: what a stage needs from an inference backend, and the options it opens graphs with.

Stages open every graph through :func:`~cosyvoice_cpu.backends.registry.open_graph` with a :class:`SessionConfig`;
the config's ``backend`` names the :class:`Backend` that opens it (today ONNX Runtime,
:mod:`cosyvoice_cpu.backends.onnxruntime`). A backend returns a :class:`GraphSession`: named inputs and outputs
with types and shapes, and ``run``. :func:`check_io` holds any session to the contract the stage feeds it, so a
graph that does not match fails at load with a message naming the file and the difference.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from cosyvoice_cpu.errors import ConfigError, ModelDirError

logger = logging.getLogger(__name__)


class NodeInfo(Protocol):
    """One input or output of a graph: its name, type (``"tensor(float)"``) and shape (ints or axis names)."""

    name: str
    type: str
    shape: list[int | str | None]


class GraphSession(Protocol):
    """An opened graph, as every stage uses it (ONNX Runtime's ``InferenceSession`` is one)."""

    def get_inputs(self) -> list[NodeInfo]: ...

    def get_outputs(self) -> list[NodeInfo]: ...

    def run(self, output_names: list[str] | None, feeds: dict[str, Any], run_options: Any = None) -> list[Any]: ...


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

    def shrink_options(self) -> Any:
        """Run options that give the backend's unused working memory back to the OS after a run (None: the
        backend has no such option)."""
        return None

    def release_idle_memory(self) -> None:
        """Give back the working memory the backend keeps for the whole process, once none of its sessions is
        open any more (``--unload-after``); nothing by default."""
        return None


@dataclass(frozen=True)
class SessionConfig:
    """Options for one graph session (a backend applies those it has; the arena and order options are ORT's).

    Attributes:
        threads: intra-op threads (0 = the backend's default, all cores).
        backend: the :class:`Backend` that opens the graph (:data:`~cosyvoice_cpu.backends.registry.BACKENDS`).
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

    ORT's CPU memory arena stays on for every graph, and by default one arena is shared by every session of the
    process, so the LM, the flow and the vocoder, which run one after the other, reuse one another's memory
    instead of each keeping its own peak. Why each option is set as it is, with the measurements:
    docs/benchmarks-log.md, "Memory".
    """

    threads: int = 0
    backend: str = "onnxruntime"
    spinning: bool = False
    mem_pattern: bool = False
    shared_arena: bool = True
    priority_order: bool = False
    release_weight_pages: bool = True
    max_shapes: int = 0

    def validate(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = all cores), got {self.threads}")
        if self.max_shapes < 0:
            raise ConfigError(f"max_shapes must be >= 0 (0 = one dynamic compile), got {self.max_shapes}")
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


def check_io(session: Any, path: str | Path, inputs: Spec, outputs: Spec) -> None:
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
