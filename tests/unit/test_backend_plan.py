"""The per-graph backend plan (``--backend auto|onnxruntime|openvino``) and the frame buckets OpenVINO runs on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cosyvoice_cpu.backends.buckets import BucketedSession, bucket
from cosyvoice_cpu.backends.plan import describe, plan_backends
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.graphs import ESTIMATOR_PADDING, estimator_shapes
from cosyvoice_cpu.hardware.cpu import CpuInfo


def _entry(file: str, precision: str = "fp32", **attrs: object) -> SimpleNamespace:
    return SimpleNamespace(file=SimpleNamespace(file=file), precision=precision, attrs=attrs)


def _graphs(pad_exact: bool = True, with_ov: bool = True) -> dict[str, SimpleNamespace]:
    graphs = {k: _entry(f"{k}.onnx") for k in ("lm", "flow_encoder", "flow_estimator", "hift_decode")}
    if with_ov:
        graphs["flow_estimator_ov"] = _entry("flow_estimator.ov.xml", "int8", pad_exact=pad_exact)
    return graphs


def _cpu(flags: str, vendor: str) -> CpuInfo:
    return CpuInfo("test CPU", frozenset(flags.split()), 2, 2, vendor=vendor)


BF16 = _cpu("avx2 fma avx512f avx512_vnni avx512_bf16", "AuthenticAMD")  # a Zen 4
AMX = _cpu("avx2 fma avx512f avx512_vnni amx_bf16 amx_int8", "GenuineIntel")
INTEL_BF16 = _cpu("avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16", "GenuineIntel")  # AMX hidden
AVX2 = _cpu("avx2 fma", "AuthenticAMD")
VNNI = _cpu("avx2 fma avx512f avx512_vnni", "GenuineIntel")  # Cascade Lake, Ice Lake: no bf16 arithmetic
SKYLAKE = _cpu("avx2 fma avx512f", "GenuineIntel")  # AVX-512 without VNNI


def test_auto_puts_the_estimator_on_openvino_only_where_the_cpu_has_bf16_amx_or_avx512_vnni() -> None:
    plan = plan_backends(_graphs(), "auto", BF16, installed=True, memory=None)
    assert set(plan) == {"lm", "flow_encoder", "flow_estimator", "hift_decode"}  # the IR is not a graph of its own
    assert plan["flow_estimator"].backend == "openvino" and plan["flow_estimator"].key == "flow_estimator_ov"
    assert "AVX-512 BF16" in plan["flow_estimator"].reason
    assert all(p.backend == "onnxruntime" and p.key == k for k, p in plan.items() if k != "flow_estimator")
    assert plan_backends(_graphs(), "auto", AMX, installed=True, memory=None)["flow_estimator"].backend == "openvino"
    avx2 = plan_backends(_graphs(), "auto", AVX2, installed=True)["flow_estimator"]
    assert avx2.backend == "onnxruntime" and "neither AMX, AVX-512 BF16 nor AVX-512 VNNI" in avx2.reason
    unknown = plan_backends(_graphs(), "auto", None, installed=True)  # /proc/cpuinfo unreadable: no bf16
    assert unknown["flow_estimator"].backend in ("onnxruntime", "openvino")


def test_auto_takes_openvino_on_avx512_vnni_without_bf16_in_f32() -> None:
    """A Cascade Lake / Ice Lake (AVX-512 VNNI, no bf16 arithmetic) runs OpenVINO's f32 kernels with int8 layers,
    all an Intel core without AMX uses (measured with OpenVINO's kernels capped at that instruction set: the int4
    LM 1.73x faster than ONNX Runtime's, docs/backends.md); AVX-512 without VNNI (Skylake) keeps ONNX Runtime."""
    from cosyvoice_cpu.backends import openvino_precision

    plan = plan_backends(_with_lm_ov(), "auto", VNNI, installed=True, memory=None, family="cosyvoice2")
    assert plan["flow_estimator"].backend == "openvino" and plan["lm"].backend == "openvino"
    assert "the CPU has AVX-512 VNNI;" in plan["flow_estimator"].reason
    assert "the CPU has AVX-512 VNNI:" in plan["lm"].reason
    assert "computed in f32 (this CPU has no bf16 arithmetic)" in plan["flow_estimator"].reason
    assert openvino_precision.precision_for_cpu(VNNI) == "f32"
    missing = plan_backends(_graphs(with_ov=False), "auto", VNNI, installed=True, memory=None, family="cosyvoice2")
    assert "--openvino int8" in missing["flow_estimator"].reason and "--openvino-lm int4" in missing["lm"].reason
    skylake = plan_backends(_with_lm_ov(), "auto", SKYLAKE, installed=True, memory=None, family="cosyvoice2")
    assert {p.backend for p in skylake.values()} == {"onnxruntime"}
    assert (
        "none needed" in plan_backends(_graphs(with_ov=False), "auto", SKYLAKE, installed=True)["flow_estimator"].reason
    )


def test_the_estimator_computes_in_bf16_only_where_it_was_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Intel core with AVX-512 BF16 but no AMX still gets the OpenVINO estimator (faster than ONNX Runtime in f32)
    but compiled at f32, where its bf16 products ran slower; the plan's reason says what the backend will do, its
    own precision when it was made with one."""
    from cosyvoice_cpu.backends import openvino_precision
    from cosyvoice_cpu.backends.registry import BACKENDS
    from cosyvoice_cpu.hardware import cpu as cpu_module

    plans = {c: plan_backends(_graphs(), "auto", c, installed=True, memory=None)["flow_estimator"]
             for c in (BF16, AMX, INTEL_BF16)}  # fmt: skip
    assert {p.backend for p in plans.values()} == {"openvino"}
    assert "computed in bf16" in plans[BF16].reason and "computed in bf16" in plans[AMX].reason
    assert "computed in f32" in plans[INTEL_BF16].reason and "Intel core without AMX" in plans[INTEL_BF16].reason
    unknown = _cpu("avx2 fma avx512f avx512_bf16", "")  # no vendor_id: bf16 was not measured faster there
    for cpu, want in ((BF16, "bf16"), (AMX, "bf16"), (INTEL_BF16, "f32"), (AVX2, "f32"), (unknown, "f32")):
        assert openvino_precision.precision_for_cpu(cpu) == want, cpu
        hw = SimpleNamespace(cpu=cpu)  # the backend reads the CPU as the plan does (detect: cpuid's features)
        monkeypatch.setattr(cpu_module, "detect", lambda hw=hw: hw)
        assert BACKENDS["openvino"].compute_precision() == want, cpu
    monkeypatch.setattr(BACKENDS["openvino"], "precision", "bf16")  # a backend made with its own precision
    forced = plan_backends(_graphs(), "auto", INTEL_BF16, installed=True, memory=None)["flow_estimator"]
    assert "computed in bf16" in forced.reason


def test_auto_keeps_onnxruntime_where_memory_is_short() -> None:
    short = plan_backends(_graphs(), "auto", BF16, installed=True, memory=2 << 30)["flow_estimator"]
    assert short.backend == "onnxruntime" and "2.0 GiB" in short.reason and "--backend openvino" in short.reason
    assert plan_backends(_graphs(), "auto", BF16, installed=True, memory=8 << 30)["flow_estimator"].backend == (
        "openvino"
    )
    forced = plan_backends(_graphs(), "openvino", BF16, installed=True, memory=1 << 30)["flow_estimator"]
    assert forced.backend == "openvino"  # an explicit choice is not second-guessed


def test_auto_keeps_onnxruntime_without_openvino_or_an_ir_or_exact_padding() -> None:
    missing = plan_backends(_graphs(), "auto", BF16, installed=False)["flow_estimator"]
    assert missing.backend == "onnxruntime" and "not installed" in missing.reason
    no_ir = plan_backends(_graphs(with_ov=False), "auto", BF16, installed=True, memory=None)["flow_estimator"]
    assert no_ir.backend == "onnxruntime" and "no OpenVINO model" in no_ir.reason
    groupnorm = plan_backends(_graphs(pad_exact=False), "auto", BF16, installed=True, memory=None)["flow_estimator"]
    assert groupnorm.backend == "onnxruntime" and "padding changes" in groupnorm.reason


def test_a_capable_cpu_without_the_openvino_model_is_told_the_command() -> None:
    """doctor prints these reasons: on a CPU where OpenVINO wins, the missing model comes with how to make it."""
    plan = plan_backends(_graphs(with_ov=False), "auto", AMX, installed=True, memory=None)
    hint = plan["flow_estimator"].reason
    assert "AMX" in hint and "--openvino int8" in hint and "pip install" not in hint
    assert "only of the Qwen2 LM" in plan["lm"].reason  # no family given: export writes the LM's for two of three
    for graph in ("flow_encoder", "hift_decode"):  # export never writes one: say so, no command to look for
        assert plan[graph].backend == "onnxruntime"
        assert "Graphs that stay on ONNX Runtime, measured" in plan[graph].reason
        assert "--openvino" not in plan[graph].reason
    uninstalled = plan_backends(_graphs(with_ov=False), "auto", BF16, installed=False, memory=None)
    assert "pip install 'cosyvoice-cpu[openvino,openvino-export]'" in uninstalled["flow_estimator"].reason
    avx2 = plan_backends(_graphs(with_ov=False), "auto", AVX2, installed=True, memory=None)["flow_estimator"]
    assert "none needed" in avx2.reason and "--openvino" not in avx2.reason
    small = plan_backends(_graphs(with_ov=False), "auto", BF16, installed=True, memory=1 << 30)["flow_estimator"]
    assert "none needed" in small.reason and "1.0 GiB" in small.reason
    explicit = plan_backends(_graphs(with_ov=False), "onnxruntime", BF16, installed=True)["flow_estimator"]
    assert explicit.reason == "--backend onnxruntime"


def test_explicit_choices() -> None:
    assert {p.backend for p in plan_backends(_graphs(), "onnxruntime", BF16, installed=True).values()} == {
        "onnxruntime"
    }
    forced = plan_backends(_graphs(pad_exact=False), "openvino", AVX2, installed=True)
    assert forced["flow_estimator"].backend == "openvino" and forced["lm"].backend == "onnxruntime"
    with pytest.raises(ConfigError, match=r"no OpenVINO model.*--openvino int8"):
        plan_backends(_graphs(with_ov=False), "openvino", BF16, installed=True)
    with pytest.raises(ConfigError, match=r"pip install 'cosyvoice-cpu\[openvino\]'"):
        plan_backends(_graphs(), "openvino", BF16, installed=False)
    with pytest.raises(ConfigError, match="auto, onnxruntime, openvino"):
        plan_backends(_graphs(), "tensorrt", BF16, installed=True)
    with pytest.raises(ConfigError, match="backend"):
        EngineConfig(backend="gpu").validate()
    with pytest.raises(ConfigError, match="compiled_shapes"):
        EngineConfig(compiled_shapes=-1).validate()


def test_describe_groups_graphs_with_the_same_reason() -> None:
    lines = describe(plan_backends(_graphs(), "auto", BF16, installed=True, memory=None))
    assert lines[0].startswith("lm: onnxruntime (no OpenVINO model")  # its own reason: which families have one
    assert lines[1].startswith("flow_encoder, hift_decode: onnxruntime (no OpenVINO model")
    assert lines[2].startswith("flow_estimator: openvino") and len(lines) == 3


def test_buckets_cover_every_length_with_bounded_padding() -> None:
    sizes = [bucket(n) for n in range(1, 3001)]
    assert all(s >= n for n, s in zip(range(1, 3001), sizes))
    assert sizes == sorted(sizes)
    assert all(s % 16 == 0 for s in sizes)
    ratios = [s / n for n, s in zip(range(1, 3001), sizes)]
    assert max(ratios[64:]) < 1.26 and max(ratios[255:]) < 1.21 and np.mean(ratios[64:]) < 1.11
    assert len(set(sizes[99:2000])) <= 20  # 100-2000 frames (2-40 s of CosyVoice2 mel): a few shapes
    with pytest.raises(ValueError):
        bucket(0)


class _Echo:
    """A fake estimator session: returns x + mask (so padding and cutting are visible) and records shapes."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.prepared: list[dict] = []

    def get_inputs(self) -> list:
        return []

    def get_outputs(self) -> list:
        return []

    def prepare(self, shapes):
        self.prepared.append(shapes)

    def run(self, names, feeds, options=None):
        self.shapes.append(feeds["x"].shape)
        assert feeds["mask"][:, :, feeds["mask"].shape[2] - (feeds["x"].shape[2] - self.frames) :].sum() == 0
        return [feeds["x"] + feeds["mask"]]


def test_a_bucketed_session_pads_with_masked_zeros_and_cuts_the_output() -> None:
    inner = _Echo()
    session = BucketedSession(inner, ESTIMATOR_PADDING)
    for frames in (70, 100, 100, 250):
        inner.frames = frames
        x = np.random.default_rng(frames).standard_normal((2, 80, frames)).astype(np.float32)
        feeds = {"x": x, "mask": np.ones((2, 1, frames), np.float32), "mu": x, "cond": x,
                 "t": np.zeros(2, np.float32), "spks": np.zeros((2, 80), np.float32)}  # fmt: skip
        out = session.run(None, feeds)[0]
        assert out.shape == x.shape and np.array_equal(out, x + 1)
    assert [s[2] for s in inner.shapes] == [bucket(70), bucket(100), bucket(100), bucket(250)]
    assert session.padded == sum(bucket(n) - n for n in (70, 100, 100, 250))
    inner.shapes.clear()
    inner.frames = 64  # a bucket's own size runs as it is
    session.run(None, {k: np.ones((1, 80 if k != "mask" else 1, 64), np.float32) for k in ("x", "mu", "cond", "mask")})
    assert inner.shapes == [(1, 80, 64)] and session.calls == 5
    session.prepare(estimator_shapes(650))  # warm-up compiles the bucket a 650-frame call lands in
    assert inner.prepared == [estimator_shapes(bucket(650))]


def _with_lm_ov(weights: str = "int4", **attrs: object) -> dict[str, SimpleNamespace]:
    graphs = _graphs()
    graphs["lm_ov"] = _entry("lm.ov.xml", weights, stateful=True, weights=weights, agreement=0.958, **attrs)
    return graphs


def test_auto_puts_the_int4_stateful_lm_on_openvino_on_a_bf16_cpu_without_the_padding_rule() -> None:
    # no pad_exact in a stateful LM's attrs: the estimator's padding rule does not apply to it; nor the memory floor
    plan = plan_backends(_with_lm_ov(), "auto", BF16, installed=True, memory=2 << 30, family="cosyvoice2")
    lm = plan["lm"]
    assert lm.backend == "openvino" and lm.key == "lm_ov" and lm.other_model
    assert "lm.ov.xml (int4), stateful" in lm.reason and "0.958" in lm.reason and "AVX-512 BF16" in lm.reason
    assert "1.35x" in lm.reason
    assert plan["flow_estimator"].backend == "onnxruntime" and plan["flow_encoder"].backend == "onnxruntime"
    assert "lm_ov" not in plan  # the OpenVINO models are no graphs of their own
    amx = plan_backends(_with_lm_ov(), "auto", AMX, installed=True, memory=None)["lm"]
    assert amx.backend == "openvino" and "AMX" in amx.reason
    lines = describe(plan)
    assert any(line.startswith("lm: openvino (OpenVINO model lm.ov.xml") for line in lines)


def test_auto_keeps_the_int8_stateful_lm_on_onnxruntime_where_it_measured_no_faster() -> None:
    for cpu in (BF16, AMX):
        lm = plan_backends(_with_lm_ov("int8"), "auto", cpu, installed=True, memory=None)["lm"]
        assert lm.backend == "onnxruntime" and lm.key == "lm" and "no faster" in lm.reason and "int4" in lm.reason
    forced = plan_backends(_with_lm_ov("int8"), "openvino", BF16, installed=True)["lm"]
    assert forced.backend == "openvino" and forced.key == "lm_ov"


def test_the_stateful_lm_stays_on_onnxruntime_where_auto_says_why() -> None:
    for cpu in (AVX2, SKYLAKE):
        lm = plan_backends(_with_lm_ov(), "auto", cpu, installed=True, memory=None)["lm"]
        assert lm.backend == "onnxruntime" and "neither AMX, AVX-512 BF16 nor AVX-512 VNNI" in lm.reason, cpu
    missing = plan_backends(_with_lm_ov(), "auto", BF16, installed=False, memory=None)["lm"]
    assert missing.backend == "onnxruntime" and "openvino is not installed" in missing.reason
    explicit = plan_backends(_with_lm_ov(), "onnxruntime", BF16, installed=True)["lm"]
    assert explicit.backend == "onnxruntime" and explicit.reason == "--backend onnxruntime"
    forced = plan_backends(_with_lm_ov(), "openvino", AVX2, installed=True)["lm"]  # --backend openvino: everywhere
    assert forced.backend == "openvino" and forced.key == "lm_ov" and forced.reason == "--backend openvino"


def test_a_missing_openvino_lm_is_advised_only_for_the_families_that_can_have_one() -> None:
    for family in ("cosyvoice2", "cosyvoice3"):
        lm = plan_backends(_graphs(), "auto", BF16, installed=True, memory=None, family=family)["lm"]
        assert lm.backend == "onnxruntime"
        assert "--openvino int8 --openvino-lm int4" in lm.reason and "1.35x" in lm.reason, lm.reason
    v1 = plan_backends(_graphs(), "auto", BF16, installed=True, memory=None, family="cosyvoice")["lm"]
    assert v1.backend == "onnxruntime" and "only of the Qwen2 LM" in v1.reason  # CosyVoice-300M's LM has none
    assert "--openvino" not in v1.reason
    avx2 = plan_backends(_graphs(), "auto", AVX2, installed=True, memory=None, family="cosyvoice2")["lm"]
    assert "none needed" in avx2.reason and "--openvino" not in avx2.reason
