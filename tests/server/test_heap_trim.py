"""When the server returns glibc's free heap memory (:mod:`cosyvoice_cpu.server.trim`): after it has stayed idle,
never while a synthesis runs or waits, and on a server never idle, at most every ``busy_s`` seconds. The trim
itself is counted, and the real server's ``/metrics`` shows one after a request (tests/server/test_api.py)."""

from __future__ import annotations

import asyncio

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


def test_an_idle_server_trims_once_after_the_delay(trims: list[int]) -> None:
    async def run() -> None:
        admission = Admission(2, 2)
        admission.heap_trim = HeapTrim(lambda: admission.active == 0 and admission.waiting == 0, idle_s=0.05)
        await admission.enter()
        await admission.enter()
        admission.leave()  # one still runs: no trim
        await asyncio.sleep(0.15)
        assert trims == []
        admission.leave()  # idle now
        await asyncio.sleep(0.02)
        assert trims == []  # not before the delay
        await asyncio.sleep(0.15)
        assert trims == [1] and admission.heap_trim.trims == 1

    asyncio.run(run())


def test_a_request_arriving_in_the_delay_cancels_the_trim(trims: list[int]) -> None:
    async def run() -> None:
        admission = Admission(1, 2)
        admission.heap_trim = HeapTrim(lambda: admission.active == 0 and admission.waiting == 0, idle_s=0.1)
        await admission.enter()
        admission.leave()
        await asyncio.sleep(0.03)
        await admission.enter()  # busy again before the delay ended
        await asyncio.sleep(0.2)
        assert trims == []
        admission.leave()
        await asyncio.sleep(0.25)
        assert trims == [1]

    asyncio.run(run())


def test_a_server_never_idle_trims_every_busy_s_at_most(trims: list[int]) -> None:
    async def run() -> None:
        admission = Admission(3, 2)
        admission.heap_trim = HeapTrim(lambda: False, idle_s=0.01, busy_s=0.1)  # never idle
        await admission.enter()
        admission.leave()  # the last trim (the start) is recent: none
        await asyncio.sleep(0.05)
        assert trims == []
        await asyncio.sleep(0.1)
        await admission.enter()
        admission.leave()  # more than busy_s since the start: one now
        await admission.enter()
        admission.leave()  # and not again right after
        await asyncio.sleep(0.05)
        assert trims == [1]

    asyncio.run(run())


def test_a_trim_counts_what_it_returned() -> None:
    heap_trim = HeapTrim(lambda: True)
    heap_trim.trim()  # the real malloc_trim (a no-op off glibc)
    assert heap_trim.trims == 1 and heap_trim.freed_bytes >= 0
