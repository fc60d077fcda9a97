"""Heterogeneous cores (arm64 big.LITTLE, Intel P/E cores): which usable CPUs are the fast ones.

A parallel kernel splits its work evenly over its threads and waits for the last: one thread on a core at 40% of
the speed of the others (RK3588: Cortex-A55 ``cpu_capacity`` 414 next to Cortex-A76 1024) makes every kernel wait
for it. The thread plan therefore computes on the big cores only (:attr:`~cosyvoice_cpu.hardware.cpu.Hardware.
compute_cores`). Read from sysfs with the standard library; ``root`` lets tests build a fake tree.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# a CPU below this fraction of the fastest one is a "little" core; one boost step more on a few cores of a server
# (Intel Turbo Boost Max 3.0: ~5% higher maximum clock) stays above it, an RK3588's A55 (414/1024) and an Alder
# Lake E-core's clock (~3.6 of ~4.7 GHz) fall below it
BIG_FRACTION = 0.9


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def read_capacity(root: Path, cpus: list[int]) -> tuple[tuple[int, int], ...]:
    """(CPU, relative speed) for ``cpus`` from sysfs: ``cpu_capacity`` (arm64, and hybrid x86 on recent kernels),
    else each core's maximum clock (``cpufreq/cpuinfo_max_freq``, kHz); empty unless every CPU has that value."""
    for rel in ("cpu_capacity", "cpufreq/cpuinfo_max_freq"):
        found = [(cpu, _read(root / f"sys/devices/system/cpu/cpu{cpu}/{rel}")) for cpu in cpus]
        if found and all(v.isdigit() and int(v) > 0 for _, v in found):
            return tuple((cpu, int(v)) for cpu, v in found)
    return ()


def big_cpus(capacity: tuple[tuple[int, int], ...]) -> frozenset[int]:
    """The CPUs of ``capacity`` within :data:`BIG_FRACTION` of the fastest; empty when all are (a homogeneous
    CPU, or only one kind of core usable)."""
    if not capacity:
        return frozenset()
    top = max(c for _, c in capacity)
    big = frozenset(cpu for cpu, c in capacity if c >= BIG_FRACTION * top)
    if len(big) < len(capacity):
        logger.debug("heterogeneous CPUs: big %s of %s", ranges(big), ranges({cpu for cpu, _ in capacity}))
        return big
    return frozenset()


def ranges(cpus: set[int] | frozenset[int]) -> str:
    """``{0, 1, 2, 3, 6}`` -> ``"0-3,6"``."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(cpu - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)
