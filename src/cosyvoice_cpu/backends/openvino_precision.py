"""The compute precision OpenVINO's CPU plugin gets for a model that is not stateful (the flow estimator).

OpenVINO's own default was bf16 on the Intel core without AMX where it was read. Ours (docs/backends.md, "The
estimator's precision"):

- bf16 with AMX, and with AVX-512 BF16 on a core of :data:`BF16_VENDORS`: the CPUs where the bf16 estimator was
  measured faster than ONNX Runtime's (against f32 only on a Zen 5, where bf16 was the faster);
- f32 elsewhere: an Intel core with AVX-512 BF16 but no AMX, where OpenVINO's bf16 matrix products measured slower
  than its f32 ones and the int8 estimator ran faster in f32; a CPU whose vendor is unknown; a CPU without bf16.

The rule reads the CPU as :func:`~cosyvoice_cpu.hardware.cpu.detect` does (cpuid's features), so the plan's reason
(:func:`~cosyvoice_cpu.backends.plan.plan_backends`) and the compile agree. A stateful LM has its own properties
(:mod:`cosyvoice_cpu.backends.openvino_lm`: f32 everywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosyvoice_cpu.hardware.cpu import CpuInfo

PRECISIONS = ("bf16", "f32")  # the INFERENCE_PRECISION_HINT values the backend sets
# Vendors whose cores with AVX-512 BF16 but no AMX ran the bf16 estimator faster than ONNX Runtime (AMD Zen 4/5)
BF16_VENDORS = frozenset({"AuthenticAMD"})


def precision_for_cpu(cpu: CpuInfo | None = None) -> str:
    """``bf16`` or ``f32`` for ``cpu`` by the rule of the module doc (None: this machine's, as ``detect`` reads it;
    an unreadable CPU gets f32)."""
    if cpu is None:
        from cosyvoice_cpu.hardware.cpu import detect

        cpu = detect().cpu
    if cpu is None:
        return "f32"
    return "bf16" if cpu.amx or (cpu.bf16 and cpu.vendor in BF16_VENDORS) else "f32"
