"""What the bench reads of the machine around its measurements: energy counters, the peak RSS."""

from __future__ import annotations

import resource
from pathlib import Path

from cosyvoice_cpu.hardware.pages import status_mb

POWERCAP = Path("/sys/class/powercap")


def energy_counters() -> dict[str, Path]:
    """Readable RAPL/powercap energy counters (microjoules) by zone name; empty when none is readable."""
    found = {}
    for zone in sorted(POWERCAP.glob("*:*")) if POWERCAP.is_dir() else []:
        f = zone / "energy_uj"
        try:
            int(f.read_text())
        except (OSError, ValueError):
            continue
        name = zone / "name"
        found[name.read_text().strip() if name.is_file() else zone.name] = f
    return found


def read_energy_j(counters: dict[str, Path]) -> float | None:
    """The counters' sum in joules, or None without counters (wrap-around is ignored: runs are short)."""
    return sum(int(f.read_text()) for f in counters.values()) / 1e6 if counters else None


def peak_rss_mb() -> float:
    """Peak resident set size of this process image so far (MB): ``VmHWM``, else ``ru_maxrss``.

    ``ru_maxrss`` survives ``fork`` + ``exec``: a task child started by a parent that had just written and exported
    the full-size fixture (GBs of torch) reported the parent's peak as its own. ``VmHWM`` belongs to the new image.
    """
    peak = status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
