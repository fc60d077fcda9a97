"""When the server returns glibc's free heap memory (:mod:`cosyvoice_cpu.server.trim`): after it has stayed idle,
never while a synthesis runs or waits, and on a server never idle, at most every ``busy_s`` seconds. The trim
itself is counted, and the real server's ``/metrics`` shows one after a request (tests/server/test_api.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

import cosyvoice_cpu.server.trim as trim_module
from cosyvoice_cpu.server.speech import Admission
from cosyvoice_cpu.server.trim import HeapTrim


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of ``malloc_trim`` (recorded, not made)."""
    calls: list[int] = []
    monkeypatch.setattr(trim_module, "trim_heaps", lambda: calls.append(1) or True)
    return calls


async def until(done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait (in the loop) until ``done()``, at most ``timeout`` seconds (a loaded machine runs the worker late)."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_an_idle_server_trims_once_after_the_delay(trims: list[int]) -> None:
    async def run() -> None:
        admission = Admission(2, 2)
        heap_trim = admission.heap_trim = HeapTrim(lambda: admission.active == 0 and admission.waiting == 0, 0.05)
        await admission.enter()
        await admission.enter()
        admission.leave()  # one still runs: nothing scheduled
        assert heap_trim._pending is None
        admission.leave()  # idle now: a trim after the delay, not at once
        assert heap_trim._pending is not None and trims == []
        await until(lambda: heap_trim.trims == 1)
        await asyncio.sleep(0.1)
        assert trims == [1] and heap_trim.trims == 1

    asyncio.run(run())


def test_a_request_arriving_in_the_delay_cancels_the_trim(trims: list[int]) -> None:
    async def run() -> None:
        admission = Admission(1, 2)
        heap_trim = admission.heap_trim = HeapTrim(lambda: admission.active == 0 and admission.waiting == 0, 0.1)
        await admission.enter()
        admission.leave()  # idle: a trim scheduled
        await admission.enter()  # busy again before the delay ends
        await asyncio.sleep(0.3)  # the delay is over: it found the server busy
        assert heap_trim._pending is None and trims == []
        admission.leave()
        await until(lambda: heap_trim.trims == 1)
        assert trims == [1]

    asyncio.run(run())


def test_a_server_never_idle_trims_every_busy_s_at_most(trims: list[int]) -> None:
    async def run() -> None:
        admission = Admission(3, 2)
        heap_trim = admission.heap_trim = HeapTrim(lambda: False, idle_s=0.01, busy_s=0.1)  # never idle
        await admission.enter()
        admission.leave()  # the last trim (the start) is recent: none
        assert heap_trim._pending is None
        await asyncio.sleep(0.15)
        await admission.enter()
        admission.leave()  # more than busy_s since the start: one now
        await admission.enter()
        admission.leave()  # and not again right after
        await until(lambda: heap_trim.trims == 1)
        await asyncio.sleep(0.1)
        assert trims == [1]

    asyncio.run(run())


def test_back_to_back_requests_still_trim_every_busy_s(trims: list[int]) -> None:
    """One client whose next request starts within the idle delay: idle at every leave, never for ``idle_s``."""

    async def run() -> None:
        admission = Admission(1, 2)
        heap_trim = admission.heap_trim = HeapTrim(lambda: admission.active == 0 and admission.waiting == 0, 0.2, 0.3)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            await admission.enter()
            await asyncio.sleep(0.05)
            admission.leave()
        heap_trim.close()  # the idle trim after the last request does not count
        await until(lambda: heap_trim.trims >= 1, timeout=3.0)
        assert trims, "a server busy at every idle timer never trimmed"

    asyncio.run(run())


def test_a_trim_counts_what_it_returned() -> None:
    heap_trim = HeapTrim(lambda: True)
    heap_trim.trim()  # the real malloc_trim (a no-op off glibc)
    assert heap_trim.trims == 1 and heap_trim.freed_bytes >= 0
