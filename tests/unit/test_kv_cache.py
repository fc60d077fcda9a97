"""The LM's KV cache costs memory only where positions are written (``lm.KVCache``, ``lm.zero_pages``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.hardware.pages import mappings, span_resident_bytes
from cosyvoice_cpu.lm.kv_cache import KVCache, zero_pages
from cosyvoice_cpu.lm.kv_spec import LMSpec

# the full-size CosyVoice2 LM's cache geometry: 4 rows x 24 layers x 2 KV heads x 2048 positions x 64 = 192 MB
SPEC = LMSpec(max_len=2048, num_layers=24, kv_heads=2, head_dim=64, hidden=896, speech_vocab=6564, text_vocab=151936)


def _resident_mb(arrays: list[np.ndarray]) -> float:
    """Resident MB of the pages that hold ``arrays`` (``mincore``; not smaps, whose merged mappings count
    neighbours: CI once measured 17 MB "resident" in a cache nothing had written)."""
    return sum(span_resident_bytes(a.ctypes.data, a.nbytes) for a in arrays) / 2**20


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_cache_pages_are_resident_only_where_written() -> None:
    junk = np.ones(16 << 18, np.float32)  # a freed 16 MB block raises glibc's mmap threshold: np.zeros would
    del junk  # then take the cache's 4 MB layer arrays from the heap and clear (touch) every page of them
    cache = KVCache(SPEC, rows=4)
    assert len(cache.keys) == len(cache.values) == 24
    assert cache.keys[0].shape == (4, 2, 2048, 64) and cache.keys[0].dtype == np.float32
    assert _resident_mb(cache.keys + cache.values) < 2  # nothing written yet
    for layer in cache.keys + cache.values:  # a 100-position prefill of row 0, as the graph writes it
        layer[0, :, :100] = 1.0
    written = 48 * 2 * 100 * 64 * 4 / 2**20  # 2.3 MB
    assert _resident_mb(cache.keys + cache.values) < written + 2  # not the 192 MB the cache spans
    assert all(k.flags.writeable and k.flags.c_contiguous for k in cache.keys)
    assert not cache.values[5][1:].any() and cache.values[5][0, :, :100].all()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_zero_pages_refuse_huge_pages_and_are_measured_alone() -> None:
    """A 2 MB transparent huge page would make a whole region resident at its first write (THP "always"), so
    the cache's mapping opts out; and its residency is measured apart from the neighbours smaps merges in."""
    filled = [np.frombuffer(mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE), np.uint8) for _ in range(3)]
    for f in filled:
        f[:] = 1  # resident anonymous mappings, of the same flags as a plain zero_pages mapping
    a = zero_pages((16 << 18,))  # 16 MB
    assert _resident_mb(filled) == 24 and _resident_mb([a]) == 0
    flags = [f for lo, hi, _, _, f in mappings() if lo <= a.ctypes.data < hi]
    assert len(flags) == 1 and "nh" in flags[0], flags  # MADV_NOHUGEPAGE
    a[: mmap.PAGESIZE // 4] = 1.0  # one page (4 KB on x86, 16 KB on a Raspberry Pi 5)
    assert _resident_mb([a]) == mmap.PAGESIZE / 2**20


def test_zero_pages_shapes_and_lifetime() -> None:
    a = zero_pages((3, 5))
    assert a.shape == (3, 5) and not a.any()
    row = a[1]
    del a
    row[:] = 2.0  # a view keeps the mapping alive
    assert row.sum() == 10.0
    assert zero_pages((0, 4)).shape == (0, 4)
    with pytest.raises(ConfigError, match="at least one row"):
        KVCache(SPEC, rows=0)


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED"), reason="needs madvise")
def test_release_gives_a_long_rows_pages_back_and_keeps_the_rest() -> None:
    cache = KVCache(SPEC, rows=2)
    layers = cache.keys + cache.values
    for layer in layers:  # row 1: a 1900-position sentence; row 0: a short one
        layer[1, :, :1900] = 1.0
        layer[0, :, :100] = 2.0
    cache.lengths[:] = (100, 1900)
    per_position = 48 * 2 * 64 * 4  # bytes of one position of one row over every layer: 24 KB

    def row_mb(row: int, lo: int, hi: int) -> float:
        return sum(span_resident_bytes(a[row, h, lo:hi].ctypes.data, a[row, h, lo:hi].nbytes)
                   for a in layers for h in range(2)) / 2**20  # fmt: skip

    assert row_mb(1, 512, 2048) == pytest.approx((1900 - 512) * per_position / 2**20, abs=0.5)
    released = cache.release(1, keep=512)
    assert released == (2048 - 512) * per_position  # 512 positions are whole pages here (64 floats = 256 B)
    assert row_mb(1, 512, 2048) == 0 and cache.lengths[1] == 512
    assert all(a[1, :, :512].all() and not a[1, :, 512:].any() for a in layers)  # kept as written; zeros after
    assert row_mb(0, 0, 100) > 0 and all(a[0, :, :100].all() for a in layers)  # another row is not touched
    assert cache.release(0, keep=512) == 0 and cache.lengths[0] == 100  # a short row: nothing to give back
    assert cache.release(1, keep=100) > 0 and cache.lengths[1] == 100
    for layer in layers:
        layer[1, :, :1000] = 3.0  # a released row takes writes again
    assert all(a[1, :, 999].all() for a in layers)
    with pytest.raises(ConfigError, match="keep"):
        cache.release(0, keep=-1)
    with pytest.raises(ConfigError, match="out of range"):
        cache.release(2)
