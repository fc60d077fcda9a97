"""An embedding table read row by row from its ``.npy`` file with ``os.preadv``: never memory-mapped.

A memory-mapped table costs resident memory far beyond the rows looked up: every page fault maps the pages
around it (the kernel's fault-around and read-around windows). On the full-size text table (151,936 x 896
float32, 545 MB) the mapping's resident part grew with the number of distinct token rows looked up, so a
server speaking varied text for long enough would end up holding most of the table in its RSS (measured:
docs/benchmarks-log.md, "Memory"). Read with ``pread``, a looked-up row costs the process nothing resident; the
OS page cache keeps the hot rows (reclaimable, not counted as the process's memory). A request looks up one text
row per text token (~100 for a sentence) and one speech row per decoded token: one cheap ``pread`` each.

:func:`open_table` returns a :class:`RowTable` where ``os.pread`` exists (POSIX) and a read-only memory map
elsewhere; both answer ``len()``, ``shape``, ``dtype`` and ``table[ids]`` for an int64 id array.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class RowTable:
    """A C-ordered 2-D ``.npy`` table of ``path`` whose rows are read on demand.

    ``table[ids]`` with ``ids`` an int64 array (N,) of valid rows returns a new (N, width) array of the table's
    dtype; ids are not range-checked here (callers check them against ``len(table)``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
            self._offset = f.tell()
        if len(shape) != 2 or fortran or dtype.hasobject or dtype.byteorder == ">":
            raise ValueError(
                f"expected a C-ordered little-endian 2-D table, got {dtype} {shape}"
                f"{' (Fortran order)' if fortran else ''}"
            )
        self.shape: tuple[int, int] = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self._row_bytes = self.shape[1] * self.dtype.itemsize
        size = self.path.stat().st_size
        if size < self._offset + self.shape[0] * self._row_bytes:
            raise ValueError(f"file is truncated ({size} bytes for a {self.shape} {self.dtype} table)")
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((len(ids), self.shape[1]), self.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        n = self._row_bytes
        for i, row in enumerate(ids.tolist()):
            got = os.preadv(self._fd, [buf[i * n : (i + 1) * n]], self._offset + row * n)
            if got != n:
                raise OSError(f"short read of row {row} from {self.path} ({got} of {n} bytes)")
        return out

    def close(self) -> None:
        """Close the file (also done when the table is garbage-collected)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        if hasattr(self, "_fd"):  # not if __init__ failed before opening the file
            self.close()


def open_table(path: str | Path) -> RowTable | np.ndarray:
    """A :class:`RowTable` for ``path`` where ``os.preadv`` exists, else a read-only memory map of it.

    Raises OSError or ValueError for a missing, unreadable, malformed or truncated file."""
    if hasattr(os, "preadv"):
        return RowTable(path)
    return np.load(path, mmap_mode="r")
