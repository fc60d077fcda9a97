"""The per-graph numerics probe on this machine: deterministic, every graph covered, and its comparison fails when
an output moves past its tolerance (tests/platform/test_qemu.py holds other CPUs to it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.hardware import emulation
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.probes.graphs import FP32_TOLERANCE, TOLERANCE, compare, main, probe_model


@pytest.fixture(scope="module")
def probe() -> dict[str, np.ndarray]:
    return probe_model(DEMO_MODEL, threads=1)


def test_probe_covers_every_graph_and_repeats_bit_for_bit(probe: dict[str, np.ndarray]) -> None:
    graphs = {k.split("/")[0] for k in probe if "/in/" not in k and not k.startswith("meta/")}
    assert graphs == {*Manifest.load(DEMO_MODEL).graphs, "campplus", "speech_tokenizer"}
    assert set(TOLERANCE) <= set(probe), "a tolerance names an output the probe does not produce"
    assert probe["lm/decode_logp"].shape == (6, 6564) and np.all(np.isfinite(probe["hift_decode/wave"]))
    again = compare(probe, probe_model(DEMO_MODEL, threads=1))
    assert all(d.ok and d.err == 0 for d in again), [str(d) for d in again if d.err]


def test_compare_flags_an_output_past_its_tolerance(probe: dict[str, np.ndarray]) -> None:
    moved = dict(probe)
    wave = probe["hift_decode/wave"]
    moved["hift_decode/wave"] = wave + 3 * FP32_TOLERANCE * np.abs(wave).max()
    moved["lm/decode_logp"] = probe["lm/decode_logp"] * (1 + 0.5 * TOLERANCE["lm/decode_logp"])
    moved["speech_tokenizer/indices"] = probe["speech_tokenizer/indices"] + 1
    moved["flow_estimator/in/x"] = probe["flow_estimator/in/x"] + 1  # the two runs did not feed the same inputs
    bad = {d.key for d in compare(probe, moved) if not d.ok}
    assert bad == {"hift_decode/wave", "speech_tokenizer/indices", "flow_estimator/in/x"}
    del moved["hift_f0/f0"]
    assert "hift_f0/f0" in {d.key for d in compare(probe, moved) if not d.ok}


def test_the_command_writes_and_compares(
    tmp_path: Path, probe: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    np.savez(tmp_path / "ref.npz", **probe)
    assert main([str(DEMO_MODEL), str(tmp_path / "out.npz"), "--against", str(tmp_path / "ref.npz")]) == 0
    assert "lm/decode_logp" in capsys.readouterr().out
    shifted = {**probe, "flow_encoder/mu": probe["flow_encoder/mu"] + 1.0}
    np.savez(tmp_path / "ref.npz", **shifted)
    assert main([str(DEMO_MODEL), str(tmp_path / "out.npz"), "--against", str(tmp_path / "ref.npz")]) == 1


def test_arm_cpuinfo_names_the_core_and_its_features(tmp_path: Path) -> None:
    path = emulation.write_arm_cpuinfo(tmp_path, "cortex-a76")
    text = path.read_text()
    assert path == tmp_path / "proc" / "cpuinfo" and text.count("processor\t:") == 2
    assert "CPU part\t: 0xd0b" in text and " asimddp" in text
    assert " asimddp" not in emulation.arm_cpuinfo("cortex-a72")
