"""glibc's malloc in this process: the mmap threshold that keeps big freed buffers returnable, the number of heaps
(arenas) threads allocate from, and how much memory the heaps hold free and how many there are. All are no-ops
(False / None) off glibc; ``ctypes`` is loaded when they are called.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc <malloc.h>
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at start-up; an explicit value there wins
ARENA_MAX_ENV = "MALLOC_ARENA_MAX"


def _glibc(name: str) -> Any:
    """glibc's function ``name`` through ``ctypes`` (loaded here, not at import time); None off glibc or where
    this glibc lacks it."""
    import ctypes

    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _mallopt(param: int, value: int) -> bool:
    mallopt = _glibc("mallopt")
    return mallopt is not None and bool(mallopt(param, int(value)))


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
    return _mallopt(_M_MMAP_THRESHOLD, nbytes)


def limit_arenas(count: int) -> bool:
    """Let glibc's malloc create at most ``count`` heaps (arenas, the main one included) for this process's
    threads; True if set.

    By default glibc gives each new thread a heap of its own (64-bit: up to 8 per core; past that, threads
    share), and memory freed in a heap stays with that heap: a server whose request threads, LM scheduler and
    OpenVINO calls allocate side by side spreads its freed memory over many heaps, each resident. Few heaps keep
    it reusable (measured on a server mix: docs/server.md, "A server's memory over time"). Heaps already made
    stay, and once a process has made more than 8, glibc has fixed its bound and this changes nothing (it still
    returns True): call it before the threads start. A no-op (False) off glibc or when ``MALLOC_ARENA_MAX`` is
    set in the environment (the operator's choice wins).
    """
    if not 1 <= count <= 1024:
        raise ConfigError(f"malloc arenas must be 1 to 1024, got {count}")
    if os.environ.get(ARENA_MAX_ENV):
        return False
    return _mallopt(_M_ARENA_MAX, count)


def arena_env(count: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a new process needs to start with at most ``count`` heaps: ``{"MALLOC_ARENA_MAX": ...}``
    (``environ``'s own value when it has one: the operator's choice wins), or nothing when ``count`` is 0.

    For processes that make their threads before our code runs (a Ray replica's actor), where
    :func:`limit_arenas` comes too late: glibc reads the variable when the process starts.
    """
    if not 0 <= count <= 1024:
        raise ConfigError(f"malloc arenas must be 0 to 1024, got {count}")
    given = (os.environ if environ is None else environ).get(ARENA_MAX_ENV)
    if given:
        return {ARENA_MAX_ENV: given}
    return {ARENA_MAX_ENV: str(count)} if count else {}


def trim_heaps() -> bool | None:
    """Return the free memory of glibc's heaps to the kernel (``malloc_trim(0)``: whole free pages anywhere in
    every heap, not only at their tops); True if there was any to return, None off glibc."""
    import ctypes

    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is None:
        return None
    malloc_trim.argtypes = [ctypes.c_size_t]
    return bool(malloc_trim(0))


def malloc_heaps() -> int | None:
    """How many heaps (arenas) glibc's malloc has made in this process (``malloc_info``); None off glibc."""
    import ctypes
    import tempfile

    malloc_info, fopen, fclose = _glibc("malloc_info"), _glibc("fopen"), _glibc("fclose")
    if malloc_info is None or fopen is None or fclose is None:
        return None
    fopen.restype, fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    malloc_info.argtypes, fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        stream = fopen(f.name.encode(), b"w")
        if not stream:
            return None
        try:
            malloc_info(0, stream)
        finally:
            fclose(stream)
        return Path(f.name).read_text().count("<heap nr=")


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its heaps (freed, not returned to the OS: ``mallinfo2().fordblks``);
    None off glibc or before glibc 2.33."""
    import ctypes

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

    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = MallInfo2
    return int(mallinfo2().fordblks)
