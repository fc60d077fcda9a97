"""Give a graph's weight file back to the kernel once ONNX Runtime has copied what its kernels read (Linux).

ORT memory-maps a graph's external data (``<graph>.onnx.data``) when it opens the graph. Kernels that pack their
weights at load (``MatMulNBits`` with int8 compute, as the LM's) copy them into ORT's own memory then, but ORT
keeps the mapping, and the pages the packing touched stay resident although no kernel reads them again: the
block scales of the full-size CosyVoice2 LM, 44 MB (``MatMulNBits`` keeps its scales input unpacked; its kernels
read the packed copy). :func:`release_file_pages` asks the kernel to reclaim them (``madvise(MADV_PAGEOUT)``).
That never changes what the mapping reads: a clean page is read from the file again if it is ever touched, a
modified one is swapped out or kept. So it is safe on any address range, even one unmapped and reused in
between. Kernels that read the file at run time (fp32-compute ``MatMulNBits``, convolutions) touch their pages
first at their first run, so at load there is nothing of theirs to release.

:func:`status_mb` reads a process's memory fields (``VmRSS``, ``VmHWM``) for the benchmarks and the server.

Nothing here runs at import; off Linux (no ``/proc/self/smaps``) or on kernels before 5.4 (no
``MADV_PAGEOUT``) every function returns 0 and nothing happens.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

MADV_PAGEOUT = 21  # <asm-generic/mman-common.h>, Linux >= 5.4
SMAPS = Path("/proc/self/smaps")


def mappings(smaps: Path = SMAPS) -> list[tuple[int, int, str, int, frozenset[str]]]:
    """This process's mappings: ``(start, end, path or "", resident bytes, VmFlags)`` each (flags such as
    ``"nh"``, ``MADV_NOHUGEPAGE``); [] off Linux."""
    try:
        text = smaps.read_text()
    except OSError:
        return []
    spans: list[list[int | str | frozenset[str]]] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode path
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append([start, end, fields[5] if len(fields) == 6 else "", 0, frozenset()])
        elif fields[0] == "Rss:" and spans:
            spans[-1][3] = int(fields[1]) * 1024
        elif fields[0] == "VmFlags:" and spans:
            spans[-1][4] = frozenset(line.split()[1:])
    return [(s, e, p, r, f) for s, e, p, r, f in spans]


def span_resident_bytes(start: int, length: int) -> int:
    """Bytes of the address range ``[start, start + length)`` that are resident (``mincore``); 0 off Linux.

    Exact for one array, unlike :func:`mappings`: the kernel merges adjacent anonymous mappings with the same
    flags into one, so a mapping's ``Rss`` may count memory of its neighbours (a probe: a fresh 192 MB
    anonymous mapping, as :func:`~cosyvoice_cpu.lm.kv_cache.zero_pages` made before it set ``MADV_NOHUGEPAGE``, shared
    its smaps entry with resident buffers mapped before it; docs/benchmarks-log.md, "Memory"). The range must be mapped.
    """
    if not sys.platform.startswith("linux") or length <= 0:
        return 0
    import ctypes  # here, not at import time

    page = os.sysconf("SC_PAGE_SIZE")
    lo = start - start % page
    pages = (start + length - lo + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), f"mincore: {os.strerror(ctypes.get_errno())}")
    return sum(b & 1 for b in bytes(vec)) * page


def file_mappings(path: str | Path, smaps: Path = SMAPS) -> list[tuple[int, int, int]]:
    """This process's mappings of ``path``: ``(start, end, resident bytes)`` each; [] when none or off Linux."""
    target = os.path.realpath(path)
    return [(s, e, r) for s, e, p, r, _ in mappings(smaps) if p == target]


def resident_bytes(path: str | Path) -> int:
    """Bytes of ``path`` resident in this process's mappings of it."""
    return sum(rss for _, _, rss in file_mappings(path))


def release_file_pages(path: str | Path) -> int:
    """Ask the kernel to reclaim this process's resident pages of ``path``; return how many bytes were resident.

    For a file ORT has mapped and no longer reads (see the module docstring). Data-safe for any mapping; a no-op
    returning 0 off Linux, for a file not mapped, and on kernels without ``MADV_PAGEOUT``.
    """
    if not sys.platform.startswith("linux") or not os.path.isfile(path):  # e.g. a graph without external data
        return 0
    spans = [(s, e, r) for s, e, r in file_mappings(path) if r]
    if not spans:
        return 0
    import ctypes  # here, not at import time

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for start, end, rss in spans:
        if madvise(start, end - start, MADV_PAGEOUT) != 0:
            logger.debug("madvise(MADV_PAGEOUT) on %s failed: %s", path, os.strerror(ctypes.get_errno()))
            break  # EINVAL: a kernel before 5.4; the rest would fail the same way
        released += rss
    return released


def release_dir_pages(directory: str | Path) -> int:
    """:func:`release_file_pages` for every file under ``directory`` this process has mapped (OpenVINO's compiled-
    model cache: a model loaded from it maps its blob); bytes that were resident."""
    root = os.path.join(os.path.realpath(directory), "")
    paths = {p for _, _, p, r, _ in mappings() if r and p.startswith(root)}
    return sum(release_file_pages(p) for p in sorted(paths))


def status_mb(field: str, pid: int | str = "self") -> float | None:
    """A memory field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``, ...) of this process or another, in MB; None
    where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None
