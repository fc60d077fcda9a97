"""The one ONNX Runtime session factory of the runtime, and the graph-contract check.

Every stage opens its graphs here so threads, spinning and the arena are configured in one place, and so a graph
whose inputs/outputs do not match what the stage feeds it fails at load with a message naming the file and the
difference (not at the first ``run`` with an ORT error).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.pages import release_file_pages

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionConfig:
    """ORT options for one session.

    Attributes:
        threads: intra-op threads (0 = ORT's default, all cores).
        spinning: let idle pool threads spin (lower latency for one stream; off when several run concurrently).
        mem_pattern: ORT's per-shape memory planning (off for graphs fed many shapes: it caches a plan each).
        shared_arena: allocate activations from one CPU arena shared by every session of the process that sets
            it (see :func:`_register_shared_arena`), instead of one arena per session.
        priority_order: ORT's priority-based node order instead of its default. For graphs with side outputs
            gathered from every layer: with the default order the measured memory behaves as if the gathers ran
            after the whole main output, keeping every layer's input alive until then (pruning the side outputs
            away gives the same 66 MB as this option). CosyVoice2's
            stream estimator on a 650-frame whole sentence: arena growth 177 -> 66 MB (the whole-sentence
            graph's own), same speed (alternated medians 547 vs 555 ms; 120 vs 117 ms on a streamed chunk).
            It costs other graphs ~20 MB (HiFT, the flow encoder), so it is per session.
        release_weight_pages: once the session is built, have the kernel reclaim the pages of the graph's
            ``<graph>.data`` file that building it touched (:func:`~cosyvoice_cpu.pages.release_file_pages`).
            ORT keeps the file mapped, but kernels that packed their weights at load (the LM's ``MatMulNBits``)
            never read it again: full-size CosyVoice2 int8w, the LM's 44 MB of block scales. Kernels that read
            the file at run time (fp32-compute ``MatMulNBits``, convolutions) touch their pages again at their
            first run; those pages are not touched at load, so nothing is released for them.

    ORT's CPU memory arena stays on for every graph: without it the whole-sentence flow estimator took twice as
    long (full-size int8w, 650 frames: 13.8 s vs 6.9 s per 10-step solve; freed 100+ MB activations went back to
    the OS and were faulted in again at every call), for ~115 MB less peak RSS. An arena never returns memory,
    so with one arena per session the stages' peaks *add up*: the LM, the flow and the vocoder run one after the
    other, and a shared arena serves each from the memory the previous one freed. Full-size CosyVoice2 int8w,
    10 s whole sentences: peak RSS 1226 -> 1053 MB at the same speed; a process that also streams 1692 -> 1411 MB.
    """

    threads: int = 0
    spinning: bool = False
    mem_pattern: bool = False
    shared_arena: bool = True
    priority_order: bool = False
    release_weight_pages: bool = True

    def validate(self) -> None:
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = all cores), got {self.threads}")


def as_config(threads: int | SessionConfig) -> SessionConfig:
    """A stage's ``threads`` argument: a thread count (other options default) or a full :class:`SessionConfig`."""
    if isinstance(threads, SessionConfig):
        return threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError(f"threads must be an int >= 0 (0 = all cores) or a SessionConfig, got {threads!r}")
    return SessionConfig(threads=threads)


_ARENA_LOCK = threading.Lock()
_arena: bool | None = None  # None: not tried yet; then whether the shared arena is registered


def _register_shared_arena(ort: Any) -> bool:
    """Register one CPU arena allocator in ORT's process-wide environment, once; False if ORT refused.

    Extend strategy kNextPowerOfTwo (ORT's default): measured lower peaks than kSameAsRequested (1006 vs 1076 MB,
    full-size CosyVoice2, LM + flow + vocoder of a 10 s sentence), whose many exact-size regions fragment.
    """
    global _arena
    with _ARENA_LOCK:
        if _arena is None:
            try:
                info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
                ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 0}))
                _arena = True
            except Exception as e:  # e.g. an embedding application registered its own CPU allocator first
                logger.warning("ORT refused a shared CPU arena (%s); each session keeps its own", e)
                _arena = False
        return _arena


def make_session(path: str | Path, config: SessionConfig | None = None) -> Any:
    """Open ``path`` on the CPU execution provider; a missing or unreadable graph is a :class:`ModelDirError`."""
    import onnxruntime as ort

    config = config or SessionConfig()
    config.validate()
    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"graph {path} is missing; re-export the model directory")
    so = ort.SessionOptions()
    so.intra_op_num_threads = config.threads
    so.inter_op_num_threads = 1
    so.enable_mem_pattern = config.mem_pattern
    if config.priority_order:
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    so.log_severity_level = 3
    spin = "1" if config.spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if config.shared_arena and _register_shared_arena(ort):
        so.add_session_config_entry("session.use_env_allocators", "1")
    try:
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types (InvalidGraph, NoSuchFile, Fail, ...)
        raise ModelDirError(f"cannot load graph {path}: {str(e).splitlines()[0]}; re-export the model") from e
    if config.release_weight_pages:
        released = release_file_pages(path.with_name(path.name + ".data"))
        logger.debug("%s: %.1f MB of weight-file pages released after load", path.name, released / 2**20)
    return session


# mel frames above which a flow-encoder call gives the arena memory it took back (EngineConfig.arena_shrink_frames)
DEFAULT_SHRINK_FRAMES = 1000


def shrink_after_run() -> Any:
    """``RunOptions`` that have ORT give its CPU arena's unused regions back to the OS when the run ends
    (``memory.enable_memory_arena_shrinkage``; with the shared arena, every session's free regions).

    For calls whose activations far exceed the usual ones: the flow encoder's attention grows with the square of
    the length (full-size CosyVoice2 int8w, 2 threads, query rows in 4 blocks: the arena grew by 102-111 MB for
    650 frames, 242 MB for 1650 and 450 MB for 3150; 159, 746 and 2490 MB in one block), and an arena keeps what
    it grew for the life of the process. Not for every call: the next calls fault their pages in again
    (docs/benchmarks.md, "Memory").
    """
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


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
