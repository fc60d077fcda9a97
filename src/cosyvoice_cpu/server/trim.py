"""Giving glibc's free heap memory back while a server runs: :class:`HeapTrim`, called by
:class:`~cosyvoice_cpu.server.speech.Admission` whenever a synthesis leaves.

glibc keeps what a process frees in its heaps, resident, and returns it only from a heap's top; a server's requests,
LM scheduler and OpenVINO calls free memory all over its heaps. On a long run of mixed requests that free memory
added up, counted in the server's RSS (measured: docs/server.md, "A server's memory over time").
``malloc_trim`` returns every whole free page of every heap to the kernel (the pages stay free in malloc's own
count, ``cosyvoice_process_malloc_free_bytes``, but leave the RSS). It locks each heap while it runs, so the server
trims once it has had no synthesis running or waiting for :data:`IDLE_S` seconds, and, when a synthesis leaves more
than :data:`BUSY_S` seconds after the last trim, at once (a server never idle that long). The trim runs in a worker
thread, never in the event loop. ``cosyvoice_heap_trims_total`` and ``cosyvoice_heap_trimmed_bytes_total`` in
``/metrics`` count the trims and the resident memory they returned.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from cosyvoice_cpu.hardware.malloc import trim_heaps
from cosyvoice_cpu.hardware.pages import status_mb

logger = logging.getLogger(__name__)

IDLE_S = 1.0  # seconds with nothing running or waiting before the free heap memory is returned
BUSY_S = 60.0  # on a server never idle that long, the most seconds between two trims


class HeapTrim:
    """Returns glibc's free heap memory after the server goes idle (module docstring).

    Args:
        idle: whether nothing runs or waits now (read in the event loop).
        idle_s: seconds the server must stay idle before a trim (0 disables idle trims).
        busy_s: the most seconds between trims while the server stays busy (0 disables busy trims).
    """

    def __init__(self, idle: Callable[[], bool], idle_s: float = IDLE_S, busy_s: float = BUSY_S) -> None:
        self._idle, self.idle_s, self.busy_s = idle, idle_s, busy_s
        self._last = time.monotonic()
        self._pending: asyncio.TimerHandle | None = None
        self._running = threading.Lock()
        self.trims = 0
        self.freed_bytes = 0  # resident memory the trims returned (RSS before less after, summed)

    def left(self) -> None:
        """A synthesis left (in the event loop): trim now if the last trim is more than ``busy_s`` old (also on a
        server whose requests come back to back, idle at every leave but never for ``idle_s``), else schedule one
        if the server is idle now."""
        loop = asyncio.get_running_loop()
        if 0 < self.busy_s < time.monotonic() - self._last:
            self._start(loop)
        elif self._idle() and self.idle_s > 0:
            self.close()
            self._pending = loop.call_later(self.idle_s, self._if_still_idle, loop)

    def close(self) -> None:
        """Cancel a scheduled trim (the server is stopping)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _if_still_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pending = None
        if self._idle():
            self._start(loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last = time.monotonic()
        try:
            loop.run_in_executor(None, self.trim)
        except RuntimeError as e:  # the loop's executor is shutting down with the server
            logger.debug("heap trim skipped: %s", e)

    def trim(self) -> None:
        """Return the free heap memory now (one trim at a time; a second caller returns at once)."""
        if not self._running.acquire(blocking=False):
            return
        try:
            before, t0 = status_mb("VmRSS") or 0.0, time.perf_counter()
            if trim_heaps() is None:  # not glibc: nothing to trim, nothing counted
                return
            after = status_mb("VmRSS") or 0.0
            self.trims += 1
            self.freed_bytes += int(max(0.0, before - after) * 2**20)  # other threads' work moves it too
            logger.debug("heap trim: RSS %.0f -> %.0f MB in %.0f ms", before, after, (time.perf_counter() - t0) * 1000)
        except Exception:  # a worker's future nobody reads: say it here
            logger.exception("heap trim failed")
        finally:
            self._running.release()
