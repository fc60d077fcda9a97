"""What this machine (or container) can run: CPU features, usable cores, memory, and the thread plan.

Everything is read from the OS (``/proc``, ``/sys``) and NumPy's ``cpuid`` reading (:mod:`.features`), *before*
onnxruntime is imported. Every reader takes a ``root`` directory so tests can point it at a fake filesystem.
"""

from __future__ import annotations

import logging
import math
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cosyvoice_cpu.errors import ConfigError, CosyVoiceCpuError
from cosyvoice_cpu.hardware.features import floor_problem, merge_features, numpy_cpu_features
from cosyvoice_cpu.hardware.topology import big_cpus, ranges, read_capacity

if TYPE_CHECKING:
    from cosyvoice_cpu.manifest import GraphEntry, Manifest

logger = logging.getLogger(__name__)

SKIP_CHECK_ENV = "COSYVOICE_CPU_SKIP_CPU_CHECK"
ROOT = Path("/")


class UnsupportedCpuError(CosyVoiceCpuError):
    """The CPU is below the instruction-set floor of a wheel the runtime loads (hardware/features.py)."""


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


@dataclass(frozen=True)
class CpuInfo:
    """Facts of ``/proc/cpuinfo``: model name, flags of the first CPU, logical and physical core counts.

    ``flags`` are x86 ``flags`` or arm64 ``Features``; :func:`detect` replaces them with what ``cpuid`` says
    (:func:`~cosyvoice_cpu.hardware.features.merge_features`). ``arch`` is "x86_64", "aarch64" or another name.
    ``vendor`` is x86's ``vendor_id`` ("GenuineIntel", "AuthenticAMD"; "" where cpuinfo has none).
    """

    model: str
    flags: frozenset[str]
    logical: int
    physical: int
    core_of: tuple[tuple[int, str], ...] = ()  # (processor id, "physical id/core id") pairs
    arch: str = ""
    vendor: str = ""

    def physical_in(self, cpus: set[int]) -> int | None:
        """Distinct physical cores among logical CPUs ``cpus`` (None when cpuinfo has no core ids)."""
        if not self.core_of:
            return None
        return len({core for cpu, core in self.core_of if cpu in cpus}) or None

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags and "fma" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def vnni(self) -> bool:
        """int8 dot products (AVX-512 VNNI or AVX-VNNI): fast u8s8 GEMMs without saturation."""
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def bf16(self) -> bool:
        """bf16 dot products in AVX-512 (``avx512_bf16``): OpenVINO's bf16 kernels run natively."""
        return "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        """Intel AMX tiles (bf16 and int8 matrix units, Sapphire Rapids and later)."""
        return bool({"amx_bf16", "amx_int8"} & self.flags)

    @property
    def isa(self) -> str:
        """A short label of the int8 kernel family (bench reports): avx512-vnni ... sse2, neon-i8mm, neon-dot, neon."""
        if self.arch == "aarch64":
            return "neon-i8mm" if "i8mm" in self.flags else "neon-dot" if "asimddp" in self.flags else "neon"
        if self.avx512 and self.vnni:
            return "avx512-vnni"
        if self.avx2 and self.vnni:
            return "avx2-vnni"
        if self.avx512 or self.avx2:
            return "avx512" if self.avx512 else "avx2"
        return "avx" if "avx" in self.flags else "sse4" if "sse4_1" in self.flags else "sse2"


def read_cpuinfo(root: Path = ROOT) -> CpuInfo | None:
    """Parse ``/proc/cpuinfo`` (x86 or arm64 Linux); None where it does not exist (other OSes)."""
    text = _read(root, "proc/cpuinfo")
    if not text:
        return None
    model, flags, arch, vendor = "", frozenset(), "", ""
    logical, cores, core_of = 0, set(), []
    processor = physical_id = core_id = None
    for line in text.splitlines() + [""]:
        if not line.strip():  # end of one processor block
            if core_id is not None:
                cores.add((physical_id, core_id))
                if processor is not None:
                    core_of.append((processor, f"{physical_id}/{core_id}"))
            processor = physical_id = core_id = None
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            logical += 1
            processor = int(value) if value.isdigit() else None
        elif key == "model name" and not model:
            model = value
        elif key == "vendor_id" and not vendor:
            vendor = value
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
            arch = "x86_64" if key == "flags" else "aarch64" if "asimd" in flags else "arm"
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            core_id = value
    return CpuInfo(model or "unknown CPU", flags, logical, len(cores) or logical, tuple(core_of), arch, vendor)


def cgroup_cpu_limit(root: Path = ROOT) -> float | None:
    """CPUs allowed by the cgroup quota (v2 ``cpu.max`` or v1 ``cfs_quota_us``), None when unlimited."""
    v2 = _read(root, "sys/fs/cgroup/cpu.max")
    if v2:
        quota, _, period = v2.strip().partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota_s = _read(root, "sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    period_s = _read(root, "sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota_s and period_s and int(quota_s) > 0:
        return int(quota_s) / int(period_s)
    return None


def memory_bytes(root: Path = ROOT) -> tuple[int | None, int | None, int | None]:
    """(total, available, cgroup limit) in bytes; None for what cannot be read or is unlimited."""
    total = available = None
    for line in (_read(root, "proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            kb = int(value.split()[0]) * 1024
            total, available = (kb, available) if key == "MemTotal" else (total, kb)
    limit = None
    for rel in ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read(root, rel)
        if text and text.strip().isdigit() and int(text) < (1 << 60):  # v1 "unlimited" is a huge number
            limit = int(text)
            break
    return total, available, limit


@dataclass
class Hardware:
    """The machine as the engine sees it, and the thread plan derived from it."""

    cpu: CpuInfo | None
    affinity: int  # logical CPUs this process may run on (cpuset / taskset)
    quota: float | None  # cgroup CPU quota in CPUs
    mem_total: int | None
    mem_available: int | None
    mem_limit: int | None
    notes: list[str] = field(default_factory=list)
    affinity_set: frozenset[int] = frozenset()  # the logical CPU ids, when known
    features_from: str = "/proc/cpuinfo"  # or "cpuid (NumPy)": where cpu.flags came from
    floor_error: str | None = None  # why a shipped wheel cannot run on this CPU (features.floor_problem)
    capacity: tuple[tuple[int, int], ...] = ()  # (logical CPU, relative speed) of the usable CPUs, from sysfs

    @property
    def usable_cores(self) -> int:
        """Physical cores we can really use: distinct cores of the affinity set, capped by the cgroup quota."""
        cores = self.cpu.physical_in(set(self.affinity_set)) if self.cpu and self.affinity_set else None
        if cores is None:  # no core ids: assume the allowed CPUs are spread like the machine's
            logical = self.affinity
            if self.cpu and self.cpu.logical:
                logical = round(self.affinity * self.cpu.physical / self.cpu.logical)
            cores = logical
        cores = max(1, cores)
        if self.quota is not None:
            cores = min(cores, max(1, math.floor(self.quota)))
        return cores

    @property
    def memory_for_us(self) -> int | None:
        """Bytes we may use: available memory, capped by the cgroup limit."""
        values = [v for v in (self.mem_available, self.mem_limit) if v is not None]
        return min(values) if values else None

    @property
    def big_cpus(self) -> frozenset[int]:
        """The usable logical CPUs of the fastest kind on a heterogeneous (big.LITTLE, P/E-core) CPU; empty when
        the usable CPUs are alike (or sysfs says nothing): :func:`~cosyvoice_cpu.hardware.topology.big_cpus`."""
        return big_cpus(self.capacity)

    @property
    def compute_cores(self) -> int:
        """Cores the thread plan computes on: the usable cores, or on a heterogeneous CPU its big ones only (a
        thread on a little core makes every parallel kernel wait for it), capped by the cgroup quota."""
        big = self.big_cpus
        if not big:
            return self.usable_cores
        cores = (self.cpu.physical_in(set(big)) if self.cpu else None) or len(big)
        return max(1, min(cores, self.usable_cores))

    def threads(self, leave_for_os: int = 0) -> int:
        """Default intra-op threads: :attr:`compute_cores` minus ``leave_for_os`` (at least 1)."""
        if leave_for_os < 0:
            raise ConfigError(f"leave_for_os must be >= 0, got {leave_for_os}")
        return max(1, self.compute_cores - leave_for_os)

    def thread_plan(self) -> str:
        """The default thread plan in words (``cosyvoice-cpu doctor``)."""
        big = self.big_cpus
        if not big:
            return f"{self.threads()} intra-op by default (usable physical cores)"
        speeds = sorted({c for _, c in self.capacity}, reverse=True)
        return (
            f"{self.threads()} intra-op by default: the big cores only, CPUs {ranges(big)} of "
            f"{ranges({cpu for cpu, _ in self.capacity})} (sysfs relative speeds {', '.join(map(str, speeds))})"
        )

    def check_cpu(self) -> None:
        """Raise :class:`UnsupportedCpuError` when this CPU is below a shipped wheel's instruction-set floor
        (hardware/features.py); ``COSYVOICE_CPU_SKIP_CPU_CHECK=1`` skips. CPUs without AVX2 run (on SSE/AVX kernels).
        """
        if self.floor_error is None or os.environ.get(SKIP_CHECK_ENV) == "1":
            return
        raise UnsupportedCpuError(f"{self.floor_error} ({SKIP_CHECK_ENV}=1 skips this check)")

    def memory_warning(self, model_bytes: int) -> str | None:
        """A warning when the model (plus per-request working memory) may not fit; None when it fits or unknown."""
        free = self.memory_for_us
        if free is None:
            return None
        # Full-size CosyVoice2 int8w, 10 s sentences: besides the model's resident files, one request needs
        # ~350 MB (Python and libraries, the shared activation arena, a voice's prompt cache, a stream's context)
        # and each further concurrent one ~120 MB, set from the peak RSS at 1, 4 and 8 streams (measured:
        # docs/benchmarks-log.md, "Memory" and "Concurrency")
        first, further = 352 << 20, 128 << 20
        if model_bytes + first > free:
            return (
                f"about {free / 2**30:.1f} GiB of memory is available but the model needs about "
                f"{(model_bytes + first) / 2**30:.1f} GiB: use a smaller recipe (int4) or free memory"
            )
        batch = 1 + (free - model_bytes - first) // further
        if batch < 4:
            return f"memory allows about {batch} concurrent request(s); keep the server's batch size at {batch}"
        return None

    def int8_warning(self, graphs: dict[str, GraphEntry]) -> str | None:
        """A warning when dynamic-int8 graphs with full 8-bit weights would run on a CPU without VNNI.

        ``graphs`` is the manifest's (key -> entry with ``precision`` and ``attrs``). Exports since the 7-bit
        change record ``attrs["int8_weight_bits"]``; older ones quantized the flow estimator with 7 bits and the
        LM with 8 (workshop/export_stages.INT8_WEIGHT_BITS tells what saturation costs).
        """
        if self.cpu is None or self.cpu.vnni or not self.cpu.avx2:
            return None
        full = sorted(
            key
            for key, g in graphs.items()
            if g.precision == "int8" and g.attrs.get("int8_weight_bits", 8 if key.startswith("lm") else 7) == 8
        )
        if not full:
            return None
        return (
            f"{', '.join(full)}: int8 weights with 8 bits on a CPU without VNNI ({self.cpu.model}): onnxruntime's "
            "int8 products saturate here and the output degrades (measured on a small LM: next-token agreement "
            "0.65 instead of 0.97). Re-export the model with this version (7-bit int8 weights) or with --quant int8w"
        )

    def model_warnings(self, manifest: Manifest, streaming_estimator: bool = True) -> list[str]:
        """:meth:`memory_warning` and :meth:`int8_warning` for a loaded model directory's manifest."""
        found = (self.memory_warning(manifest.resident_bytes(streaming_estimator)), self.int8_warning(manifest.graphs))
        return [w for w in found if w]


def detect(root: Path = ROOT, cpuid: dict[str, bool] | None = None) -> Hardware:
    """Read everything once (cheap: a few small files, and NumPy's ``cpuid`` reading for the real root).

    ``cpuid`` replaces NumPy's ``__cpu_features__`` (tests); for a ``root`` other than ``/`` without it, the
    features are cpuinfo's flags.
    """
    cpus: frozenset[int] = frozenset()
    try:
        if root == ROOT:
            cpus = frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        pass
    cpu = read_cpuinfo(root)
    floor, source = None, "/proc/cpuinfo"
    if cpuid is None and root == ROOT:
        cpuid, numpy_error = numpy_cpu_features()
        machine = platform.machine().lower()  # qemu's user mode reports the emulated CPU's
        arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
        floor = floor_problem(arch, numpy_error)
        if cpu:
            cpu = replace(cpu, arch=arch)
    if cpu and cpuid is not None:
        cpu, source = replace(cpu, flags=merge_features(cpu.flags, cpuid)), "cpuid (NumPy)"
    affinity = len(cpus) or (cpu.logical if cpu else (os.cpu_count() or 1))
    total, available, limit = memory_bytes(root)
    try:
        quota = cgroup_cpu_limit(root)
    except ValueError:
        quota = None
        logger.warning("the cgroup CPU quota file is malformed; ignoring it")
    capacity = read_capacity(root, sorted(cpus) or list(range(cpu.logical if cpu else affinity)))
    hw = Hardware(
        cpu,
        affinity,
        quota,
        total,
        available,
        limit,
        affinity_set=cpus,
        features_from=source,
        floor_error=floor,
        capacity=capacity,
    )
    if cpu and cpu.avx2 and not cpu.vnni:
        hw.notes.append(
            "no VNNI: onnxruntime's int8 products run only ~2x faster than fp32 on such a CPU, and the LM's decode "
            "is bound by memory bandwidth. On an AVX2-only AMD Zen 3 an LM exported with --quant int4 decoded "
            "1.28x faster than with the default int8w, at an agreement cost (docs/quantization.md)"
        )
    if cpu and affinity < cpu.logical:
        hw.notes.append(f"this process may use {affinity} of {cpu.logical} logical CPUs (cpuset/affinity)")
    if hw.quota is not None:
        hw.notes.append(f"the container's CPU quota is {hw.quota:g} CPUs")
    if limit is not None:
        hw.notes.append(f"the container's memory limit is {limit / 2**30:.1f} GiB")
    return hw
