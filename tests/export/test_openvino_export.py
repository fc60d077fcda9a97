"""``export --openvino``: the OpenVINO flow estimator of every family, its gate, and the engine running it.

Needs torch (export), openvino and nncf (the ``[openvino-export]`` extra): skipped with the reason otherwise.
Numerics are checked against the fp32 ONNX flow at the bounds of ``export.openvino_graphs.TOLERANCE``; speed is
the bench's business (``cosyvoice-cpu bench --backend onnxruntime,openvino``), never a unit test's.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("openvino")
pytest.importorskip("nncf")

from cosyvoice_cpu.backends.buckets import BucketedSession, bucket
from cosyvoice_cpu.backends.plan import OV_MIN_MEMORY
from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.hardware.cpu import detect
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
from tests.repo_scripts import load_script


@pytest.fixture(scope="module")
def ov_int8_dir(tiny_ov_export_dir: Path) -> Path:
    return tiny_ov_export_dir


def _mel(engine: Engine, tokens: np.ndarray, voice: object) -> np.ndarray:
    return engine.flow.inference(tokens, voice.speech_tokens, voice.mel, voice.embedding,
                                 rng=np.random.default_rng(0))  # fmt: skip


def _wav_bytes() -> bytes:
    import io

    import soundfile as sf

    t = np.arange(3 * 16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 150 * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def _voice(engine: Engine) -> object:
    return engine.make_voice(_wav_bytes(), "Hello there.")


def test_the_manifest_lists_and_hashes_the_openvino_model_and_its_gate(ov_int8_dir: Path) -> None:
    m = Manifest.load(ov_int8_dir, check_hashes=True)  # sha256 of the .xml and .bin checked
    entry = m.graphs["flow_estimator_ov"]
    assert entry.file.file == "flow_estimator.ov.xml" and [d.file for d in entry.data] == ["flow_estimator.ov.bin"]
    assert entry.precision == "int8" and entry.attrs["backend"] == "openvino"
    assert entry.attrs["pad_exact"] is True  # the CosyVoice2 UNet masks padded frames out
    assert [i["name"] for i in entry.inputs] == ["x", "mask", "mu", "t", "spks", "cond"]
    checks = [v for v in m.verification if v["graph"] == "flow_estimator_ov"]
    assert {c["check"].split(" ")[0] for c in checks} == {"mel_l1", "estimator"} and all(c["passed"] for c in checks)
    without = Manifest.load(ov_int8_dir)
    del without.graphs["flow_estimator_ov"]
    assert m.resident_bytes() == without.resident_bytes()  # an engine runs a graph on one backend only


def test_openvino_runs_whole_sentences_close_to_onnxruntime_padded_to_buckets(ov_int8_dir: Path) -> None:
    # static shapes (one compiled shape kept): the calls land on the bucket's shape
    ov = Engine.load(ov_int8_dir, EngineConfig(threads=2, backend="openvino", lm_batch_rows=0, compiled_shapes=1))
    ort = Engine.load(ov_int8_dir, EngineConfig(threads=2, backend="onnxruntime", lm_batch_rows=0))
    assert ov.plan["flow_estimator"].backend == "openvino" and ort.flow.whole is None
    assert ov.flow.whole is not None and ov.flow.whole.pad
    ov.family.warming.join()  # the load's background compile (a 650-frame bucket) first, then this test's shapes
    voice = _voice(ort)
    tokens = np.random.default_rng(1).integers(0, 6561, 97)
    a, b = _mel(ov, tokens, voice), _mel(ort, tokens, voice)
    assert a.shape == b.shape
    # two int8 estimators (OpenVINO static, ONNX Runtime dynamic), each gated at 0.02 from fp32, after a prompt
    # (a pure sine) unlike the calibration's: measured 0.016 + 0.003 from fp32
    assert float(np.abs(a - b).mean()) < 0.04
    session = ov.flow.estimator
    assert isinstance(session, BucketedSession) and session.calls == 10
    frames = a.shape[2] + voice.mel.shape[0]
    assert session.padded == 10 * (bucket(frames) - frames)
    assert [s[0][2] for s in session.wrapped.shapes] == [bucket(frames)]  # one compiled shape
    wave = ov.synthesize_wav("Hello there, this is a test.", voice)
    assert len(wave) > 0 and np.isfinite(wave).all()
    streamed = list(ov.synthesize("Streamed as well.", voice, SynthesisConfig(stream=True)))  # stays on ORT
    assert sum(len(c.samples) for c in streamed) > 0
    ov.close()
    ort.close()


def test_auto_follows_the_cpu_and_the_memory(ov_int8_dir: Path) -> None:
    hw = detect()
    engine = Engine.load(ov_int8_dir, EngineConfig(threads=1, lm_batch_rows=0))
    roomy = hw.memory_for_us is None or hw.memory_for_us >= OV_MIN_MEMORY
    want = "openvino" if hw.cpu is not None and (hw.cpu.bf16 or hw.cpu.amx) and roomy else "onnxruntime"
    assert engine.plan["flow_estimator"].backend == want
    assert (engine.flow.whole is not None) == (want == "openvino")
    engine.close()


def test_openvino_synthesizes_with_torch_blocked(ov_int8_dir: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.wav"
    prompt.write_bytes(_wav_bytes())
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from cosyvoice_cpu.config import EngineConfig\n"
        "from cosyvoice_cpu.engine import Engine\n"
        f"e = Engine.load({str(ov_int8_dir)!r}, EngineConfig(threads=1, backend='openvino', lm_batch_rows=0))\n"
        "e.family.warming.join()  # compiled in the background at load, before any sentence\n"
        "s = e.flow.estimator\n"
        "assert s.calls == 0 and s.wrapped.compiles == 1 and s.wrapped.shapes == [()]  # one dynamic compile\n"
        f"v = e.make_voice({str(prompt)!r}, 'Hello there.')\n"
        "w = e.synthesize_wav('Hello.', v)\n"
        "assert s.calls > 0 and len(w) > 0 and s.wrapped.compiles == 1\n"
        "assert 'torch' not in {m.split('.')[0] for m, mod in sys.modules.items() if mod is not None}\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


@pytest.mark.parametrize("family", ["cosyvoice3", "cosyvoice"])
def test_the_other_families_export_a_gated_bf16_model(family: str, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:  # fmt: skip
    src = request.getfixturevalue("tiny_v3_model_dir" if family == "cosyvoice3" else "tiny_v1_model_dir")
    out = tmp_path / "ov"
    # Fun-CosyVoice3's Qwen2 LM would be written too (int8 by default): --openvino-lm none writes none;
    # CosyVoice-300M's LM is another network, of which --openvino writes none
    lm = "none" if family == "cosyvoice3" else "int8"
    export_model(src, out, ExportOptions(max_len=1024, openvino="bf16", openvino_lm=lm))
    m = Manifest.load(out, check_hashes=True)
    assert "lm_ov" not in m.graphs and not (out / "lm.ov.xml").exists()
    entry = m.graphs["flow_estimator_ov"]
    assert entry.precision == "bf16"
    # Fun-CosyVoice3's DiT takes its time table in t's place: the AdaLN weights stay out of the OpenVINO model
    time_input = "modulation" if family == "cosyvoice3" else "t"
    assert [i["name"] for i in entry.inputs] == ["x", "mask", "mu", time_input, "spks", "cond"]
    # the DiT masks padded frames out; the CosyVoice-300M UNet's OpenVINO form takes its GroupNorm statistics
    # over the real frames (the official graph pools over padded ones), so both pad to buckets
    assert entry.attrs["pad_exact"] is True
    gated = [v for v in m.verification if v["graph"] == "flow_estimator_ov"]
    assert gated and all(v["passed"] for v in gated) and all("padded to buckets" in v["phase"] for v in gated)
    engine = Engine.load(out, EngineConfig(threads=2, backend="openvino", lm_batch_rows=0))
    assert engine.flow.whole is not None and engine.flow.whole.pad is True
    voice = next(iter(engine.builtin_voices().values()), None) or _voice(engine)
    # seeded, and min_tokens masks every stop id for 10 tokens: Fun-CosyVoice3 keeps only id S out below its min
    # length, so the random tiny LM drew one of its 200 stop ids first in ~3 % of unseeded runs (no speech)
    config = SynthesisConfig(seed=0, min_tokens=10)
    assert len(engine.synthesize_wav("Hello there.", voice, config)) > 0
    assert time_input in {i.name for i in engine.flow.estimator.get_inputs()}
    engine.close()


def test_fun_cosyvoice3s_int8_dit_calibrates_on_its_time_table_and_a_t_form_still_runs(
    tiny_v3_model_dir: Path, tmp_path: Path
) -> None:
    # int8: NNCF calibrates on what the runtime feeds the time-table form (export.openvino_graphs.plain_stage); the
    # OpenVINO DiT of an export before it took the time table has the official contract, and the stage asks the
    # graph which input it takes, so both forms give the same mel
    import openvino as ov

    from cosyvoice_cpu.export.flow.cosyvoice3 import EstimatorGraphV3
    from cosyvoice_cpu.export.openvino_graphs import export_plain_estimator
    from cosyvoice_cpu.flow.cosyvoice3 import CosyVoice3Flow
    from cosyvoice_cpu.flow.graphs import ShapedGraph
    from cosyvoice_cpu.workshop.parts import load_reference

    out = tmp_path / "ov"
    export_model(tiny_v3_model_dir, out, ExportOptions(max_len=1024, openvino="int8", openvino_lm="none"))
    entry = Manifest.load(out).graphs["flow_estimator_ov"]
    assert entry.precision == "int8" and [i["name"] for i in entry.inputs][3] == "modulation"
    est = load_reference(tiny_v3_model_dir, ("flow",)).flow.decoder.estimator.eval()
    export_plain_estimator(EstimatorGraphV3(est), tmp_path / "t_form.onnx")
    ov.save_model(ov.convert_model(str(tmp_path / "t_form.onnx")), str(out / "t_form.ov.xml"))
    attrs = Manifest.load(out).graphs["flow_estimator_stream"].attrs
    rng = np.random.default_rng(3)
    args = dict(tokens=rng.integers(0, 6561, 40), prompt_tokens=rng.integers(0, 6561, 20),
                prompt_feat=rng.standard_normal((40, 80)).astype(np.float32),
                embedding=rng.standard_normal(192).astype(np.float32))  # fmt: skip
    mels = {}
    for name, time_input in (("flow_estimator.ov.xml", "modulation"), ("t_form.ov.xml", "t")):
        stage = CosyVoice3Flow.from_dir(out, attrs, threads=2, streaming=False, whole=ShapedGraph(out / name))
        assert time_input in {i.name for i in stage.estimator.get_inputs()}
        mels[time_input] = stage.inference(**args)
    ref = CosyVoice3Flow.from_dir(out, attrs, threads=2).inference(**args)  # ORT: the stream graph, fp32
    for mel in mels.values():
        assert mel.shape == ref.shape and float(np.abs(mel - ref).mean()) < 0.02  # the gate's bound


def test_the_v1_openvino_graph_pads_exactly_where_the_official_one_does_not(tiny_v1_model_dir: Path) -> None:
    import torch

    from cosyvoice_cpu.export.flow.common import estimator_inputs
    from cosyvoice_cpu.export.flow.cosyvoice import EstimatorGraphV1, padded_estimator_graph
    from cosyvoice_cpu.workshop.parts import load_reference

    est = load_reference(tiny_v1_model_dir, ("flow",)).flow.decoder.estimator.eval()
    official, masked = EstimatorGraphV1(est), padded_estimator_graph(est)
    feeds = {k: torch.from_numpy(v) for k, v in estimator_inputs(np.random.default_rng(0), [71, 71], 71).items()}
    padded = {k: (torch.nn.functional.pad(v, (0, 9)) if v.ndim == 3 else v) for k, v in feeds.items()}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    with torch.inference_mode():
        want = official(*feeds.values())
        assert rel(masked(*feeds.values()), want) < 1e-5  # unpadded: the official function
        assert rel(masked(*padded.values())[:, :, :71], want) < 1e-5  # padded: the same frames
        assert rel(official(*padded.values())[:, :, :71], want) > 1e-3  # the official GroupNorm sees the padding
        assert any(type(b).__name__ == "GroupNorm" for b in est.modules())  # the original is left untouched


def test_only_layers_on_a_data_path_from_the_inputs_are_kept_out_of_int8() -> None:
    # the Fun-CosyVoice3 DiT's shape: a layer reads x, a later one gets a reshape whose shape comes from x
    import openvino as ov
    import openvino.opset13 as ops

    from cosyvoice_cpu.export.openvino_graphs import input_layers

    x = ops.parameter([-1, -1, 8], np.float32, name="x")
    first = ops.matmul(x, ops.constant(np.ones((8, 8), np.float32)), False, False)
    first.set_friendly_name("first")
    flat = ops.reshape(ops.relu(first), ops.shape_of(x), special_zero=False)
    later = ops.matmul(flat, ops.constant(np.ones((8, 8), np.float32)), False, False)
    later.set_friendly_name("later")
    assert input_layers(ov.Model([later], [x])) == ["first"]


def test_the_estimator_forms_probe_counts_the_work_and_times_every_form(ov_int8_dir: Path, tmp_path: Path) -> None:
    import json

    import openvino as ov
    import openvino.opset13 as ops

    forms = load_script("bench/ov_estimator_forms.py")
    script = Path(forms.__file__)
    x = ops.parameter([2, 10, 8], np.float32, name="x")
    y = ops.matmul(x, ops.convert(ops.constant(np.ones((8, 4), np.float16)), "f32"), False, False)  # weights
    att = ops.matmul(x, ops.transpose(x, ops.constant([0, 2, 1])), False, False)  # activation x activation
    gmac = forms.macs(ov.Model([y, att], [x]))
    assert gmac == {"weights": 2 * 10 * 4 * 8 / 1e9, "attention": 2 * 10 * 10 * 8 / 1e9}
    out = tmp_path / "forms.jsonl"
    subprocess.run([sys.executable, str(script), "-m", str(ov_int8_dir), "--frames", "100", "--runs", "1",
                    "--profile", "--unfused", "--switch", "--out", str(out)],
                   check=True, capture_output=True)  # fmt: skip
    row = json.loads(out.read_text())
    size = bucket(100)
    assert set(row["ms"]) == {"ort 100", "ov dynamic 100", f"ov dynamic {size}", f"ov static {size}",
                              f"ov static {size} unfused"}  # fmt: skip
    assert row["gmac"]["weights"] > 0 and row["profile"]["static"] and row["switch_s"]["cache_load"] > 0
    # snippets off: the attention's products and softmax run as nodes of their own, in no fused Subgraph (which the
    # default compile has: so the property reached the plugin)
    fused = {k.split("/")[0] for k in row["profile"]["static"]}
    kinds = {k.split("/")[0] for k in row["profile"]["static unfused"]}
    assert "Subgraph" in fused and {"MatMul", "Softmax"} <= kinds and "Subgraph" not in kinds
    refused = subprocess.run([sys.executable, str(script), "-m", str(ov_int8_dir), "--unfused", "--out", str(out)],
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 2 and "needs --profile" in refused.stderr


def test_bad_openvino_options_fail_before_any_work(tiny_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.errors import ConfigError

    with pytest.raises(ConfigError, match="openvino must be one of none, bf16, int8"):
        export_model(tiny_model_dir, tmp_path / "x", ExportOptions(openvino="fp8"))
    assert not (tmp_path / "x").exists()


def test_doctor_prints_the_plan_with_its_reasons(ov_int8_dir: Path) -> None:
    def doctor(backend: str) -> str:
        p = subprocess.run([sys.executable, "-m", "cosyvoice_cpu", "doctor", "-m", str(ov_int8_dir), "--quick",
                            "--backend", backend], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    assert "backend      lm, flow_estimator: openvino (--backend openvino)" in doctor("openvino")  # lm: lm_ov
    out = doctor("onnxruntime")
    plan = [line for line in out.splitlines() if line.startswith("backend")]
    assert len(plan) == 1 and "flow_estimator" in plan[0] and plan[0].endswith("onnxruntime (--backend onnxruntime)")
    assert "BF16" in out and "AMX" in out


def test_bench_measures_each_backend_in_one_report(ov_int8_dir: Path, tmp_path: Path) -> None:
    import json

    from cosyvoice_cpu.cli.main import main

    out = tmp_path / "report"
    rc = main(["bench", "-m", str(ov_int8_dir), "--tokens", "30", "--short-tokens", "12", "--runs", "1",
               "--concurrency", "", "--peer", "", "--backend", "onnxruntime,openvino", "--out", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    assert list(result["backends"]) == ["onnxruntime", "openvino"] and result["ours"]["backend"] == "onnxruntime"
    assert any(line.startswith("lm, flow_estimator: openvino") for line in result["backends"]["openvino"]["plan"])
    ran = result["backends"]["openvino"]["graph_backends"]  # from the engine's plan: the LM too (lm_ov)
    assert ran["lm"] == ran["flow_estimator"] == "openvino" and ran["hift_decode"] == "onnxruntime"
    assert set(result["backends"]["onnxruntime"]["graph_backends"].values()) == {"onnxruntime"}
    assert result["backends"]["openvino"]["default"]["flow_rtf"] > 0
    md = (out / "bench.md").read_text()
    assert "### Backends" in md and "| openvino | openvino | openvino | onnxruntime |" in md
    assert "| onnxruntime | onnxruntime | onnxruntime | onnxruntime |" in md
    assert main(["bench", "-m", str(ov_int8_dir), "--backend", "onnxruntime,tensorrt", "--out", str(out)]) == 2


def test_the_memory_probes_run_on_the_backend_and_properties_asked_for(ov_int8_dir: Path, tmp_path: Path) -> None:
    import json

    bench = Path(__file__).resolve().parents[2] / "bench"
    probe = [sys.executable, str(bench / "ov_bucket_memory.py"), "-m", str(ov_int8_dir), "--max-frames", "80"]
    reports = {}
    for name, extra in (("default", []), ("no snippets", ["--release", "--property", "SNIPPETS_MODE=DISABLE"])):
        out = tmp_path / f"{name}.json"
        subprocess.run([*probe, *extra, "--out", str(out)], check=True, capture_output=True, timeout=600)
        reports[name] = json.loads(out.read_text())
    report = reports["no snippets"]
    assert report["release"] and report["properties"] == {"SNIPPETS_MODE": "DISABLE"}
    assert len(report["calls"]) == 2 * len({bucket(n) for n in range(50, 81)})
    assert all(0 < row["anon_mb"] <= row["rss_mb"] + 1 for row in report["calls"])
    # the property reached the compiled model: the fused subgraphs are gone
    assert reports["default"]["fused_subgraphs"] > 0 and report["fused_subgraphs"] == 0
    # the property reaches the CPU plugin: one it does not know stops the probe, named
    bad = subprocess.run([*probe, "--property", "NO_SUCH_PROPERTY=1", "--out", str(tmp_path / "bad.json")],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode != 0 and "NO_SUCH_PROPERTY" in bad.stderr
    steps = [sys.executable, str(bench / "memory_steps.py"), str(ov_int8_dir), "--tokens", "20", "--short-tokens", "5"]
    for backend in ("onnxruntime", "openvino"):
        p = subprocess.run([*steps, "--backend", backend], check=True, capture_output=True, text=True, timeout=600)
        assert f"flow_estimator on {backend}" in p.stdout and "whole, after streams" in p.stdout


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the fusions asserted are the x86 plugin's")
def test_the_weight_layer_probe_groups_the_layers_by_their_fused_activation(ov_int8_dir: Path, tmp_path: Path) -> None:
    import json

    import openvino as ov

    load_script("bench/ov_estimator_forms.py")  # the probe imports it by name, as its sibling
    probe = load_script("bench/ov_fc_probe.py")
    core = ov.Core()
    props = {"INFERENCE_PRECISION_HINT": "bf16", "PERF_COUNT": True}
    x = np.ones((64, 16), np.float32)
    for act, fused in (("gelu", True), ("relu", True), ("none", False)):
        model = probe.layer_model(ov, 64, 16, 32, 2, act)
        assert probe.layer_shapes(model) == {(64, 16, 32): 1, (64, 32, 16): 1}
        compiled = core.compile_model(model, "CPU", props)
        groups = probe.by_activation(compiled, model, compiled.create_infer_request(), 1, {"x": x})
        # the plugin fuses an activation right after a layer into the layer's node
        assert set(groups) == ({act.capitalize()} if fused else {"none"}), (act, groups)
        assert sum(g["nodes"] for g in groups.values()) == 2
        assert sum(g["gmac"] for g in groups.values()) == pytest.approx(2 * 64 * 16 * 32 / 1e9, abs=1e-6)
    out = tmp_path / "fc.jsonl"
    cmd = [sys.executable, str(Path(probe.__file__)), "-m", str(ov_int8_dir), "--frames", "100", "--rows-times",
           "1,2", "--runs", "1", "--depth", "2", "--activations", "none,gelu", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path, timeout=600)
    row = json.loads(out.read_text())
    shapes = {(e["m"], e["k"], e["n"]) for e in row["layers"]}
    variants = {(e["form"], e["activation"]) for e in row["layers"]}
    assert variants == {(f, a) for f in ("bf16", "int8") for a in ("none", "gelu")}
    assert len(row["layers"]) == len(shapes) * len(variants) and all(e["ms"] > 0 for e in row["layers"])
    assert row["model_layers"] and sum(g["gmac"] for g in row["model_layers"].values()) > 0
    assert set(row["predicted_ms"]) == {f"{f} {a}" for f, a in variants} and min(row["predicted_ms"].values()) > 0
    for bad in (["--activations", "swish"], ["--rows-times", "2"]):
        refused = subprocess.run(cmd + bad, capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and bad[0] in refused.stderr, bad
