"""``cosyvoice-cpu bench`` on the tiny export: forced lengths, the child tasks, the report files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.cli.main import main
from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.errors import ConfigError
from tests.repo_scripts import load_script


def test_forced_token_count_gives_exact_lengths(tiny_export_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.benchmark.tasks import TEXT, load

    engine, voice = load(tiny_export_dir, threads=1)
    for n in (7, 37):
        wave = engine.synthesize_wav(TEXT, voice, SynthesisConfig(seed=1, min_tokens=n, max_tokens=n, normalize=False))
        assert len(wave) == n * 2 * 480
    with pytest.raises(ConfigError, match="min_tokens"):
        SynthesisConfig(min_tokens=9, max_tokens=8).validate()
    with pytest.raises(ConfigError, match="token budget"):
        engine.lm.request([1, 2, 3], budget=(5, 0))
    stops = set(engine.lm.facts.stop_ids)
    for seed in range(8):  # a forced minimum keeps every stop id out, not only EOS
        req = engine.lm.request([1, 2, 3], seed=seed, budget=(60, 60))
        tokens = list(req)
        assert len(tokens) == 60 and not stops & set(tokens) and req.stop_reason == "max_len"
    streamed = [c.samples for c in engine.synthesize(TEXT, voice, SynthesisConfig(
        seed=1, min_tokens=37, max_tokens=37, normalize=False, stream=True))]  # fmt: skip
    assert len(streamed) > 1 and len(np.concatenate(streamed)) == 37 * 960


def test_bench_command_writes_the_report(tiny_export_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    rc = main(["bench", "-m", str(tiny_export_dir), "--tokens", "30", "--short-tokens", "12", "--runs", "1",
               "--concurrency", "1,2", "--thread-sweep", "--peer", "", "--out", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    ours = result["ours"]
    assert result["split_rows"] is True and ours["split_rows"] is True  # the default, and the report is silent
    assert "--no-split-rows" not in (out / "bench.md").read_text()
    assert ours["default"]["audio_s"] == pytest.approx(30 / 25) and ours["default"]["rtf"] > 0
    assert ours["lm_decode_tok_s"] > 0 and ours["first_audio_short"]["first_audio_s"] > 0
    assert 0 < ours["fast"]["fast_mel_l1"] < ours["fast"]["mel_abs_mean"]
    assert [r["streams"] for r in ours["lm_batched"]] == [1, 4] and all(r["aggregate_tok_s"] > 0
                                                                        for r in ours["lm_batched"])  # fmt: skip
    assert [r["streams"] for r in result["concurrency"]] == [1, 2]
    assert all(r["sentences"] == r["streams"] for r in result["concurrency"])
    assert [r["threads"] for r in result["thread_sweep"]] == list(range(1, len(result["thread_sweep"]) + 1))
    md = (out / "bench.md").read_text()
    assert "### Targets (issue 5)" in md and "| end-to-end RTF, default quality |" in md
    assert "| LM decode, aggregate over 4 streams (batch API" in md
    assert "Energy counters:" in md
    assert 1 < ours["lm_prefix_positions"] < ours["lm_prefill_positions"]  # sos + the voice's transcript
    assert f"the first {ours['lm_prefix_positions']} (sos and the voice's transcript) copied from the LM" in md
    calibration = result["machine"]["calibration"]  # the machine's kernel speeds travel with the result
    assert calibration["threads"] >= 1 and calibration["sgemm_gflops"] > 0 and calibration["attention_ms"] > 0
    assert "Calibration (cosyvoice_cpu.probes.calibrate): copy " in md
    from cosyvoice_cpu.benchmark.report import markdown

    assert "lm" in ours["graph_backends"] and set(ours["graph_backends"].values()) == {"onnxruntime"}  # no OV here
    assert "| ours (every graph on onnxruntime) | ours vs official |" in md
    # the backend axis: which backend ran each graph, from each run's plan (an OpenVINO run's plan put in by hand)
    ov = {**ours, "plan": ["lm, flow_estimator: openvino (--backend openvino)"]}
    ov["graph_backends"] = {**ours["graph_backends"], "lm": "openvino", "flow_estimator": "openvino"}
    two = markdown({**result, "backends": {"onnxruntime": ours, "openvino": ov}}, [])
    assert "| onnxruntime | onnxruntime | onnxruntime | onnxruntime |" in two
    assert "| openvino | openvino | openvino | onnxruntime |" in two
    assert "- openvino: lm, flow_estimator: openvino (--backend openvino)" in two
    assert "| ours (LM on openvino, flow estimator on openvino, the rest on onnxruntime) |" in markdown(
        {**result, "ours": ov}, []
    )
    streamed = ours["first_audio_long"]  # what a listener of the streamed sentence heard
    assert streamed["stalls"] >= 0 and streamed["stall_s"] >= 0
    assert (streamed["stall_s"] > 0) == (streamed["stalls"] > 0)
    assert f"{streamed['stalls']:g} stalls, {streamed['stall_s']:.1f} s in all" in md
    cores = result["machine"]["usable_cores"]  # how much of the machine the streamed sentence kept busy
    assert 0 < streamed["cores_busy"] and f"; {streamed['cores_busy']:.2f} of {cores} usable cores busy" in md
    del result["machine"]["calibration"]  # a result written before the calibration existed still renders
    del result["ours"]["lm_prefix_positions"]  # ... or before the LM prefix cache
    del result["ours"]["graph_backends"]  # ... or before the plan was recorded
    for task in ("first_audio_long", "first_audio_short"):  # ... or before the stalls and busy cores were counted
        result["ours"][task] = {k: result["ours"][task][k] for k in ("first_audio_s", "stream_rtf")}
    old = markdown(result, [])
    assert " stalls, " not in old and "whole streamed RTF" in old and "usable cores busy" not in old
    assert "Calibration (" not in old and "LM prefill:" not in old and "### Targets (issue 5)" in old
    assert "| ours (--backend auto) |" in old
    for png in ("stage_split.png", "memory_vs_streams.png", "rtf_vs_threads.png"):
        assert (out / png).stat().st_size > 1000
    assert "### Official PyTorch vs ours" in capsys.readouterr().out


def test_bench_runs_the_pytorch_peer_in_the_same_report(tiny_export_dir: Path, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:  # fmt: skip
    pytest.importorskip("torch")
    out = tmp_path / "report"
    rc = main(["bench", "-m", str(tiny_export_dir), "--peer-from", str(tiny_model_dir), "--peer", "reference",
               "--tokens", "20", "--short-tokens", "10", "--runs", "1", "--concurrency", "",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    peer = result["peers"]["reference"]
    assert "skipped" not in peer and peer["tokens"] == 20 and peer["rtf"] > 0
    assert not (out / "bench.partial.json").exists()
    md = (out / "bench.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| end-to-end RTF (LM"))
    assert row.count("–") == 2  # official skipped; reference and ours measured, no ratio without the official


def test_a_cached_export_from_other_exporter_code_or_recipe_is_stale(tiny_export_dir: Path, tmp_path: Path) -> None:
    import shutil

    from cosyvoice_cpu.cli.bench import cached_export_is_fresh
    from cosyvoice_cpu.export.quantize import DEFAULT_RECIPE

    assert cached_export_is_fresh(tiny_export_dir, DEFAULT_RECIPE)
    assert not cached_export_is_fresh(tiny_export_dir, "fp32")
    assert not cached_export_is_fresh(tmp_path / "missing", DEFAULT_RECIPE)
    old = shutil.copytree(tiny_export_dir, tmp_path / "old")
    manifest = old / "cosyvoice_cpu.json"
    data = json.loads(manifest.read_text())
    assert "(export code " in data["created_by"]
    data["created_by"] = "cosyvoice-cpu 0.1.0 (export code 000000000000)"
    manifest.write_text(json.dumps(data))
    assert not cached_export_is_fresh(old, DEFAULT_RECIPE)


FORKING_CHILD = """
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers
tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.encode_batch(["a b"] * 20000)  # the thread pool runs (when parallelism is on)
pid = os.fork()  # as the export's and the peers' libraries do
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM")}))
"""


def test_bench_children_do_not_print_the_tokenizers_fork_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench printed "The current process just got forked, after parallelism has already been used..." dozens
    of times (issue #35): its children run with TOKENIZERS_PARALLELISM=false unless the user set it."""
    import subprocess
    import sys

    from cosyvoice_cpu.cli import bench

    pytest.importorskip("tokenizers")
    runs: list[subprocess.CompletedProcess] = []
    real_run = subprocess.run

    def run(*args: object, **kw: object) -> subprocess.CompletedProcess:
        runs.append(real_run(*args, **kw))
        return runs[-1]

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(bench.subprocess, "run", run)
    assert bench._child([sys.executable, "-c", FORKING_CHILD], "forking child") == {"TOKENIZERS_PARALLELISM": "false"}
    assert "forked" not in runs[-1].stderr, runs[-1].stderr
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # a user's own choice is kept (and silences it too)
    assert bench._child([sys.executable, "-c", FORKING_CHILD], "forking child") == {"TOKENIZERS_PARALLELISM": "true"}
    assert "forked" not in runs[-1].stderr
    assert bench.quiet_forks({}) == {"TOKENIZERS_PARALLELISM": "false"}


def test_forced_ratio_gives_a_text_stream_passage_its_length(tiny_export_dir: Path) -> None:
    from cosyvoice_cpu.benchmark.tasks import load
    from cosyvoice_cpu.lm.bistream import BistreamRequest
    from cosyvoice_cpu.lm.sampling import RngDraw

    engine, voice = load(tiny_export_dir, threads=1)
    p = engine.lm_prompt(voice, None, False)
    ids = engine.tokenizer.encode("Check valve seven now and call the supervisor.")  # 18 tokens: 90 speech tokens
    # fit the tiny export's KV cache, and outnumber the 15 per 5 text tokens decoded before the text's end
    size = engine.lm.facts.speech_token_size
    for seed in range(4):  # random weights sample other special ids; forced, none ends the passage early
        req = BistreamRequest(engine.lm, p.text_ids, p.speech, engine.facts.mix_ratio, engine.fill_token,
                              draw=RngDraw(np.random.default_rng(seed)), forced_ratio=5.0)  # fmt: skip
        for i in range(0, len(ids), 4):
            req.feed(ids[i : i + 4])
        req.end()
        tokens = list(req)
        assert len(tokens) == 5 * len(ids) and req.stop_reason == "stop" and max(tokens) < size
    engine.close()


def test_bench_text_stream_only_writes_its_section(tiny_export_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ts"
    rc = main(["bench", "-m", str(tiny_export_dir), "--text-stream", "only", "--runs", "1", "--text-rate", "200",
               "--reply", "Check valve seven now. Then call me.", "--no-split-rows", "--out", str(out)])  # fmt: skip
    assert rc == 0
    ts = json.loads((out / "bench.json").read_text())["text_stream"]
    assert ts["split_rows"] is False  # the flag reached the child's engine
    assert ts["text_stream"]["mode"] == "interleaved" and ts["by_sentence"]["passages"] == 2
    assert len(ts["sentence_tokens"]) == 2 and ts["first_audio_ratio"] > 0
    assert ts["text_stream"]["audio_s"] > 0 and ts["by_sentence"]["audio_s"] > 0
    run = ts["runs"]["by_sentence"][0]
    assert len(run["passage_at_s"]) == 2 and len(run["boundary_gap_s"]) == 1  # one boundary between 2 sentences
    md = (out / "bench.md").read_text()
    assert "### Text that is still being written (CosyVoice2-0.5B)" in md and "| how it is spoken |" in md
    assert "threads (`--no-split-rows`: estimator calls not split by guidance row)" in md


def test_first_audio_counts_what_a_listener_of_the_stream_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks on a fake clock: 0.4 s of audio at 1.0 s, 0.8 s at 1.6 s (0.2 s late), 1.6 s at 2.3 s (in time)."""
    from cosyvoice_cpu.benchmark import tasks

    now = [0.0]

    class Chunk:
        def __init__(self, seconds: float) -> None:
            self.duration, self.samples = seconds, np.zeros(int(seconds * 24000), np.float32)

    class Engine:
        def synthesize(self, text: str, voice: object, config: SynthesisConfig):
            assert config.stream
            start = now[0]  # the caller read the clock before the first chunk was asked for
            for at, seconds in ((1.0, 0.4), (1.6, 0.8), (2.3, 1.6)):
                now[0] = start + at
                yield Chunk(seconds)

    monkeypatch.setattr(tasks.time, "perf_counter", lambda: now[0])
    out = tasks.first_audio(Engine(), object(), "text", 70, runs=2)
    assert out["first_audio_s"] == pytest.approx(1.0) and out["stream_rtf"] == pytest.approx(2.3 / 2.8)
    assert out["stalls"] == 1 and out["stall_s"] == pytest.approx(0.2)


def test_the_chunk_plan_probe_streams_each_plan_and_counts_its_chunks(tiny_export_dir: Path) -> None:
    """``bench/chunk_plan_ab.py`` (how the default chunk plan and the chunk grid were checked, docs/streaming.md):
    each plan streams the forced sentence in as many chunks as its doubling gives, with and without the flow's
    grid (CosyVoice2 has none: the same chunks), at each step count on each engine, and the listener's columns are
    filled."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "chunk_plan_ab.py"
    out = subprocess.run([sys.executable, str(script), str(tiny_export_dir), "--chunk-tokens", "10,20", "--grid",
                          "both", "--first-chunk-tokens", "5", "--tokens", "40", "--steps", "2,1", "--runs", "1",
                          "--backend", "onnxruntime,auto"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    cells = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| ")]
    rows = {(r[1], r[2], r[8], r[9]): r for r in cells if r[1].isdigit()}
    assert set(rows) == {(n, grid, steps, backend) for n in ("10", "20") for grid in ("on", "off")
                         for steps in ("2", "1") for backend in ("onnxruntime", "auto")}  # fmt: skip
    for grid, steps in [("on", "2"), ("off", "2"), ("on", "1")]:  # 5+10+10+10+5 and 5+10+20+5 tokens
        assert rows["10", grid, steps, "auto"][3] == "5" and rows["20", grid, steps, "onnxruntime"][3] == "4"
    for row in rows.values():
        assert float(row[4]) > 0 and float(row[5].split()[0]) > 0 and float(row[7]) >= 0


def test_the_spinning_probe_makes_only_the_named_graphs_spin(tiny_export_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``bench/spinning_ab.py --graphs`` (how per-graph spinning was measured, docs/benchmarks-log.md): in the
    engines it loads, the named graph's ORT session spins (and in the stop engine, stops when a run returns), the
    other graphs' do not, the baseline engine's nothing; a graph name that no session opened is refused."""
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "spinning_ab", raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    spinning_ab = importlib.import_module("spinning_ab")

    def entries(session) -> tuple[str, str]:
        so = session.ort.get_session_options()

        def entry(key: str) -> str:
            try:
                return so.get_session_config_entry(key)
            except RuntimeError:  # ORT raises for a key never set
                return "unset"

        return entry("session.intra_op.allow_spinning"), entry("session.force_spinning_stop")

    engines = spinning_ab.graph_engines(tiny_export_dir, 1, {"flow_estimator_stream"})
    try:
        expected = {"spinning off": ("0", "unset"), "graphs spin": ("1", "unset"), "spin, stop": ("1", "1")}
        for label, (engine, _) in engines.items():
            assert entries(engine.flow.stream_estimator) == expected[label], label
            assert entries(engine.vocoder.decode_sess)[0] == "0", label
    finally:
        for engine, _ in engines.values():
            engine.close()
    with pytest.raises(SystemExit, match="flow_estimatr_stream"):
        spinning_ab.graph_engines(tiny_export_dir, 1, {"flow_estimatr_stream"})


def test_the_chunk_plan_probe_labels_each_row_with_the_call_that_made_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``chunk_plan_ab.py --steps 10,5 --backend onnxruntime,auto``: every engine is loaded on its backend, warmed
    once per step count, and each row's figures come from the calls of its own step count and engine (the fake
    listener encodes both in the RTF it reports)."""
    import sys
    from types import SimpleNamespace

    probe = load_script("bench/chunk_plan_ab.py")
    calls: list[tuple[str, int]] = []

    def load(model_dir: Path, threads: int, voice_seconds: float, backend: str) -> tuple[object, object]:
        engine = SimpleNamespace(backend=backend, close=lambda: None)
        return engine, SimpleNamespace(speech_tokens=np.zeros(75, np.int64))

    def listen(engine: SimpleNamespace, voice: object, text: str, config: object) -> dict[str, float]:
        calls.append((engine.backend, config.flow_steps))
        rtf = config.flow_steps + (0.5 if engine.backend == "auto" else 0.0)
        return {"chunks": 3, "first_audio_s": 1.0, "stream_rtf": rtf, "stalls": 0, "stall_s": 0.0}

    monkeypatch.setattr(probe, "load", load)
    monkeypatch.setattr(probe, "listen", listen)
    argv = ["chunk_plan_ab.py", "DIR", "--chunk-tokens", "50", "--steps", "10,5", "--backend", "onnxruntime,auto"]
    monkeypatch.setattr(sys, "argv", argv + ["--runs", "2"])
    probe.main()
    cells = [[c.strip() for c in line.split("|")] for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in cells if len(r) > 9 and r[1].isdigit()]
    assert sorted((r[9], r[8]) for r in rows) == sorted((b, s) for b in ("onnxruntime", "auto") for s in ("10", "5"))
    for row in rows:
        assert float(row[5].split()[0]) == int(row[8]) + (0.5 if row[9] == "auto" else 0.0), row
    assert sorted(calls) == sorted([(b, s) for b in ("onnxruntime", "auto") for s in (10, 5)] * 3)  # warm-up + 2
    monkeypatch.setattr(sys, "argv", ["chunk_plan_ab.py", "DIR", "--steps", "10,"])
    with pytest.raises(SystemExit):
        probe.main()
    assert "positive whole numbers" in capsys.readouterr().err


def test_the_lm_shapes_probe_reports_every_prompt_length_twice(tiny_export_dir: Path) -> None:
    """``bench/lm_shapes_memory.py`` (how the OpenVINO LM's memory per prompt length was found, docs/backends.md):
    one row per request, every length once and then again, the prompts' lengths in the asked order; bad counts
    refused."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "lm_shapes_memory.py"
    cmd = [sys.executable, str(script), str(tiny_export_dir), "--backend", "onnxruntime", "--steps", "2", "--lengths",
           "3", "--threads", "1"]  # fmt: skip
    for extra, first_pass in (([], sorted), (["--descending"], lambda v: sorted(v, reverse=True))):
        out = subprocess.run([*cmd, *extra], check=True, capture_output=True, text=True, timeout=600).stdout
        assert out.splitlines()[0].startswith("--backend onnxruntime: the LM on onnxruntime"), out
        rows = [line.split() for line in out.splitlines()[2:]]
        assert [int(r[0]) for r in rows] == list(range(6)), out
        ids = [int(r[1]) for r in rows]
        assert len(set(ids)) == 3 and ids[:3] == first_pass(ids[:3]) and ids[3:] == sorted(set(ids)), out
        assert all(float(r[4]) > 0 for r in rows), out
    for flag in ("--steps", "--repeat"):
        bad = subprocess.run([*cmd, flag, "0"], capture_output=True, text=True, timeout=600)
        assert bad.returncode == 2 and "--repeat must be at least 1" in bad.stderr, flag
    bad = subprocess.run([*cmd, "--prefill", "both"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "only the stateful (OpenVINO) LM prefills in pieces" in bad.stderr


def test_stream_timeline_records_every_graph_call_by_thread(tiny_export_dir: Path) -> None:
    """``bench/stream_timeline.py`` on a streamed sentence: the LM's calls on the scheduler's thread, the flow's and
    the vocoder's on the caller's; the caller's time outside graphs counts a guidance-row thread's call as inside
    (the caller waits for it); the backends' methods are their own again afterwards."""
    from cosyvoice_cpu.backends.onnxruntime import OrtBoundRun, OrtSession
    from cosyvoice_cpu.benchmark.tasks import load

    timeline = load_script("bench/stream_timeline.py")
    calls = [("a", "caller", 0.0, 1.0), ("b", "cosyvoice-rows", 0.5, 2.0), ("lm", "lm-scheduler", 0.0, 5.0),
             ("c", "caller", 3.0, 4.0)]  # fmt: skip
    assert timeline.outside(calls, {"caller", "cosyvoice-rows"}, 6.0) == pytest.approx(3.0)  # 2-3 and 4-6
    assert timeline.outside(calls, {"caller"}, 6.0) == pytest.approx(4.0)
    spent, lm_ms = timeline.before(calls, 3.0)  # c starts at 3.0: after; the LM's call is clipped at 3.0
    assert list(spent) == ["a @ caller", "lm @ lm-scheduler", "b @ cosyvoice-rows"]
    assert spent["lm @ lm-scheduler"] == {"s": pytest.approx(3.0), "calls": 1} and lm_ms == [5000.0]
    originals = (OrtSession.run, OrtBoundRun.run)
    rec = timeline.instrument()
    engine, voice = load(tiny_export_dir, 2)
    try:
        run = timeline.one_run(engine, voice, rec, True, 40)
    finally:
        engine.close()
        rec.restore()
    assert (OrtSession.run, OrtBoundRun.run) == originals
    graphs = run["graphs"]
    assert graphs["lm.onnx @ lm-scheduler"]["calls"] >= 40  # prefill + a step per token
    assert graphs["hift_decode.onnx @ caller"]["calls"] == len(run["chunks"]) > 1
    rows = graphs["flow_estimator_stream.onnx @ cosyvoice-rows"]  # 2 threads: the second guidance row's calls
    assert rows["calls"] == graphs["flow_estimator_stream.onnx @ caller"]["calls"] > 0
    assert run["audio_s"] == pytest.approx(40 / 25) and 0 <= run["caller_outside_graphs_s"] < run["wall_s"]
    assert run["cpu_s"] > 0 and run["cores_busy"] > 0
    # the first chunk came after the LM's first tokens, the encoder's and the estimator's calls for it (and, in this
    # first run, the voice's prompt cache)
    assert run["first_audio_s"] == pytest.approx(next(t for t, d in run["chunks"] if d > 0), abs=1e-3)
    first = run["before_first_audio"]
    assert first["lm.onnx @ lm-scheduler"]["calls"] == len(run["lm_calls_before_first_audio_ms"]) > 1
    assert first["flow_encoder.onnx @ caller"]["calls"] >= 1 and first["hift_decode.onnx @ caller"]["calls"] >= 1
    estimator = "flow_estimator_stream.onnx @ caller"
    assert 0 < first[estimator]["calls"] < graphs[estimator]["calls"]
    assert sum(g["s"] for k, g in first.items() if "@ caller" in k) <= run["first_audio_s"]
