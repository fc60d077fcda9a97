"""Which vector kernels this CPU gets, read the way the kernels' own dispatch reads it, and the floor below which
the wheels we ship cannot run at all.

NumPy, onnxruntime (MLAS) and OpenVINO choose their kernels at run time from ``cpuid`` (x86) or the kernel's
hwcaps (arm64). ``/proc/cpuinfo`` usually says the same, but not under qemu's user-mode emulation, where it is the
host's file while ``cpuid`` answers for the emulated CPU. NumPy exposes its ``cpuid`` reading as
``__cpu_features__``; taking that view makes an emulated Atom take the decisions a real one would. NumPy does not
report every feature (AVX-VNNI, AMX; arm64 ``i8mm`` and ``bf16``): those come from ``/proc/cpuinfo``, and only
where NumPy's view confirms the base they extend (so a host's AMX does not leak into an emulated Atom).

Instruction-set floors of the x86-64 wheels the runtime loads:

- NumPy: the wheel's ``__cpu_baseline__``; "SSE4.2 on x86-64" by default (https://numpy.org/devdocs/building/
  cpu_simd.html), ``X86_V2`` (SSE3, SSSE3, SSE4.1, SSE4.2, POPCNT) in the NumPy 2.4 wheels installed here. Below
  it NumPy refuses to import with a ``RuntimeError`` (https://numpy.org/devdocs/reference/simd/build-options.html).
- onnxruntime: no documented floor; MLAS picks its SSE, AVX, AVX2 or AVX-512 kernels at run time from ``cpuid``
  (its maintainers: microsoft/onnxruntime#7010). Its non-AVX2 kernels have not been run on this project's graphs.
- OpenVINO (optional extra): "Intel Atom processor with Intel SSE4.2 support" (https://docs.openvino.ai/
  systemrequirements); ``--backend auto`` picks it only on CPUs with AVX-512 VNNI anyway.

So the refusal left is NumPy's own, explained (:func:`floor_problem`); a wheel that crashes with ``SIGILL`` anyway
is caught by :func:`cosyvoice_cpu.probes.calibrate.probe_kernels` in a child process (``cosyvoice-cpu doctor``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# NumPy's feature names (``__cpu_features__`` keys) -> the kernel's /proc/cpuinfo names; the merged set uses these
NUMPY_TO_CPUINFO = {
    "SSE": "sse",
    "SSE2": "sse2",
    "SSE3": "pni",
    "SSSE3": "ssse3",
    "SSE41": "sse4_1",
    "SSE42": "sse4_2",
    "POPCNT": "popcnt",
    "AVX": "avx",
    "F16C": "f16c",
    "FMA3": "fma",
    "AVX2": "avx2",
    "AVX512F": "avx512f",
    "AVX512CD": "avx512cd",
    "AVX512BW": "avx512bw",
    "AVX512DQ": "avx512dq",
    "AVX512VL": "avx512vl",
    "AVX512VNNI": "avx512_vnni",
    "AVX512BF16": "avx512_bf16",
    "AVX512FP16": "avx512_fp16",
    "ASIMD": "asimd",
    "ASIMDHP": "asimdhp",
    "ASIMDDP": "asimddp",
    "ASIMDFHM": "asimdfhm",
    "SVE": "sve",
}
# cpuinfo-only vector features and the base NumPy's view must confirm before they are believed
_NEEDS = (
    ("amx", "avx512f"),
    ("avx512", "avx512f"),
    ("avx", "avx2"),
    ("i8mm", "asimd"),
    ("bf16", "asimd"),
    ("sve", "asimd"),
)


def numpy_cpu_features() -> tuple[dict[str, bool] | None, str | None]:
    """(NumPy's ``cpuid`` reading, None), or (None, NumPy's refusal) when NumPy cannot load on this CPU, or
    (None, None) when this NumPy has no such dict."""
    try:
        try:
            from numpy._core._multiarray_umath import __cpu_features__  # NumPy 2
        except ImportError:
            from numpy.core._multiarray_umath import __cpu_features__  # NumPy 1.x
    except RuntimeError as e:  # "NumPy was built with baseline optimizations: (X86_V2) but your machine doesn't..."
        return None, str(e)
    except ImportError:
        return None, None
    return {str(k): bool(v) for k, v in __cpu_features__.items()}, None


def merge_features(cpuinfo_flags: frozenset[str], cpuid: Mapping[str, bool] | None) -> frozenset[str]:
    """The CPU's features in /proc/cpuinfo names, as the kernels' dispatch sees them.

    With ``cpuid`` (NumPy's ``__cpu_features__``) every feature NumPy knows is taken from it; a vector feature only
    cpuinfo names (``avx_vnni``, ``amx_*``, ``i8mm``...) is kept when ``cpuid`` confirms its base (:data:`_NEEDS`);
    other cpuinfo flags (``hypervisor``, ``lm``...) pass through. Without ``cpuid``: the cpuinfo flags as they are.
    """
    if cpuid is None:
        return cpuinfo_flags
    known = {NUMPY_TO_CPUINFO[k] for k in cpuid if k in NUMPY_TO_CPUINFO}
    seen = {NUMPY_TO_CPUINFO[k] for k, on in cpuid.items() if on and k in NUMPY_TO_CPUINFO}
    for flag in cpuinfo_flags - known:
        base = next((b for prefix, b in _NEEDS if flag.startswith(prefix)), None)
        if base is None or base in seen:
            seen.add(flag)
    return frozenset(seen)


def kernel_level(arch: str, flags: frozenset[str]) -> str:
    """The best kernel family onnxruntime's MLAS can pick here, e.g. "AVX2 (FMA)", "SSE4.1", "NEON + dot product"."""
    if arch == "x86_64":
        if {"amx_bf16", "amx_int8"} & flags:
            return "AMX (with AVX-512 VNNI)" if "avx512_vnni" in flags else "AMX"
        if "avx512f" in flags:
            return "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512"
        if "avx2" in flags and "fma" in flags:
            return "AVX2 + AVX-VNNI" if "avx_vnni" in flags else "AVX2 (FMA)"
        if "avx" in flags:
            return "AVX (no AVX2/FMA)"
        return "SSE4.1" if "sse4_1" in flags else "SSE2"
    if arch == "aarch64":
        extra = [
            name
            for flag, name in (("asimddp", "dot product (asimddp)"), ("i8mm", "i8mm"), ("bf16", "bf16"))
            if flag in flags
        ]
        return " + ".join(["NEON", *extra])
    return f"unknown ({arch})"


def speed_expectation(arch: str, flags: frozenset[str]) -> str:
    """One sentence: how this CPU's kernels relate to the machines docs/benchmarks.md was measured on. No numbers
    are given for what was not measured."""
    measured = (
        "the machines docs/benchmarks.md was measured on (Xeon Sapphire Rapids, AMD Zen 3/4/5, 2 cores "
        "each; all AVX2 or better)"
    )
    if arch == "x86_64" and "avx2" in flags and "fma" in flags:
        return f"the kernel class of {measured}; `doctor --speed` compares this machine's kernel speeds with theirs"
    if arch == "x86_64":
        width = "256-bit AVX kernels without FMA" if "avx" in flags else "128-bit SSE kernels"
        return (
            f"onnxruntime runs its {width} here and NumPy its non-AVX2 loops: expect it slower than {measured}, "
            "by an amount not measured here (run only under qemu's emulation, which checks the kernels' numerics, "
            "not their speed); `doctor --speed` times this machine, and a bench report of it is welcome (README, "
            "'Platforms')"
        )
    if arch == "aarch64":
        int8 = (
            "int8 products use the dot-product instructions"
            if "asimddp" in flags
            else "no dot-product instructions: int8 products are slow, prefer the fp32 or int4 recipes"
        )
        return (
            f"onnxruntime runs its NEON kernels ({int8}); arm64 was run here only under qemu's emulation (numerics "
            f"checked against x86, speed not), so nothing relates it to {measured}: `doctor --speed` times this "
            "machine"
        )
    return f"{arch} has not been run here: `doctor --speed` times this machine"


def floor_problem(arch: str, numpy_error: str | None) -> str | None:
    """The explanation when this CPU is below a shipped wheel's floor (so far: NumPy refused to load); else None."""
    if numpy_error is None:
        return None
    return (
        f"NumPy cannot run on this CPU ({arch}): {numpy_error.strip()} Install a NumPy built for it: "
        "`pip install --no-binary numpy numpy -Csetup-args=-Dcpu-baseline=none` (or an older NumPy whose "
        "wheels' baseline this CPU meets); onnxruntime itself picks its kernels at run time"
    )
