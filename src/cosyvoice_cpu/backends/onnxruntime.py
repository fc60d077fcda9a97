"""The ONNX Runtime backend: the one ORT session factory of the runtime (threads, spinning and one CPU arena shared
by every session configured in one place), and :class:`OrtSession`, the
:class:`~cosyvoice_cpu.backends.base.GraphSession` over it: ORT's arena-shrink run option behind
``release_memory``, the graph's metadata, and IO binding for a KV cache updated in place.

``onnxruntime`` itself is imported only when a graph is opened: the CPU is checked before any kernel library loads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from cosyvoice_cpu.backends.base import ONNXRUNTIME, Backend, BoundRun, GraphSession, NodeInfo, SessionConfig
from cosyvoice_cpu.backends.row_groups import RowGroupSession
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.hardware.pages import release_file_pages
from cosyvoice_cpu.hardware.pools import splits_rows

if TYPE_CHECKING:
    import onnxruntime as ort

logger = logging.getLogger(__name__)


_ARENA_LOCK = threading.Lock()
_arena: bool | None = None  # None: not tried yet; then whether the shared arena is registered


def _register_shared_arena(ort: ModuleType) -> bool:
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


def make_session(path: str | Path, config: SessionConfig | None = None) -> ort.InferenceSession:
    """ORT's own session of ``path`` on the CPU execution provider (the runtime's stages get it wrapped as an
    :class:`OrtSession` by :meth:`OnnxRuntime.open`; the export side uses it as it is); a missing or unreadable
    graph is a :class:`ModelDirError`."""
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


def shrink_after_run() -> ort.RunOptions:
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


class OrtSession(GraphSession):
    """ONNX Runtime's ``InferenceSession`` as a :class:`~cosyvoice_cpu.backends.base.GraphSession` (``ort``);
    ``name``: the graph's file name (for logs and probes, as OpenVINO's sessions have it)."""

    def __init__(self, inner: ort.InferenceSession, name: str = "onnx graph") -> None:
        self.ort, self.name = inner, name

    def get_inputs(self) -> list[NodeInfo]:
        return list(self.ort.get_inputs())

    def get_outputs(self) -> list[NodeInfo]:
        return list(self.ort.get_outputs())

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        """ORT's ``run``; ``release_memory`` adds the arena-shrink run option (:func:`shrink_after_run`)."""
        return list(self.ort.run(output_names, dict(feeds), shrink_after_run() if release_memory else None))

    def metadata(self) -> dict[str, str]:
        return dict(self.ort.get_modelmeta().custom_metadata_map)

    def bind_in_place(self, pairs: Mapping[str, tuple[str, np.ndarray]]) -> BoundRun:
        """IO binding: each buffer is bound by its address as both the input and its paired output, so the graph
        (GroupQueryAttention writing the new positions into its ``present`` cache) updates it without a copy."""
        return OrtBoundRun(self.ort, pairs, self.name)


class OrtBoundRun:
    """A :class:`~cosyvoice_cpu.backends.base.BoundRun` on one ORT IO binding, reused call after call: a call
    rebinds only ``feeds`` and ``outputs`` (the caller keeps the bound buffers alive; this keeps views of them)."""

    def __init__(
        self, session: ort.InferenceSession, pairs: Mapping[str, tuple[str, np.ndarray]], name: str = "onnx graph"
    ) -> None:
        self.session, self.name = session, name
        self.io = session.io_binding()
        self.buffers = []
        for input_name, (output, buf) in pairs.items():
            if buf.dtype != np.float32 or not buf.flags.c_contiguous:
                raise ConfigError(
                    f"{self.name}: {input_name}: an in-place buffer must be C-contiguous float32, got {buf.dtype}"
                )
            self.io.bind_input(input_name, "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
            self.io.bind_output(output, "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
            self.buffers.append(buf)

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        for name, value in feeds.items():  # the caller's arrays stay referenced until the run is over
            self.io.bind_cpu_input(name, value)
        for name, out in outputs.items():
            self.io.bind_output(name, "cpu", 0, out.dtype, out.shape, out.ctypes.data)
        self.session.run_with_iobinding(self.io)


class OnnxRuntime(Backend):
    """:class:`~cosyvoice_cpu.backends.base.Backend` on ONNX Runtime's CPU execution provider."""

    name = ONNXRUNTIME

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("onnxruntime") is not None

    def open(self, path: Path, config: SessionConfig) -> GraphSession:
        """The graph as an :class:`OrtSession`; where ``config.row_groups`` splits
        (:func:`~cosyvoice_cpu.hardware.pools.splits_rows`: as many groups as threads), a
        :class:`~cosyvoice_cpu.backends.row_groups.RowGroupSession` over a one-thread session."""
        groups = config.row_groups
        if not splits_rows(config.threads, groups):
            return OrtSession(make_session(path, config), path.name)
        split = OrtSession(make_session(path, replace(config, threads=1, row_groups=0)), path.name)
        return RowGroupSession(
            split, groups, lambda: OrtSession(make_session(path, replace(config, row_groups=0)), path.name)
        )

    def version(self) -> str | None:
        if not self.available():
            return None
        import onnxruntime as ort

        return str(ort.__version__)

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
