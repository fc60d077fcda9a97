"""The OpenVINO backend (``[openvino]`` extra): bf16 and VNNI kernels that ONNX Runtime's CPU provider lacks.

A :class:`OpenVinoSession` compiles its model in one of two ways (``max_shapes``):

- ``0`` (the default): once, with its dynamic axes: one compiled model serves every shape. OpenVINO still makes
  kernels for each new input shape on its first call and keeps them (tens of MB per shape for the flow
  estimator; docs/backends.md, "Shapes, compiles and memory"). So that a graph fed unbounded shapes cannot grow
  without end in a long-running process, the session recompiles (from the on-disk cache: a second or a few) once
  :data:`DYNAMIC_SHAPES` different shapes have run on one compile, which gives their kernels back. The padded
  estimator's buckets stay under that bound and never recompile.
- ``N > 0``: per input shape, on first use, at most N compiled shapes kept in memory (least recently used first
  out): faster per call, but each holds its own copy of everything (docs/backends.md, "Shapes, compiles and memory").

With ``cache_dir`` set, OpenVINO's model cache keeps each compiled model on disk (one compile per machine).
Opened with ``SessionConfig.padding``, the session pads every call to a shape bucket
(:mod:`cosyvoice_cpu.backends.buckets`); ``prepare`` compiles the likely shapes ahead of use.

Memory: the mapped ``.bin`` pages are given back after a compile and its first call
(``SessionConfig.release_weight_pages``), and a compiled model's intermediate buffers, which stay at the size of
its largest call, after a call with ``release_memory``.

The inference precision follows the CPU (:mod:`cosyvoice_cpu.backends.openvino_precision`: bf16 with AMX or on
AMD's AVX-512 BF16, f32 elsewhere) unless the backend was made with one. A stateful model (the LM) computes in f32
with an f32 KV cache everywhere, its activations quantized in groups like its weights
(:mod:`cosyvoice_cpu.backends.openvino_lm`).
``openvino`` is imported when a graph is opened, never at import time.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from cosyvoice_cpu.backends.base import (
    OPENVINO,
    Backend,
    BoundRun,
    GraphSession,
    ModelState,
    NodeInfo,
    SessionConfig,
)
from cosyvoice_cpu.backends.buckets import BucketedSession
from cosyvoice_cpu.backends.openvino_lm import stateful_lm_properties
from cosyvoice_cpu.backends.openvino_precision import precision_for_cpu
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.hardware.pages import release_dir_pages, release_file_pages
from cosyvoice_cpu.paths import cache_dir

if TYPE_CHECKING:
    import openvino as ov

    from cosyvoice_cpu.hardware.cpu import CpuInfo

logger = logging.getLogger(__name__)

# distinct input shapes one dynamic compile serves before it is recompiled (more than the 21 frame buckets of
# cosyvoice_cpu.backends.buckets from 64 to 2048 frames, so the padded estimator never recompiles)
DYNAMIC_SHAPES = 24
# OpenVINO's usage-telemetry package, hidden while ``openvino`` is imported (import_openvino)
TELEMETRY_MODULE = "openvino_telemetry"
_IMPORT_LOCK = threading.Lock()
# OpenVINO element type names -> the ONNX type strings the graph contracts are written in
_TYPES = {"f32": "tensor(float)", "f16": "tensor(float16)", "i64": "tensor(int64)", "i32": "tensor(int32)",
          "bf16": "tensor(bfloat16)", "boolean": "tensor(bool)"}  # fmt: skip


@dataclass(frozen=True)
class Node:
    """An input or output as :class:`~cosyvoice_cpu.backends.base.NodeInfo` describes it."""

    name: str
    type: str
    shape: list[int | str | None]


def _nodes(ports: Iterable[ov.Output]) -> list[Node]:
    out = []
    for port in ports:
        dims = [int(d.get_length()) if d.is_static else f"d{i}" for i, d in enumerate(port.get_partial_shape())]
        out.append(Node(port.get_any_name(), _TYPES.get(port.get_element_type().get_type_name(), "tensor(?)"), dims))
    return out


def import_openvino() -> ModuleType:
    """``openvino``, imported without the usage telemetry its import sends.

    ``import openvino`` imports ``openvino.tools.ovc``, which posts a usage event through ``openvino_telemetry`` from a
    ``fork()``-ed child; a fork runs OpenBLAS's ``pthread_atfork`` handler, which can leave another thread's matrix
    product waiting forever (docs/backends.md, "Threads, forks and the compile at load"), and the event phones home
    from a gateway whose user never asked. While ``openvino`` imports, ``openvino_telemetry`` is hidden
    (``sys.modules`` entry None), so ``ovc`` takes its stub; afterwards the package is importable again (NNCF uses
    it at export time). Nothing is hidden when the process imported either package before: its own choice.
    """
    with _IMPORT_LOCK:
        loaded = sys.modules.get("openvino")
        if loaded is not None:
            return loaded
        hide = TELEMETRY_MODULE not in sys.modules
        if hide:
            sys.modules[TELEMETRY_MODULE] = None  # type: ignore[assignment]  # import raises ImportError
        try:
            import openvino
        finally:
            if hide and sys.modules.get(TELEMETRY_MODULE, False) is None:
                del sys.modules[TELEMETRY_MODULE]
        return openvino


class OpenVinoSession(GraphSession):
    """One graph on OpenVINO's CPU plugin, compiled per input shape (see the module docstring).

    Args:
        core: the ``openvino.Core``; model: the read ``openvino.Model`` (dynamic axes kept).
        properties: compile properties (threads, precision hint, latency hint).
        max_shapes: compiled shapes kept in memory; 0 compiles the dynamic model once instead.
        name: for logs and errors.
        weights: the IR's ``.bin``, whose pages are given back after each compile and its first call (None: not).
        cache: OpenVINO's model cache directory, whose mapped blobs are given back with them (None: none).
        dynamic_shapes: with ``max_shapes`` 0, the distinct input shapes one compile serves before the next new
            shape recompiles it (:data:`DYNAMIC_SHAPES`).
    """

    def __init__(
        self,
        core: ov.Core,
        model: ov.Model,
        properties: dict[str, str | int],
        max_shapes: int,
        name: str,
        weights: Path | None = None,
        dynamic_shapes: int = DYNAMIC_SHAPES,
        cache: Path | None = None,
    ) -> None:
        if dynamic_shapes < 1:
            raise ConfigError(f"dynamic_shapes must be >= 1, got {dynamic_shapes}")
        self._core, self._model, self._properties, self.name = core, model, properties, name
        self.max_shapes, self._weights, self.dynamic_shapes = max_shapes, weights, dynamic_shapes
        self._cache = cache
        self._inputs, self._outputs = _nodes(model.inputs), _nodes(model.outputs)
        self._compiled: OrderedDict[tuple, ov.CompiledModel] = OrderedDict()
        self._met: set[tuple] = set()  # input shapes run on the current dynamic compile
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()  # one compile at a time: concurrent misses of a shape compile it once
        self.compiles = 0
        self._running = 0  # calls in flight (release_memory waits for none)
        self._fresh = False  # a compile has not run yet: its first call repacks the weights

    def get_inputs(self) -> list[NodeInfo]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeInfo]:
        return list(self._outputs)

    def metadata(self) -> dict[str, str]:
        """An ONNX graph's custom metadata (OpenVINO keeps it in the model's ``framework`` runtime info; an IR
        written by the export has none)."""
        info = self._model.get_rt_info()
        framework = info["framework"] if "framework" in list(info.keys()) else {}
        return {str(k): v.astype(str) for k, v in dict(framework).items()}

    def bind_in_place(self, pairs: Mapping[str, tuple[str, np.ndarray]]) -> BoundRun:
        """Not supported: OpenVINO's GroupQueryAttention returns the KV cache cut to the positions in use. The LM
        runs on OpenVINO as a stateful graph instead (:mod:`cosyvoice_cpu.lm.state_graph`)."""
        raise ConfigError(
            f"{self.name}: OpenVINO does not run a graph with its KV cache bound in place (its GroupQueryAttention "
            "returns the cache cut to the positions in use); open the LM graph with the onnxruntime backend"
        )

    @property
    def stateful(self) -> bool:
        """Whether the model keeps state (``Assign`` sinks: the stateful LM's KV cache)."""
        return bool(self._model.get_sinks())

    def open_state(self) -> ModelState:
        """An inference request with a state of its own, on the model compiled once with its dynamic axes (the
        compile is shared by every request of this session)."""
        if not self.stateful:
            return super().open_state()
        with self._compile_lock:
            with self._lock:
                compiled = self._compiled.get(())
            if compiled is None:
                compiled = self._compile((), True)
        return OpenVinoState(compiled.create_infer_request(), self.name, self.ran)

    @property
    def shapes(self) -> list[tuple]:
        """The input shapes compiled and in memory, least recently used first."""
        with self._lock:
            return list(self._compiled)

    def compiled(self, shapes: Mapping[str, tuple[int, ...]]) -> ov.CompiledModel:
        """The model compiled for these input shapes (compiled now, or from OpenVINO's cache, on a miss; with
        ``max_shapes`` 0 the one dynamic model whatever the shapes)."""
        dynamic = self.max_shapes == 0
        shape = tuple(tuple(shapes[n.name]) for n in self._inputs)
        key = () if dynamic else shape
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None and dynamic and shape not in self._met and len(self._met) >= self.dynamic_shapes:
                # calls in flight keep the old compiled model alive until they finish
                logger.info(
                    "%s: %d input shapes ran on one dynamic compile; recompiling to free their kernels",
                    self.name,
                    len(self._met),
                )
                del self._compiled[key]
                self._met.clear()
                hit = None
            if hit is not None:
                self._compiled.move_to_end(key)
                if dynamic:
                    self._met.add(shape)
                return hit
        with self._compile_lock:
            with self._lock:
                hit = self._compiled.get(key)  # compiled by another caller while this one waited
            compiled = hit if hit is not None else self._compile(key, dynamic)
            if dynamic:
                with self._lock:
                    self._met.add(shape)
            return compiled

    def _compile(self, key: tuple, dynamic: bool) -> ov.CompiledModel:
        model = self._model
        if not dynamic:
            model = model.clone()
            model.reshape({n.name: list(shape) for n, shape in zip(self._inputs, key)})
        t0 = time.perf_counter()
        compiled = self._core.compile_model(model, "CPU", self._properties)
        logger.info("%s: compiled for %s in %.2f s", self.name, key, time.perf_counter() - t0)
        if self._weights is not None:
            release_file_pages(self._weights)
        with self._lock:
            self.compiles += 1
            self._fresh = True
            self._compiled[key] = compiled
            while len(self._compiled) > max(self.max_shapes, 1):
                self._compiled.popitem(last=False)
        return compiled

    def ran(self) -> None:
        """After a call: a compile's first call repacks the weights, so the pages of the IR's ``.bin`` and of a
        cached blob are given back then too (``release_weight_pages``; docs/backends.md, "The LM on OpenVINO")."""
        if self._fresh and self._weights is not None:
            self._fresh = False
            released = release_file_pages(self._weights) + (release_dir_pages(self._cache) if self._cache else 0)
            logger.debug("%s: %.0f MB of weight pages given back after its first call", self.name, released / 2**20)

    def prepare(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Compile these input shapes now (or load them from OpenVINO's cache), so a later call of that shape does
        not pay the compile; the compiled model joins the in-memory LRU like one made by :meth:`run`."""
        self.compiled(shapes)

    @property
    def keeps_working_memory(self) -> bool:
        return True

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        """Outputs (all, or ``output_names``) as NumPy arrays, like ONNX Runtime's ``run``. The compiled model keeps
        the intermediate buffers of its largest call (across calls and requests); ``release_memory`` gives them
        back once no other call of this session is running (``CompiledModel.release_memory``)."""
        missing = [n.name for n in self._inputs if n.name not in feeds]
        if missing:
            raise ConfigError(f"{self.name}: inputs {missing} are not fed")
        arrays = {n.name: np.asarray(feeds[n.name], order="C") for n in self._inputs}  # 0-d stays 0-d
        compiled = self.compiled({k: a.shape for k, a in arrays.items()})
        with self._lock:
            self._running += 1
        try:
            request = compiled.create_infer_request()  # one per call: concurrent callers never share one
            request.infer(arrays)
            self.ran()
            names = output_names or [n.name for n in self._outputs]
            outs = [np.array(request.get_tensor(name).data, copy=True) for name in names]
            del request  # before release_memory: a live request keeps its own buffers
        finally:
            with self._lock:  # a call starting now waits here, so none runs while the buffers go
                self._running -= 1
                if release_memory and not self._running:
                    compiled.release_memory()
        return outs


class OpenVinoState(ModelState):
    """:class:`~cosyvoice_cpu.backends.base.ModelState` on one OpenVINO infer request (its variables are the state;
    a state tensor is read and written as float32 whatever precision the plugin keeps it in)."""

    def __init__(self, request: ov.InferRequest, name: str, ran: Callable[[], None]) -> None:
        self._request, self.name, self._ran = request, name, ran

    def run(self, feeds: Mapping[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
        self._request.infer({k: np.asarray(v, order="C") for k, v in feeds.items()})
        self._ran()
        return [np.array(self._request.get_tensor(name).data, copy=True) for name in output_names]

    def reset(self) -> None:
        self._request.reset_state()

    def read(self) -> dict[str, np.ndarray]:
        return {s.name: np.array(s.state.data, copy=True) for s in self._request.query_state()}

    def write(self, tensors: Mapping[str, np.ndarray]) -> None:
        states = self._request.query_state()
        if {s.name for s in states} != set(tensors):
            raise ConfigError(f"{self.name}: a state write needs exactly its {len(states)} tensors by name")
        for s in states:
            s.state = import_openvino().Tensor(np.ascontiguousarray(tensors[s.name]))


class OpenVino(Backend):
    """:class:`~cosyvoice_cpu.backends.base.Backend` on OpenVINO's CPU plugin (IR ``.xml`` or ``.onnx`` files).

    Args:
        cache_dir: OpenVINO's compiled-model cache (None: ``$COSYVOICE_CPU_CACHE/openvino`` or
            ``~/.cache/cosyvoice-cpu/openvino``; "" turns it off).
        max_shapes: compiled shapes kept per session (None: ``SessionConfig.max_shapes``).
        precision: ``bf16``, ``f32`` or None (by the CPU: :meth:`compute_precision`).
    """

    name = OPENVINO

    def __init__(
        self, cache_dir: str | Path | None = None, max_shapes: int | None = None, precision: str | None = None
    ) -> None:
        self.cache_dir, self.max_shapes, self.precision = cache_dir, max_shapes, precision
        self._core: ov.Core | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("openvino") is not None

    def version(self) -> str | None:
        if not self.available():
            return None
        return str(import_openvino().get_version())

    def core(self) -> ov.Core:
        """The process's ``openvino.Core`` (made once, with the model cache configured)."""
        with self._lock:
            if self._core is None:
                if not self.available():
                    raise ConfigError(
                        "the OpenVINO backend needs the openvino package: pip install "
                        "'cosyvoice-cpu[openvino]' (or choose --backend onnxruntime)"
                    )
                core = import_openvino().Core()
                cache = self._cache_dir()
                if cache:
                    Path(cache).mkdir(parents=True, exist_ok=True)
                    core.set_property({"CACHE_DIR": str(cache)})
                self._core = core
            return self._core

    def compute_precision(self, cpu: CpuInfo | None = None) -> str:
        """The precision a model that is not stateful compiles at: the backend's own, else ``cpu``'s
        (:func:`~cosyvoice_cpu.backends.openvino_precision.precision_for_cpu`; None: this machine's)."""
        return self.precision or precision_for_cpu(cpu)

    def _cache_dir(self) -> str:
        return str(cache_dir() / "openvino") if self.cache_dir is None else str(self.cache_dir)

    def open(self, path: Path, config: SessionConfig) -> GraphSession:
        if not path.is_file():
            raise ModelDirError(f"graph {path} is missing; re-export the model directory")
        core = self.core()
        try:
            model = core.read_model(str(path))
        except Exception as e:  # OpenVINO raises RuntimeError subclasses with multi-line messages
            raise ModelDirError(f"OpenVINO cannot read {path}: {str(e).splitlines()[0]}; re-export the model") from e
        properties: dict[str, str | int] = {
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": self.compute_precision(),
        }
        if config.threads:
            properties["INFERENCE_NUM_THREADS"] = int(config.threads)
        if model.get_sinks():  # a stateful LM: f32 compute and KV cache, int8 activations grouped like its weights
            properties.update(stateful_lm_properties(model))
        weights = path.with_suffix(".bin") if config.release_weight_pages and path.suffix == ".xml" else None
        max_shapes = config.max_shapes if self.max_shapes is None else self.max_shapes
        cache = Path(self._cache_dir()) if self._cache_dir() else None
        session = OpenVinoSession(core, model, properties, max_shapes, path.name, weights, cache=cache)
        return session if config.padding is None else BucketedSession(session, config.padding)
