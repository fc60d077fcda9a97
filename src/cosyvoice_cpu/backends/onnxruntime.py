"""The ONNX Runtime backend: the one ORT session factory of the runtime (threads, spinning and one CPU arena shared
by every session configured in one place) and ORT's arena-shrink run option.

``onnxruntime`` itself is imported only when a graph is opened: the CPU is checked before any kernel library loads.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from cosyvoice_cpu.backends.base import Backend, GraphSession, SessionConfig
from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.hardware.pages import release_file_pages

logger = logging.getLogger(__name__)


_ARENA_LOCK = threading.Lock()
_arena: bool | None = None  # None: not tried yet; then whether the shared arena is registered


def _register_shared_arena(ort: Any) -> bool:
    """Register one CPU arena allocator in ORT's process-wide environment, once; False if ORT refused.

    Extend strategy kNextPowerOfTwo (ORT's default): measured a lower peak than kSameAsRequested for the LM, flow
    and vocoder of a 10 s sentence, whose many exact-size regions fragment (docs/benchmarks-log.md, "Memory").
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


def shrink_after_run() -> Any:
    """``RunOptions`` that have ORT give its CPU arena's unused regions back to the OS when the run ends
    (``memory.enable_memory_arena_shrinkage``; with the shared arena, every session's free regions).

    For calls whose activations far exceed the usual ones: the flow encoder's attention grows with the square of
    the length (with its query rows in 4 blocks too, only more slowly than in one), and an arena keeps what it grew
    for the life of the process. Not for every call: the next calls fault their pages in again (measured:
    docs/benchmarks-log.md, "Memory").
    """
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


class OnnxRuntime(Backend):
    """:class:`~cosyvoice_cpu.backends.base.Backend` on ONNX Runtime's CPU execution provider."""

    name = "onnxruntime"

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("onnxruntime") is not None

    def open(self, path: Path, config: SessionConfig) -> GraphSession:
        return make_session(path, config)

    def version(self) -> str | None:
        if not self.available():
            return None
        import onnxruntime as ort

        return str(ort.__version__)

    def shrink_options(self) -> Any:
        return shrink_after_run()

    def release_idle_memory(self) -> None:
        """The shared arena (``session.use_env_allocators``) lives in ORT's process-wide environment and keeps its
        regions after every session closed; one run with arena shrinkage, of a tiny graph on that arena (the
        package's ``calibration/sgemm.onnx``), gives the free regions back to the OS."""
        if not _arena:
            return
        from importlib import resources

        import numpy as np
        import onnxruntime as ort

        path = resources.files("cosyvoice_cpu").joinpath("calibration/sgemm.onnx")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.use_env_allocators", "1")
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        one = np.ones((1, 1), np.float32)
        session.run(None, {i.name: one for i in session.get_inputs()}, run_options=shrink_after_run())
