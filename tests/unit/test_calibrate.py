"""The machine calibration: packaged graphs, what they compute, the numbers, and where they are reported."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cosyvoice_cpu.cli.main import main
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.probes.calibrate import GRAPHS, REFERENCE_MACHINES, Calibration, _session, best_seconds, calibrate

TINY = {"budget_s": 0.005, "scale": 0.02}


def test_the_packaged_graphs_are_what_the_builder_makes() -> None:
    pytest.importorskip("onnx")
    from cosyvoice_cpu.export.calibration_graphs import build

    built = build()
    assert sorted(built) == sorted(p.name for p in GRAPHS.glob("*.onnx"))
    for name, data in built.items():
        stale = f"{name} is stale: python -m cosyvoice_cpu.export.calibration_graphs"
        assert (GRAPHS / name).read_bytes() == data, stale


def test_the_graphs_compute_the_products_they_time() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((5, 7), dtype=np.float32), rng.standard_normal((7, 3), dtype=np.float32)
    np.testing.assert_allclose(_session("sgemm.onnx", 1).run(None, {"a": a, "b": b})[0], a @ b, rtol=1e-5)
    # 7-bit b, as our int8 graphs store: full 8-bit products saturate on CPUs without VNNI (stages.INT8_WEIGHT_BITS)
    qa, qb = rng.integers(0, 256, (5, 7), dtype=np.uint8), rng.integers(-64, 64, (7, 3), dtype=np.int8)
    out = _session("qgemm.onnx", 1).run(None, {"a": qa, "b": qb})[0]
    assert out.dtype == np.int32 and np.array_equal(out, qa.astype(np.int32) @ qb.astype(np.int32))
    q, k, v = (rng.standard_normal((2, 9, 512), dtype=np.float32) for _ in range(3))
    heads = lambda x: x.reshape(2, 9, 8, 64).transpose(0, 2, 1, 3)  # noqa: E731
    s = heads(q) @ heads(k).transpose(0, 1, 3, 2) / 8.0
    p = np.exp(s - s.max(-1, keepdims=True))
    want = ((p / p.sum(-1, keepdims=True)) @ heads(v)).transpose(0, 2, 1, 3).reshape(2, 9, 512)
    np.testing.assert_allclose(_session("attention.onnx", 1).run(None, {"q": q, "k": k, "v": v})[0], want,
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def test_calibrate_returns_finite_positive_speeds() -> None:
    c = calibrate(1, **TINY)
    assert c.threads == 1
    for name in ("copy_gb_s", "sgemm_gflops", "qgemm_gops", "attention_ms"):
        value = getattr(c, name)
        assert math.isfinite(value) and value > 0, (name, value)
    assert Calibration.from_dict(c.as_dict()) == c
    assert "GB/s" in c.summary() and "(1 threads)" in c.summary()
    for bad in ({"threads": 0}, {"threads": 1, "budget_s": 0}, {"threads": 1, "scale": 1.5}):
        with pytest.raises(ConfigError, match="calibrate wants"):
            calibrate(**{"budget_s": 0.01, **bad})


def test_best_seconds_takes_the_fastest_run_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    import cosyvoice_cpu.probes.calibrate as cal

    clock = [0.0]  # a fake perf_counter that each call of fn advances by its duration: no sleeping, no load
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    calls = []
    durations = iter([5.0, 5.0, 0.004, 0.001, 0.003])  # two warm-ups (never timed), then three timed calls

    def fn() -> None:
        calls.append(1)
        clock[0] += next(durations)

    best = best_seconds(fn, budget_s=0.0, warmup=2, min_runs=3)
    assert len(calls) == 5 and best == pytest.approx(0.001)


def test_doctor_speed_prints_this_machine_and_the_reference_machines(capsys, monkeypatch) -> None:
    import cosyvoice_cpu.probes.calibrate as cal

    fixed = Calibration(threads=2, copy_gb_s=15.3, sgemm_gflops=134.0, qgemm_gops=760.0, attention_ms=16.3)
    monkeypatch.setattr(cal, "calibrate", lambda threads, **kw: fixed)
    assert main(["doctor", "--speed"]) in (0, 1)
    out = capsys.readouterr().out
    assert f"speed        {fixed.summary()}" in out
    assert REFERENCE_MACHINES and all(name in out for name in REFERENCE_MACHINES)
    assert "note         memory copies at 15 GB/s" in out and "--quant int4" in out  # as the Xeon, Zen 3, Zen 4
    fast = Calibration(threads=2, copy_gb_s=36.0, sgemm_gflops=350.0, qgemm_gops=1500.0, attention_ms=5.0)
    monkeypatch.setattr(cal, "calibrate", lambda threads, **kw: fast)
    assert main(["doctor", "--speed"]) in (0, 1)
    assert "memory copies at" not in capsys.readouterr().out  # (a CPU without VNNI has a hardware note of its own)
    assert "speed " not in (main(["doctor"]), capsys.readouterr().out)[1]
