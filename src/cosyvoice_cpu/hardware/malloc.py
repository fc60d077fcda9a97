"""glibc's malloc in this process: the mmap threshold that keeps big freed buffers returnable, and how much memory
its heaps hold free. Both are no-ops (False / None) off glibc; ``ctypes`` is loaded when they are called.
"""

from __future__ import annotations

import logging
import os

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start-up; an explicit value there wins


def fix_mmap_threshold(nbytes: int) -> bool:
    """Make glibc's malloc give every allocation of at least ``nbytes`` its own mapping (returned to the OS
    when freed) and stop it from moving that threshold; True if set.

    glibc raises the threshold (up to 32 MiB) each time a mapped block is freed, so after the first big NumPy or
    ORT buffers come and go, later ones are carved from its heaps, and freed there they stay resident as free
    heap memory (measured after the bench's streamed sentences, full-size CosyVoice2, ``bench/memory_steps.py``:
    docs/benchmarks-log.md, "Memory"). A fixed threshold keeps them returnable. Process-wide; a no-op (False) off
    glibc or when ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (the operator's choice wins).
    """
    if not 0 < nbytes <= 32 << 20:
        raise ConfigError(f"mmap threshold must be 1 byte to 32 MiB, got {nbytes}")
    if os.environ.get(MMAP_THRESHOLD_ENV):
        return False
    import ctypes  # here, not at import time

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its heaps (freed, not returned to the OS: ``mallinfo2().fordblks``);
    None off glibc or before glibc 2.33."""
    import ctypes  # here, not at import time

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = MallInfo2
    return int(mallinfo2().fordblks)
