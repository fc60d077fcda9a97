"""How fast this machine runs what the engine spends its time on: a few seconds of kernel timings.

Development machines of 2 cores each ran the same engine on the same export at very different end-to-end speeds
(docs/benchmarks.md, "The four machines"): memory bandwidth and ORT's kernel speed differ several-fold between
CPUs that look alike on paper (the Zen 5 and the Xeon: both AVX-512 + VNNI). A bench result therefore carries
these numbers, so results of different days and machines can be compared, and ``cosyvoice-cpu doctor --speed``
prints them next to those of the machines the docs were measured on.

What is timed (best of several runs after a warm-up; ORT sessions as the engine opens them, spinning off):

- ``copy_gb_s``: NumPy copy between two preallocated 64 MiB buffers, bytes read + written per second (the LM's
  decode reads ~0.4 GB of weights per token, so this bounds it);
- ``sgemm_gflops``: ORT fp32 ``MatMul`` (512 x 1024) x (1024 x 1024);
- ``qgemm_gops``: ORT ``MatMulInteger`` uint8 x int8 of the same size (the dynamically quantized estimator's
  products);
- ``attention_ms``: one ORT ``MultiHeadAttention`` (flash kernel) at one CosyVoice2 estimator block's shape,
  batch 2 (CFG) x 650 frames x 8 heads x 64; a whole-sentence Euler step runs 56 of them.

Only NumPy and onnxruntime are used; the graphs are packaged files (``cosyvoice_cpu/calibration``, made by
:mod:`cosyvoice_cpu.export.calibration_graphs`). :func:`probe_kernels` runs the same kernels once in a child process
(``cosyvoice-cpu doctor``), so a wheel built for a newer CPU (``SIGILL``) becomes an explanation, not a crash.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import GraphSession, SessionConfig
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

GRAPHS = Path(__file__).resolve().parents[1] / "calibration"
GEMM_SHAPE = (512, 1024, 1024)  # m, k, n
ATTENTION_SHAPE = (2, 650, 512)  # batch (CFG), frames, 8 heads x 64
COPY_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Calibration:
    """Kernel speeds of this machine at ``threads`` intra-op threads (see the module docstring)."""

    threads: int
    copy_gb_s: float
    sgemm_gflops: float
    qgemm_gops: float
    attention_ms: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> Calibration:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def summary(self) -> str:
        """One line, e.g. ``copy 15.1 GB/s; ORT fp32 GEMM 134 GFLOP/s, int8 GEMM 772 GOPS, attention 16.3 ms
        (2 threads)``."""
        return (
            f"copy {self.copy_gb_s:.1f} GB/s; ORT fp32 GEMM {self.sgemm_gflops:.0f} GFLOP/s, int8 GEMM "
            f"{self.qgemm_gops:.0f} GOPS, attention block {self.attention_ms:.1f} ms "
            f"({self.threads} threads)"
        )


# Measured with `cosyvoice-cpu doctor --speed` on the machines docs/benchmarks.md was measured on, for comparison.
REFERENCE_MACHINES: dict[str, Calibration] = {
    # medians of 5 calibrations during the session (each value moved a lot between them: shared host; measured:
    # docs/benchmarks-log.md, "2026-12-01: CosyVoice2 on an Intel Xeon")
    "Intel Xeon (Sapphire Rapids) VM, 2 cores, 2026-12-01: CosyVoice2 int8w e2e RTF 2.42": Calibration(
        threads=2, copy_gb_s=19.1, sgemm_gflops=164.0, qgemm_gops=1279.0, attention_ms=13.7
    ),
    # medians of 4 (three doctor --speed, the bench's own); AVX2 only: int8 GEMMs without VNNI
    "AMD EPYC Zen 3 VM, 2 cores, 2026-12-01: CosyVoice2 int8w e2e RTF 3.96": Calibration(
        threads=2, copy_gb_s=11.7, sgemm_gflops=124.0, qgemm_gops=252.0, attention_ms=17.0
    ),
    # medians of 4 (three doctor --speed, the bench's own); AVX-512 VNNI on 256-bit units, decode DRAM-bound
    "AMD EPYC Zen 4 VM, 2 cores, 2026-12-02: CosyVoice2 int8w e2e RTF 2.18": Calibration(
        threads=2, copy_gb_s=23.9, sgemm_gflops=184.0, qgemm_gops=743.0, attention_ms=10.7
    ),
    # medians of 3 (one doctor --speed, two benches' own); family 6 model 207 with AMX hidden by the hypervisor:
    # AVX-512 VNNI int8 kernels, the OpenVINO estimator in f32 (docs/benchmarks-log.md, "2026-12-07 (stop 63)")
    "Intel Xeon VM without AMX, 2 cores, 2026-12-07: CosyVoice2 int8w e2e RTF 1.95": Calibration(
        threads=2, copy_gb_s=13.8, sgemm_gflops=204.0, qgemm_gops=708.0, attention_ms=9.9
    ),
}


# The copy rate (read + written) below which the LM's decode was bound by memory bandwidth on every machine
# measured: the Xeon, the Zen 4 and the Zen 3 copy below it and decoded int8w at a fraction of the Zen 5's rate,
# and int4 weights decoded faster there; the Zen 5 copies above it (by another measure) and decoded near its
# kernels' ceiling (measured: docs/benchmarks.md, "The four machines" and "What limits each stage";
# docs/benchmarks-log.md, "2026-12-01: CosyVoice2 on an Intel Xeon").
DRAM_BOUND_GB_S = 30.0


def speed_notes(cal: Calibration) -> list[str]:
    """What the calibration says a user should know (``doctor --speed``): [] when nothing stands out."""
    notes = []
    if cal.copy_gb_s < DRAM_BOUND_GB_S:
        notes.append(
            f"memory copies at {cal.copy_gb_s:.0f} GB/s: the LM reads ~0.4 GB of int8w weights per decoded token, "
            f"so expect its decode bound by memory bandwidth (24-40 tokens/s on the machines measured at 12-26 "
            f"GB/s; 25 is real time). An LM exported with --quant int4 decoded 1.19-1.28x faster on them, at an "
            f"agreement cost (docs/quantization.md)"
        )
    return notes


def best_seconds(fn: Callable[[], object], budget_s: float, warmup: int = 2, min_runs: int = 3) -> float:
    """The fastest of repeated calls of ``fn`` after ``warmup`` untimed ones, running at least ``min_runs``
    and until ``budget_s`` seconds have been spent timing."""
    for _ in range(warmup):
        fn()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < min_runs or spent < budget_s:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def _session(name: str, threads: int) -> GraphSession:

    path = GRAPHS / name
    if not path.is_file():
        raise ConfigError(f"calibration graph {path} is missing: reinstall cosyvoice-cpu")
    return open_graph(path, SessionConfig(threads=threads, release_weight_pages=False))


def calibrate(threads: int, budget_s: float = 0.5, scale: float = 1.0) -> Calibration:
    """Time the four kernels of the module docstring with ``threads`` intra-op threads.

    Args:
        threads: ORT intra-op threads (the engine's ``EngineConfig.threads``).
        budget_s: seconds of timed runs per kernel (plus warm-up): ~4 budgets in all.
        scale: shrinks every size (tests use small values); numbers are comparable only at 1.0.
    """
    if threads < 1 or budget_s <= 0 or not 0 < scale <= 1:
        raise ConfigError(
            f"calibrate wants threads >= 1, budget_s > 0 and 0 < scale <= 1, got {threads}, {budget_s}, {scale}"
        )
    rng = np.random.default_rng(0)
    n_copy = max(1, int(COPY_BYTES * scale)) // 8
    src, dst = rng.standard_normal(n_copy), np.empty(n_copy)
    copy_s = best_seconds(lambda: np.copyto(dst, src), budget_s)

    m, k, n = (max(8, int(d * scale)) for d in GEMM_SHAPE)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    sgemm = _session("sgemm.onnx", threads)
    sgemm_s = best_seconds(lambda: sgemm.run(None, {"a": a, "b": b}), budget_s)
    qa = rng.integers(0, 256, (m, k), dtype=np.uint8)
    qb = rng.integers(-128, 128, (k, n), dtype=np.int8)
    qgemm = _session("qgemm.onnx", threads)
    qgemm_s = best_seconds(lambda: qgemm.run(None, {"a": qa, "b": qb}), budget_s)

    batch, frames, width = ATTENTION_SHAPE
    frames = max(8, int(frames * scale))
    qkv = {x: rng.standard_normal((batch, frames, width), dtype=np.float32) for x in ("q", "k", "v")}
    attention = _session("attention.onnx", threads)
    attention_s = best_seconds(lambda: attention.run(None, qkv), budget_s)
    result = Calibration(
        threads=threads,
        copy_gb_s=round(2 * src.nbytes / copy_s / 1e9, 2),
        sgemm_gflops=round(2 * m * k * n / sgemm_s / 1e9, 1),
        qgemm_gops=round(2 * m * k * n / qgemm_s / 1e9, 1),
        attention_ms=round(attention_s * 1e3, 2),
    )
    logger.info("calibration: %s", result.summary())
    return result


# the probe's child runs the calibration kernels at a tiny size, then prints the CPU features its NumPy saw
PROBE = (
    "from cosyvoice_cpu.probes.calibrate import calibrate; calibrate(1, budget_s=0.01, scale=0.05)\n"
    "from cosyvoice_cpu.hardware.features import numpy_cpu_features\n"
    "print(' '.join(sorted(k for k, on in (numpy_cpu_features()[0] or {}).items() if on)))"
)


def probe_kernels(
    timeout: float = 120.0, code: str = PROBE, cpuid: Mapping[str, bool] | None = None, python: str | None = None
) -> tuple[str | None, str | None]:
    """Run NumPy and onnxruntime's GEMM and attention kernels once in a child process: (problem, note), None
    where there is nothing to say.

    A wheel built for a newer CPU stops the process with ``SIGILL`` (Illegal instruction), which no ``except``
    catches: in a child it becomes the problem's explanation. With ``cpuid`` (this process's NumPy view) the note
    says when the child saw another CPU: under qemu's user mode a child process runs natively unless binfmt_misc
    sends it to qemu, and then the probe vouches for the host, not the emulated CPU. ``code`` is what the child
    runs (tests replace it); its last line of output is the features it saw. A child that cannot start at all
    (``Exec format error``: an arm64 Python under ``qemu-aarch64`` without binfmt_misc) gives a note, not a problem.
    """
    try:
        p = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"the kernel probe (NumPy and onnxruntime in a child process) did not finish in {timeout:g} s", None
    except OSError as e:
        return None, (
            f"the kernel probe could not start its child process ({e}), so it did not run; under qemu's user mode "
            "without binfmt_misc an emulated Python cannot start another"
        )
    if p.returncode == -signal.SIGILL:
        return (
            "a child process running NumPy's and onnxruntime's kernels (calibration GEMMs) died of SIGILL "
            "(Illegal instruction): a wheel here was built for a newer CPU than this one. Find which with "
            "`python -c 'import numpy'` and `python -c 'import onnxruntime'`, build that one from source for this "
            "CPU, and please report it with `cosyvoice-cpu doctor` output (README, 'Platforms')"
        ), None
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"the kernel probe (NumPy and onnxruntime in a child process) failed with exit {p.returncode}: {tail}",
            None,
        )
    logger.debug("kernel probe ran")
    if cpuid is None:
        return None, None
    seen = set((p.stdout.strip().splitlines() or [""])[-1].split())
    mine = {k for k, on in cpuid.items() if on}
    if seen == mine:
        return None, None
    more, less = " ".join(sorted(seen - mine)) or "none more", " ".join(sorted(mine - seen)) or "none"
    return None, (
        f"the kernel probe's child process saw other CPU features than this one (it has {more}; lacks {less}): "
        "under qemu's user mode a child runs natively unless binfmt_misc sends it to qemu, so the probe ran the "
        "host's kernels, not this CPU's"
    )
