"""``export --openvino`` also writes the CosyVoice2 / Fun-CosyVoice3 LM as a stateful OpenVINO model (``lm_ov``,
``cosyvoice_cpu.export.openvino_lm``) with its greedy agreement with ``lm.onnx`` recorded; ``--openvino-lm none``
and CosyVoice-300M write none (``test_openvino_export.py``, the other families' test). Needs torch, openvino and
nncf. Which backend runs it is the plan's (``tests/unit/test_backend_plan.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("openvino")
pytest.importorskip("nncf")

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.openvino_lm import agreement_line
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.workshop.export_stages import wants_openvino_lm
from cosyvoice_cpu.workshop.exporter import ExportOptions
from tests.repo_scripts import load_script


def test_the_openvino_export_lists_the_stateful_lm_with_its_agreement(tiny_ov_export_dir: Path) -> None:
    m = Manifest.load(tiny_ov_export_dir, check_hashes=True)  # sha256 of lm.ov.xml and lm.ov.bin checked
    entry, onnx = m.graphs["lm_ov"], m.graphs["lm"]
    assert entry.file.file == "lm.ov.xml" and [d.file for d in entry.data] == ["lm.ov.bin"]
    assert entry.precision == "int8"
    attrs = dict(entry.attrs)
    assert attrs.pop("backend") == "openvino" and attrs.pop("stateful") is True and attrs.pop("weights") == "int8"
    assert attrs.pop("form_of") == "lm"
    agreement, of = attrs.pop("agreement"), attrs.pop("agreement_of")
    assert 0.0 <= agreement <= 1.0 and of["reference"] == f"lm.onnx ({onnx.precision})"
    assert of["prompts"] * of["steps"] >= 64 and of["mean_kl"] >= 0.0
    assert attrs == {k: v for k, v in onnx.attrs.items() if k != "int8_weight_bits"}  # the LM's facts, shared
    assert [i["name"] for i in entry.inputs] == ["inputs_embeds", "attention_mask", "position_ids", "beam_idx"]
    assert [o["name"] for o in entry.outputs] == ["logp"]
    assert f"{agreement:.3f}" in agreement_line(entry.attrs)  # what the export prints in its summary


def test_openvino_reads_the_written_lm(tiny_ov_export_dir: Path) -> None:
    from cosyvoice_cpu.backends.openvino import import_openvino

    model = import_openvino().Core().read_model(str(tiny_ov_export_dir / "lm.ov.xml"))
    m = Manifest.load(tiny_ov_export_dir)
    assert len(model.get_sinks()) == 2 * int(m.graphs["lm"].attrs["num_layers"])  # the KV cache is model state
    assert model.get_rt_info(["cosyvoice_cpu", "weights"]).astype(str) == "int8"


def test_which_exports_write_the_openvino_lm() -> None:
    def opts(openvino: str, lm: str = "int8") -> ExportOptions:
        return ExportOptions(openvino=openvino, openvino_lm=lm)

    assert wants_openvino_lm("cosyvoice2", opts("int8")) and wants_openvino_lm("cosyvoice3", opts("bf16", "int4"))
    assert not wants_openvino_lm("cosyvoice2", opts("int8", "none"))
    assert not wants_openvino_lm("cosyvoice2", opts("none"))  # only with --openvino
    assert not wants_openvino_lm("cosyvoice", opts("int8"))  # CosyVoice-300M: its LM is another network
    with pytest.raises(ConfigError, match="openvino_lm must be one of none, int8, int4"):
        opts("int8", "int3").validate()


def test_the_cli_takes_openvino_lm_only_with_openvino(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cosyvoice_cpu.cli.main import main

    assert main(["export", "--from", str(tmp_path), "--to", str(tmp_path / "out"), "--openvino-lm", "int4"]) == 2
    assert "--openvino-lm goes with --openvino" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_bench_says_the_lm_ran_on_openvino(tiny_ov_export_dir: Path) -> None:
    from cosyvoice_cpu.benchmark.report import ran_on
    from cosyvoice_cpu.benchmark.tasks import graph_backends
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.engine import Engine

    engine = Engine.load(tiny_ov_export_dir, EngineConfig(threads=1, backend="openvino", lm_batch_rows=0))
    try:
        on = ran_on({"graph_backends": graph_backends(engine.plan)})  # what bench's single task records
    finally:
        engine.family.warming.join()
        engine.close()
    assert on == {"LM": "openvino", "flow estimator": "openvino", "the rest": "onnxruntime"}


def test_the_engine_speaks_with_the_lm_on_openvino_through_the_scheduler(tiny_ov_export_dir: Path) -> None:
    """A user's paths with the stateful LM: two streamed sentences at once through the LM scheduler (rows joining
    and leaving one state, the voice's prefix cached), then a text stream fed piece by piece (text appended to a
    live row). Same seeds, so the concurrent sentences are the ones spoken alone."""
    import io
    import threading

    import numpy as np
    import soundfile as sf

    from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.lm.state_graph import StateCache

    t = np.arange(2 * 16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 150 * t)).astype(np.float32), 16000, format="WAV")
    engine = Engine.load(tiny_ov_export_dir, EngineConfig(threads=1, backend="openvino", lm_batch_rows=2))
    try:
        assert engine.plan["lm"].backend == "openvino"
        voice = engine.make_voice(buf.getvalue(), "Good morning everyone.")
        config = SynthesisConfig(stream=True, seed=5, min_tokens=20, max_tokens=20)
        texts = ["The valve on line three is open.", "Call the supervisor now."]

        def speak(text: str) -> np.ndarray:
            return np.concatenate([c.samples for c in engine.synthesize(text, voice, config)])

        alone = [speak(x) for x in texts]
        together: dict[int, np.ndarray] = {}
        threads = [threading.Thread(target=lambda i=i: together.update({i: speak(texts[i])})) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        assert sorted(together) == [0, 1]
        for a, b in zip(alone, [together[0], together[1]]):
            assert len(a) == len(b) > 0 and np.isfinite(b).all()  # 20 tokens each, the same frames
        stream = engine.open_text_stream(voice, SynthesisConfig(stream=True, seed=3))
        for piece in ["The ala", "rm is ac", "tive. Ple", "ase check it."]:
            stream.feed(piece)
        stream.close()
        wave = np.concatenate([c.samples for c in stream])
        assert len(wave) > 0 and np.isfinite(wave).all()
        assert isinstance(engine.lm.session.new_cache(1), StateCache)
    finally:
        engine.family.wait_warm()
        engine.close()


def test_the_lm_probe_compares_the_forms_of_a_fun_cosyvoice3_lm(
    tiny_v3_model_dir: Path, tiny_model_dir: Path, tiny_v1_model_dir: Path, tmp_path: Path
) -> None:
    """``bench/ov_lm_probe.py`` (the tool behind docs/quantization.md's LM rows) prepares a Fun-CosyVoice3 LM, whose
    reference and head differ from CosyVoice2's, and runs every form on it; greedy tokens come from the speech
    table's rows; a WORK of another fixture and a CosyVoice-300M fixture are refused."""
    import json
    import subprocess
    import sys

    import numpy as np

    script = Path(__file__).parents[2] / "bench" / "ov_lm_probe.py"
    probe, work = [sys.executable, str(script)], tmp_path / "work"
    run = dict(check=True, capture_output=True, text=True, timeout=600)
    subprocess.run([*probe, "prepare", "--fixture", str(tiny_v3_model_dir), "--work", str(work)], **run)
    attrs = json.loads((work / "attrs.json").read_text())  # the family's own attrs
    assert attrs["speech_rows"] < attrs["speech_vocab"]  # a head wider than the speech table
    forms = "ort-int4,rt-ov-int8,rt-ov-int4"
    compare = [*probe, "agree", "--work", str(work), "--forms", forms, "--prompts", "1", "--steps", "6"]
    agree = subprocess.run(compare, **run)
    rows = {r["form"]: r for r in map(json.loads, agree.stdout.splitlines()[1:])}
    assert sorted(rows) == sorted(["ort-fp32", "ort-int8w", *forms.split(",")])
    assert rows["ort-int8w"]["teacher_forced_agree_fp32"] >= 0.5  # int8w follows fp32 on the tiny LM (1.0 measured)
    speed = [*probe, "speed", "--work", str(work), "--forms", "ort-int8w,rt-ov-int4", "--rows", "1,2", "--steps", "5"]
    out = subprocess.run([*speed, "--no-alone"], **run).stdout.splitlines()[1:]
    assert [(r["form"], r["rows"]) for r in map(json.loads, out)] == [
        ("ort-int8w", 1),
        ("rt-ov-int4", 1),
        ("ort-int8w", 2),
        ("rt-ov-int4", 2),
    ]
    groups = [*speed[:6], "ov-int4-f32+dq0,ov-int4-f32+dq64", "--rows", "1", "--steps", "5", "--no-alone"]
    said = subprocess.run(groups, **run).stdout  # a form's +dqN is its own dynamic quantization group
    assert "'DYNAMIC_QUANTIZATION_GROUP_SIZE': '0'" in said and "'DYNAMIC_QUANTIZATION_GROUP_SIZE': '64'" in said, said
    module = load_script("bench/ov_lm_probe.py")
    prompts = module.Prompts(work, attrs)
    logp = np.zeros((2, attrs["speech_vocab"]), np.float32)
    logp[0, attrs["speech_rows"] + 1], logp[0, 5], logp[1, 7] = 3.0, 2.0, 1.0  # row 0's best is a stop id
    assert prompts.pick(logp) == [5, 7]
    for fixture, words in ((tiny_model_dir, "holds the forms of"), (tiny_v1_model_dir, "CosyVoice2 or Fun-CosyVoice3")):
        prepare = [*probe, "prepare", "--fixture", str(fixture), "--work", str(work)]
        refused = subprocess.run(prepare, capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and words in refused.stderr, refused.stderr


def test_the_lm_shapes_probe_alternates_the_prefill_forms(tiny_ov_export_dir: Path) -> None:
    """``bench/lm_shapes_memory.py --prefill both`` (how the pieces were measured against one call): every request
    in both forms, the forms taking turns first, both reached (call counts), each length's second pass at the end."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "lm_shapes_memory.py"
    cmd = [sys.executable, str(script), str(tiny_ov_export_dir), "--backend", "openvino", "--steps", "2",
           "--lengths", "2", "--threads", "1", "--prefill", "both"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    lines = out.splitlines()
    assert lines[0].startswith("--backend openvino: the LM on openvino"), out
    rows = [line.split() for line in lines[2:10]]
    first = ["pieces", "one-call", "one-call", "pieces"]  # which goes first turns with each length and pass
    assert [r[-1] for r in rows] == first + first[2:] + first[:2], out
    assert [r[1] for r in rows[::2]] == [r[1] for r in rows[1::2]], out  # each length in both forms
    calls = dict(part.rsplit(" ", 1) for part in lines[10].removeprefix("prefill calls: ").split(", "))
    assert int(calls["one-call"]) > 0 and int(calls["pieces"]) >= int(calls["one-call"]), out  # both reached
    assert lines[11] == "second pass, prefill ms by text ids: one-call / pieces", out
    summary = [line.split() for line in lines[12:]]
    assert len(summary) == 2 and sorted(r[0] for r in summary) == sorted({r[1] for r in rows}), out


def test_the_first_audio_probe_alternates_backends(tiny_ov_export_dir: Path) -> None:
    """``bench/first_audio_probe.py --backend onnxruntime,openvino``: one engine per backend (the LM on each), every
    size and prefix-cache mode timed on both, each row naming its backend, the first audio the sum of its stages."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "first_audio_probe.py"
    base = [sys.executable, str(script), str(tiny_ov_export_dir), "--threads", "1", "--runs", "1",
            "--backend", "onnxruntime,openvino", "--prefix-cache", "both"]  # fmt: skip
    run = dict(check=True, capture_output=True, text=True, timeout=600)
    out = subprocess.run([*base, "--sizes", "4,2"], **run).stdout
    said = [line for line in out.splitlines() if line.startswith("--backend")]  # the LM's backend and graph form
    assert said == ["--backend onnxruntime: the LM on onnxruntime (BoundGraph)",
                    "--backend openvino: the LM on openvino (StateGraph)"], out  # fmt: skip
    rows = _table_rows(out)
    got = [(r[0], r[1], r[-1]) for r in rows[1:]]
    assert got == [(n, on, b) for n in ("4", "2") for b in ("onnxruntime", "openvino") for on in ("off", "on")], out
    for r in rows[1:]:
        stages, total = [float(x) for x in r[2:6]], float(r[6])
        assert all(x > 0 for x in stages) and abs(sum(stages) - total) < 0.01, out
    out = subprocess.run([*base, "--lm-only"], **run).stdout
    rows = _table_rows(out)
    assert sorted({r[-1] for r in rows[1:]}) == ["onnxruntime", "openvino"] and len(rows) == 1 + 2 * 2 * 2, out


def _table_rows(out: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in ``out`` (header row included, separator rows not)."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
