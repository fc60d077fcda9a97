"""``bench/backend_ab.py``: the engine under several backend plans (and OpenVINO precisions), alternated."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.repo_scripts import load_script


def test_the_backend_probe_measures_every_engine_on_each_measure(tiny_export_dir: Path) -> None:
    """``bench/backend_ab.py --backends A,B --measure ...`` (how the LM's backends were compared on the AMX Xeon,
    docs/backends.md): each engine gets a line with every measure's medians, the first engine's ratios 1.00x; a
    measure it does not know and a plan named twice (one engine would hide the other) are refused."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "backend_ab.py"
    cmd = [sys.executable, str(script), str(tiny_export_dir), "--backends", "onnxruntime,auto", "--runs", "1",
           "--tokens", "20", "--short-tokens", "8", "--threads", "1"]  # fmt: skip
    out = subprocess.run([*cmd, "--measure", "e2e,lm,first,stream"], check=True, capture_output=True, text=True)
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if not line.startswith(" ")}
    assert set(lines) == {"onnxruntime", "auto"}, out.stdout
    keys = ("flow_rtf", "rtf", "flow_ms_per_step", "lm_prefill_s", "lm_decode_tok_s", "short_first_audio_s",
            "first_audio_s", "stream_rtf")  # fmt: skip
    for name, line in lines.items():
        for key in keys:
            assert f" {key} " in line, (name, key, line)
        assert line.count("x)") == len(keys), line
    assert all(part.endswith("(1.00x)") for part in lines["onnxruntime"].split(", "))
    for flag, value in (("--measure", "e2e,lmm"), ("--backends", "auto,auto")):
        bad = subprocess.run([*cmd, flag, value], capture_output=True, text=True)  # the last flag wins
        assert bad.returncode == 2 and f"{flag}: " in bad.stderr, bad.stderr


def test_load_at_sets_the_precision_for_one_engine_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_at``: the OpenVINO backend compiles that engine's graphs at the precision asked for (it reads it when
    it opens a graph) and is set back afterwards, also when the load fails."""
    from cosyvoice_cpu.backends.registry import BACKENDS

    ab = load_script("bench/backend_ab.py")
    seen: list[str | None] = []

    def fake_load(*args: object, **config: object) -> tuple[str, str]:
        seen.append(BACKENDS["openvino"].compute_precision())
        if config.get("fail"):
            raise RuntimeError("load failed")
        return "engine", "voice"

    monkeypatch.setattr(ab, "load", fake_load)
    assert ab.load_at("f32", "DIR", 1, backend="auto") == ("engine", "voice")
    with pytest.raises(RuntimeError):
        ab.load_at("bf16", "DIR", 1, fail=True)
    assert seen == ["f32", "bf16"] and BACKENDS["openvino"].precision is None


def test_the_backend_probe_loads_each_openvino_plan_once_per_precision(tiny_ov_export_dir: Path) -> None:
    """``--ov-precision bf16,f32`` (how the estimator's precision was chosen on an Intel core without AMX,
    docs/backends.md): every plan but onnxruntime once per precision, labelled ``PLAN@PRECISION``; unknown,
    repeated or useless values refused."""
    import subprocess
    import sys

    script = Path(load_script("bench/backend_ab.py").__file__)
    cmd = [sys.executable, str(script), str(tiny_ov_export_dir), "--backends", "onnxruntime,openvino", "--runs", "1",
           "--tokens", "20", "--threads", "1", "--measure", "e2e"]  # fmt: skip
    out = subprocess.run([*cmd, "--ov-precision", "bf16,f32"], check=True, capture_output=True, text=True)
    labels = {line.split()[0] for line in out.stdout.splitlines() if not line.startswith(" ")}
    assert labels == {"onnxruntime", "openvino@bf16", "openvino@f32"}, out.stdout
    for value, said in (("fp8", "unknown ['fp8']"), ("f32,f32", "each precision once")):
        bad = subprocess.run([*cmd, "--ov-precision", value], capture_output=True, text=True)
        assert bad.returncode == 2 and f"--ov-precision: {said}" in bad.stderr, bad.stderr
    alone = [*cmd[:4], "onnxruntime", *cmd[5:], "--ov-precision", "f32"]
    bad = subprocess.run(alone, capture_output=True, text=True)
    assert bad.returncode == 2 and "no plan here runs OpenVINO" in bad.stderr, bad.stderr
