"""The LM's KV cache: one buffer per layer for every row, in anonymous mappings whose pages are resident only where
written, given back when a row leaves (the tricks that keep a long-running server's memory flat).

Shapes (L layers, R rows, Hkv KV heads, M = ``max_len`` positions, Dh head dim): each layer's keys and values are
float32 (R, Hkv, M, Dh); :meth:`KVCache.read` / :meth:`KVCache.write` move one row's first n positions as
(2, L, Hkv, n, Dh). The graph's names for them: :mod:`cosyvoice_cpu.lm.kv_spec`.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import numpy as np

from cosyvoice_cpu.backends.base import BoundRun
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.cache import LMCache
from cosyvoice_cpu.lm.kv_spec import LMSpec

logger = logging.getLogger(__name__)


def zero_pages(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of ``shape`` in its own anonymous private mapping: zero, and resident only where written
    (the kernel maps a page on its first write); the mapping is unmapped when the last view of it is freed."""
    n = int(np.prod(shape))
    if n == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # no POSIX mmap flags (Windows): calloc'd zeros
        return np.zeros(shape, np.float32)
    buf = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # with transparent huge pages "always", the first write to a 2 MB
        buf.madvise(mmap.MADV_NOHUGEPAGE)  # region would make all of it resident: 4 KB pages keep the promise
    return np.frombuffer(buf, np.float32).reshape(shape)


def _mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The :func:`zero_pages` mapping under ``array`` (None for a plain NumPy array)."""
    base: object = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)  # frombuffer: a memoryview
    return base


# KVCache.release's default: positions a freed row keeps resident (full-size CosyVoice2: 12 MB per row; a 10 s
# sentence with a 3 s voice fills ~420 positions). A long sentence's pages beyond it are given back.
KEEP_POSITIONS = 512


class KVCache(LMCache):
    """Per-request decoding state: a preallocated cache for ``rows`` sequences and their lengths.

    ``keys[i]`` / ``values[i]``: float32 (rows + spare, Hkv, max_len, Dh) for layer i; ``lengths``: (rows + spare,)
    int64 number of valid positions per row. Spare rows (last) are never a caller's: they only pad a lone row's
    call (:class:`LMSession`'s ``min_rows``).

    All layers live in one anonymous private mapping (:func:`zero_pages`), so a page of the cache costs memory
    only once a position in it is written. ``np.zeros`` does not promise that: once glibc's dynamic mmap
    threshold has risen above an array's size, ``calloc`` serves it from the heap and clears it, touching every
    page. Full-size CosyVoice2 LM (max_len 2048, 192 MB for 4 rows; a development probe in an engine's process):
    prefilling the bench prompt's 166 positions into row 0 of an ``np.zeros`` cache made a large part of it
    resident, in one mapping only the pages written (measured: docs/benchmarks-log.md, "Memory").
    """

    def __init__(self, spec: LMSpec, rows: int, spare: int = 0) -> None:
        if rows <= 0:
            raise ConfigError(f"a KV cache needs at least one row, got {rows}")
        if spare < 0:
            raise ConfigError(f"a KV cache's spare rows cannot be negative, got {spare}")
        shape = (rows + spare, spec.kv_heads, spec.max_len, spec.head_dim)
        self.spec = spec
        layers = zero_pages((2, spec.num_layers, *shape))
        self.keys, self.values = list(layers[0]), list(layers[1])
        self.lengths = np.zeros(rows + spare, np.int64)
        self._rows = rows
        self._bindings: dict[tuple[int, int, int], tuple[object, BoundRun]] = {}

    def binding(self, owner: object, r0: int, b: int, make: Callable[[], BoundRun]) -> BoundRun:
        """The :class:`~cosyvoice_cpu.backends.base.BoundRun` of ``owner`` (an LM session) over rows r0..r0+b of
        this cache, made by ``make`` on first use and kept as long as the cache (whose buffers it binds)."""
        key = (id(owner), r0, b)
        if key not in self._bindings:
            self._bindings[key] = (owner, make())  # holding the owner keeps its id from being reused
        return self._bindings[key][1]

    @property
    def rows(self) -> int:
        """Rows a caller may use; ``keys[i]`` may hold ``spare`` more, which only pad a call's row range."""
        return self._rows

    def reset(self, row: int) -> None:
        """Forget row ``row`` (its buffer is overwritten by the next prefill)."""
        self.check_row(row)
        self.lengths[row] = 0

    def release(self, row: int, keep: int = KEEP_POSITIONS) -> int:
        """Give row ``row``'s memory past its first ``keep`` positions back to the OS; return the bytes of the
        ranges released (written or not).

        For a row no request uses any more: its length is set to ``min(length, keep)``. A written page stays
        resident for the cache's lifetime, so without this one long sentence would keep its row's pages (the
        full-size CosyVoice-300M LM: ~115 KB per position, up to 235 MB per row; CosyVoice2: ~24 KB, 50 MB) in a
        scheduler that runs for months. ``madvise(MADV_DONTNEED)`` on the private anonymous mapping: the pages
        read as zeros again and cost memory only when written. A no-op (0) for a row no longer than ``keep``, for
        a cache not in a :func:`zero_pages` mapping, and where ``madvise`` is missing.
        """
        self.check_row(row)
        if keep < 0:
            raise ConfigError(f"keep must be >= 0 positions, got {keep}")
        length = int(self.lengths[row])
        self.lengths[row] = min(length, keep)
        buf = _mapping_of(self.keys[0])
        if length <= keep or buf is None or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        page, item = mmap.PAGESIZE, self.keys[0].itemsize
        span = self.spec.max_len * self.spec.head_dim * item  # bytes of one (row, head) position range
        base = np.frombuffer(buf, np.uint8).ctypes.data
        released = 0
        for layer in self.keys + self.values:
            for head in range(layer.shape[1]):
                start = layer[row, head].ctypes.data - base
                lo = -(-(start + keep * self.spec.head_dim * item) // page) * page  # whole pages only
                hi = (start + span) // page * page
                if hi > lo:
                    buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                    released += hi - lo
        return released

    def read(self, row: int, n: int) -> np.ndarray:
        """A copy of row ``row``'s first ``n`` positions: float32 (2, layers, Hkv, n, Dh), keys then values."""
        self.check_row(row)
        return np.stack([np.stack([layer[row, :, :n] for layer in part]) for part in (self.keys, self.values)])

    def write(self, row: int, kv: np.ndarray) -> None:
        """Make ``kv`` (as :meth:`read` returns it) the whole content of row ``row``."""
        self.check_kv(kv)
        self.check_row(row)
        n = kv.shape[3]
        for part, layers in zip((self.keys, self.values), kv):
            for buf, entries in zip(part, layers):
                buf[row, :, :n] = entries
        self.lengths[row] = n
