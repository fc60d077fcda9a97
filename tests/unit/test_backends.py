"""The backend seam: graphs open through the registry by the config's backend name; contracts hold any session."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import cosyvoice_cpu
from cosyvoice_cpu.backends.base import BACKEND_NAMES, Backend, GraphSession, SessionConfig, check_io
from cosyvoice_cpu.backends.buckets import BucketedSession, bucket
from cosyvoice_cpu.backends.registry import BACKENDS, backend_for, open_graph
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.flow.graphs import ESTIMATOR_PADDING

GRAPH = Path(cosyvoice_cpu.__file__).parent / "demo_model" / "campplus.onnx"


def test_graphs_open_through_the_configured_backend() -> None:
    assert set(BACKENDS) == {"onnxruntime", "openvino"} and all(isinstance(b, Backend) for b in BACKENDS.values())
    assert tuple(BACKENDS) == BACKEND_NAMES  # one Backend per name, in the order the names are defined
    assert backend_for("onnxruntime").available()
    sess = open_graph(GRAPH, SessionConfig(threads=1))
    feats = np.zeros((1, 50, 80), np.float32)
    (emb,) = sess.run(None, {sess.get_inputs()[0].name: feats})
    assert emb.shape == (1, 192)
    (again,) = sess.run(None, {sess.get_inputs()[0].name: feats}, release_memory=True)  # ORT's arena shrink
    assert np.array_equal(again, emb)
    assert sess.name == "campplus.onnx"  # the graph's file name, for logs and probes (OpenVINO's sessions too)
    with pytest.raises(ConfigError, match=r"^campplus.onnx: input: an in-place buffer must be C-contiguous float32"):
        sess.bind_in_place({"input": ("output", np.zeros((1, 50, 80), np.float64))})


def test_an_unknown_backend_or_a_missing_graph_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown inference backend 'tensorrt' \(known: onnxruntime, openvino\)"):
        open_graph(GRAPH, SessionConfig(backend="tensorrt"))
    with pytest.raises(ModelDirError, match="missing; re-export"):
        open_graph(tmp_path / "nope.onnx")


@dataclass
class _Node:
    name: str
    type: str
    shape: list


class _Session:
    """A session of another backend: only get_inputs/get_outputs/run, as the GraphSession protocol says."""

    def get_inputs(self) -> list[_Node]:
        return [_Node("x", "tensor(float)", ["batch", 80])]

    def get_outputs(self) -> list[_Node]:
        return [_Node("y", "tensor(float)", ["batch", 192])]


def test_the_contract_check_holds_any_backend_session() -> None:
    check_io(_Session(), "g.xml", {"x": ("tensor(float)", [1, 80])}, {"y": ("tensor(float)", 2)})
    with pytest.raises(ModelDirError, match=r"input x is tensor\(float\) \['batch', 80\], expected tensor\(float\) "):
        check_io(_Session(), "g.xml", {"x": ("tensor(float)", [1, 81])}, {"y": ("tensor(float)", 2)})


@pytest.fixture(scope="module")
def fp32_estimator(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CosyVoice2 exported with the fp32 recipe: its flow estimator (what OpenVINO gains on)."""
    pytest.importorskip("torch")
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("export") / "tiny-fp32"
    export_model(tiny_model_dir, out, ExportOptions(recipe="fp32", max_len=256, verify=False))
    return out / "flow_estimator.onnx"


def test_openvino_implements_the_same_interface(tmp_path: Path, fp32_estimator: Path) -> None:
    """The second backend behind the seam: the tiny flow estimator through OpenVINO (f32) equals ONNX Runtime's,
    a padded call (mask 0 past the end) equals the unpadded one, and compiled shapes stay bounded."""
    pytest.importorskip("openvino")
    from cosyvoice_cpu.backends.openvino import OpenVino

    backend = OpenVino(cache_dir=tmp_path / "ov-cache", max_shapes=2, precision="f32")
    ov_sess = backend.open(fp32_estimator, SessionConfig(threads=1))
    ort_sess = open_graph(fp32_estimator, SessionConfig(threads=1))
    assert [(n.name, n.type) for n in ov_sess.get_inputs()] == [(n.name, n.type) for n in ort_sess.get_inputs()]
    rng = np.random.default_rng(0)

    def feeds(frames: int, valid: int) -> dict[str, np.ndarray]:
        mask = np.zeros((2, 1, frames), np.float32)
        mask[:, :, :valid] = 1
        f = {k: rng.standard_normal((2, 80, frames)).astype(np.float32) * mask for k in ("x", "mu", "cond")}
        return {**f, "mask": mask, "t": np.full(2, 0.4, np.float32), "spks": np.ones((2, 80), np.float32)}

    plain = feeds(40, 40)
    want = ort_sess.run(None, plain)[0]
    got = ov_sess.run(None, plain)[0]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    padded = {k: (np.pad(v, ((0, 0), (0, 0), (0, 24))) if v.ndim == 3 else v) for k, v in plain.items()}
    assert np.abs(ov_sess.run(None, padded)[0][:, :, :40] - got).max() <= 1e-5 * np.abs(got).max()
    ov_sess.run(None, feeds(32, 32))
    assert len(ov_sess.shapes) == 2 and ov_sess.compiles == 3  # the least recently used shape was dropped
    assert any((tmp_path / "ov-cache").iterdir())  # compiled shapes are cached on disk for the next process
    # padding is the session's: OpenVINO pads to a bucket and cuts back, ONNX Runtime runs the shape as it comes
    padding = SessionConfig(threads=1, padding=ESTIMATOR_PADDING)
    bucketed = backend.open(fp32_estimator, padding)
    assert isinstance(bucketed, BucketedSession)
    assert np.abs(bucketed.run(None, plain)[0] - got).max() <= 1e-5 * np.abs(got).max()
    assert bucketed.calls == 1 and bucketed.padded == bucket(40) - 40
    assert not isinstance(open_graph(fp32_estimator, padding), BucketedSession)


def test_one_dynamic_compile_is_renewed_after_too_many_shapes(tmp_path: Path, fp32_estimator: Path) -> None:
    """OpenVINO keeps kernels per input shape even on a dynamic compile, so a graph fed ever new shapes (an
    unpadded estimator, one shape per sentence length) would grow for as long as the process lives: after
    ``dynamic_shapes`` distinct shapes the session compiles anew (giving them back), and shapes it has met do not."""
    pytest.importorskip("openvino")
    from cosyvoice_cpu.backends.openvino import DYNAMIC_SHAPES, OpenVino, OpenVinoSession

    assert DYNAMIC_SHAPES > len({bucket(n) for n in range(50, 2049)})  # the padded estimator never recompiles
    opened = OpenVino(cache_dir=tmp_path / "ov-cache", precision="f32").open(fp32_estimator, SessionConfig(threads=1))
    ov_sess = OpenVinoSession(opened._core, opened._model, opened._properties, 0, "estimator", dynamic_shapes=3)

    def run(frames: int) -> np.ndarray:
        rng = np.random.default_rng(frames)
        f = {k: rng.standard_normal((2, 80, frames)).astype(np.float32) for k in ("x", "mu", "cond")}
        f.update(mask=np.ones((2, 1, frames), np.float32), t=np.full(2, 0.4, np.float32),
                 spks=np.ones((2, 80), np.float32))  # fmt: skip
        return ov_sess.run(None, f)[0]

    # (OpenVINO 2026.4's dynamic f32 compile of this fused-op ONNX graph answers its very first call wrongly; the
    # plain-attention IRs the export writes do not, in f32 or bf16. So the first call of a compile is not compared.)
    run(40)
    first = run(40)
    for frames in (32, 48, 40, 32):  # three distinct shapes: one compile
        run(frames)
    assert ov_sess.compiles == 1 and ov_sess.shapes == [()]
    run(56)  # a fourth: compiled anew, and the new compile computes the same
    assert ov_sess.compiles == 2
    assert np.abs(run(40) - first).max() <= 1e-5 * np.abs(first).max()
    assert ov_sess.compiles == 2  # 56 and 40 on the new compile: under the bound
    with pytest.raises(ConfigError, match="dynamic_shapes must be >= 1"):
        OpenVinoSession(opened._core, opened._model, opened._properties, 0, "estimator", dynamic_shapes=0)


class _Compiled:
    """A compiled model that counts ``release_memory`` calls; with ``hold``, the next request made stays inside
    its call (``entered`` set) until ``go`` is set."""

    def __init__(self, compiled: object) -> None:
        self.compiled, self.releases, self.hold = compiled, 0, False
        self.entered, self.go = threading.Event(), threading.Event()

    def create_infer_request(self) -> object:
        request, held, owner = self.compiled.create_infer_request(), self.hold, self
        self.hold = False

        class Request:
            def infer(self, feeds: dict) -> None:
                request.infer(feeds)
                if held:
                    owner.entered.set()
                    owner.go.wait(10)

            def get_tensor(self, name: str) -> object:
                return request.get_tensor(name)

        return Request()

    def release_memory(self) -> None:
        self.releases += 1


def test_openvino_gives_a_call_s_working_memory_back_once_no_call_runs(tmp_path: Path, fp32_estimator: Path) -> None:
    """A compiled model keeps the intermediate buffers of its largest call: ``release_memory`` gives them back
    (``CompiledModel.release_memory``), never while another call of the session is running, and the outputs are
    those of a plain call. The seam says which backends keep that memory (the flow asks it)."""
    pytest.importorskip("openvino")
    from cosyvoice_cpu.backends.openvino import OpenVino

    sess = OpenVino(cache_dir=tmp_path / "ov-cache", precision="f32").open(fp32_estimator, SessionConfig(threads=1))
    assert sess.keeps_working_memory and not open_graph(fp32_estimator, SessionConfig(threads=1)).keeps_working_memory
    rng = np.random.default_rng(0)
    f = {k: rng.standard_normal((2, 80, 40)).astype(np.float32) for k in ("x", "mu", "cond")}
    f.update(mask=np.ones((2, 1, 40), np.float32), t=np.full(2, 0.4, np.float32), spks=np.ones((2, 80), np.float32))
    sess.run(None, f)  # (the first call of a dynamic compile of this fused-op graph is not compared: above)
    want = sess.run(None, f)[0]
    fake = sess._compiled[()] = _Compiled(sess._compiled[()])
    fake.hold = True
    slow = threading.Thread(target=sess.run, args=(None, f))
    slow.start()
    assert fake.entered.wait(10)  # a call in flight
    got = sess.run(None, f, release_memory=True)[0]
    assert fake.releases == 0  # not while the other call runs
    fake.go.set()
    slow.join(10)
    assert np.array_equal(got, want)
    np.testing.assert_array_equal(sess.run(None, f, release_memory=True)[0], want)
    assert fake.releases == 1
    sess.run(None, f)
    assert fake.releases == 1
    bucketed = OpenVino(cache_dir=tmp_path / "ov-cache", precision="f32").open(
        fp32_estimator, SessionConfig(threads=1, padding=ESTIMATOR_PADDING)
    )
    assert bucketed.keeps_working_memory


def test_the_lm_cache_runs_in_place_through_the_session() -> None:
    """The LM reaches its KV cache only through ``GraphSession.bind_in_place``: ONNX Runtime's IO binding (no copy)
    and the generic copying form give the same bits for prefills and mixed-row decodes; OpenVINO, whose
    GroupQueryAttention returns the cache cut to the positions in use, refuses with a message."""
    import json

    from cosyvoice_cpu.backends.base import CopyingRun
    from cosyvoice_cpu.backends.onnxruntime import OrtBoundRun
    from cosyvoice_cpu.lm.session import LMSession

    model = GRAPH.parent
    attrs = json.loads((model / "cosyvoice_cpu.json").read_text())["graphs"]["lm"]["attrs"]

    def run(lm: LMSession) -> tuple[list[np.ndarray], list[np.ndarray]]:
        rng = np.random.default_rng(0)
        cache = lm.new_cache(3)
        out = [lm.prefill(cache, r, rng.standard_normal((5 + 3 * r, 64)).astype(np.float32)) for r in range(3)]
        out += [lm.decode(cache, [0, 2], [t, t + 7]) for t in range(4)]
        return out, cache.keys + cache.values

    bound = LMSession.from_dir(model, attrs, threads=SessionConfig(threads=1))
    copying = LMSession.from_dir(model, attrs, threads=SessionConfig(threads=1))
    copying.session.bind_in_place = lambda pairs: CopyingRun(copying.session, pairs)  # type: ignore[method-assign]
    (want, want_kv), (got, got_kv) = run(bound), run(copying)
    assert all(np.array_equal(a, b) for a, b in zip(want, got)) and len(want) == 7
    assert all(np.array_equal(a, b) for a, b in zip(want_kv, got_kv)) and np.abs(want_kv[0]).max() > 0
    cache = bound.new_cache(2)
    assert isinstance(bound.runner._binding(cache, 0, 2), OrtBoundRun)

    class Cut(_Session, GraphSession):  # a graph whose cache output is not the buffer's shape
        def run(self, names, feeds, release_memory=False):  # type: ignore[no-untyped-def]
            return [np.zeros((1, 2, 5, 16), np.float32)]

    with pytest.raises(ConfigError, match=r"present_key_0 came back with shape \(1, 2, 5, 16\), not its buffer's"):
        Cut().bind_in_place({"past_key_0": ("present_key_0", np.zeros((1, 2, 512, 16), np.float32))}).run({}, {})
    if backend_for("openvino").available():
        ov = LMSession.from_dir(model, attrs, threads=SessionConfig(threads=1, backend="openvino"))
        with pytest.raises(ConfigError, match="KV cache bound in place"):
            ov.prefill(ov.new_cache(1), 0, np.zeros((3, 64), np.float32))
