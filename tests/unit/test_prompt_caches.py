"""The voices' prompt-cache LRU (``flow.prompt_caches.PromptCaches``): bounded in bytes, a request's sentences share
one cache even when the budget keeps none, requests at the same time share one build, and a budget too small for a
voice says so once."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from cosyvoice_cpu.flow import prompt_caches
from cosyvoice_cpu.flow.prompt_caches import PromptCaches

MIB = 1 << 20


@dataclass
class FakeCache:
    nbytes: int
    advice: str | None = None


class FakeVoice:
    """A voice whose prompt cache takes ``size`` bytes (the fake kind reads it from the prompt tokens)."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.fingerprint = name, f"{name}-{size}"
        self.speech_tokens = np.array([size])
        self.mel, self.embedding = np.zeros((2, 80), np.float32), np.zeros(192, np.float32)


class Kind:
    """Builds a cache of the voice's size and counts the builds."""

    def __init__(self) -> None:
        self.built = 0

    def build(self, stage, prompt_tokens, prompt_feat, embedding, n_timesteps, cfg_rate, dtype):
        self.built += 1
        return FakeCache(int(prompt_tokens[0]), "its prompt is long" if prompt_tokens[0] % 2 else None)


def caches(budget_mib: int) -> tuple[PromptCaches, Kind]:
    kind = Kind()
    return PromptCaches(stage=None, budget=budget_mib * MIB, kind=kind), kind  # type: ignore[arg-type]


def get(lru: PromptCaches, voice: FakeVoice, request: dict | None = None) -> FakeCache:
    return lru.get(voice, 10, 0.7, request)  # type: ignore[arg-type,return-value]


def test_kept_within_the_budget_least_recently_used_dropped_first() -> None:
    lru, kind = caches(3)
    a, b = FakeVoice("a", MIB), FakeVoice("b", MIB)
    assert get(lru, a) is get(lru, a) and kind.built == 1 and lru.hits == 1
    get(lru, b)
    get(lru, a)  # a is now the most recent
    get(lru, FakeVoice("c", 2 * MIB))  # 4 MiB > 3: b goes
    assert lru.nbytes == 3 * MIB and kind.built == 3
    get(lru, a)
    assert kind.built == 3
    get(lru, b)
    assert kind.built == 4


def test_a_request_builds_a_cache_the_budget_cannot_keep_once(caplog: pytest.LogCaptureFixture) -> None:
    lru, kind = caches(1)
    voice = FakeVoice("alice", 2 * MIB)
    with caplog.at_level(logging.WARNING, logger="cosyvoice_cpu.flow.prompt_caches"):
        request: dict = {}
        first = get(lru, voice, request)
        assert get(lru, voice, request) is first and kind.built == 1  # the request's next sentence
        assert get(lru, voice, {}) is first and kind.built == 1 and lru.shared == 1  # a request meanwhile shares it
        del first, request  # those requests end: nothing holds the cache any more
        get(lru, voice, {})  # the next request builds it again
        assert kind.built == 2 and lru.nbytes == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "alice" in warned[0] and "--prompt-cache-mb" in warned[0]  # once, with the fix


def test_a_budget_of_zero_keeps_none_without_warning(caplog: pytest.LogCaptureFixture) -> None:
    lru, kind = caches(0)
    with caplog.at_level(logging.WARNING, logger="cosyvoice_cpu.flow.prompt_caches"):
        for _ in range(2):
            request: dict = {}
            get(lru, FakeVoice("v", MIB), request)
            get(lru, FakeVoice("v", MIB), request)
    assert kind.built == 2 and lru.nbytes == 0 and not caplog.records


def test_a_caches_advice_is_logged_once_a_voice(caplog: pytest.LogCaptureFixture) -> None:
    """A family's advice on streaming a voice (Fun-CosyVoice3: its prompt's length) reaches the log with the voice's
    name once, however often its caches are built (here every request: a budget of 0); a voice the cache has nothing
    to say about logs nothing."""
    lru, kind = caches(0)
    odd, even = FakeVoice("odd", MIB + 1), FakeVoice("even", MIB)
    with caplog.at_level(logging.INFO, logger="cosyvoice_cpu.flow.prompt_caches"):
        for _ in range(2):
            get(lru, odd, {})
            get(lru, even, {})
            lru.get(odd, 5, 0.7)  # other solver settings: another cache, the same voice
    assert kind.built == 6
    assert [r.getMessage() for r in caplog.records] == ["voice 'odd': its prompt is long"]


def test_held_bytes_count_the_caches_only_running_requests_hold() -> None:
    """``nbytes`` is what the budget keeps; ``held_nbytes`` (``/metrics``' held gauge) every cache in memory."""
    lru, _ = caches(2)
    big, small = FakeVoice("big", 3 * MIB), FakeVoice("small", MIB)
    request: dict = {}
    held = get(lru, big, request)  # too big to keep: only the request holds it
    get(lru, small)
    assert lru.nbytes == MIB and lru.held_nbytes == 4 * MIB
    assert get(lru, big, {}) is held and lru.held_nbytes == 4 * MIB  # shared: counted once
    del held, request  # the request ends
    assert lru.nbytes == lru.held_nbytes == MIB


def test_a_request_still_using_a_voice_keeps_it_recent() -> None:
    lru, kind = caches(2)
    a, b = FakeVoice("a", MIB), FakeVoice("b", MIB)
    request: dict = {}
    get(lru, a, request)
    get(lru, b)
    get(lru, a, request)  # the request's next sentence: a is the most recent again
    get(lru, FakeVoice("c", MIB))  # 3 MiB > 2: b goes, not a
    get(lru, a)
    assert kind.built == 3


def test_retain_drops_the_caches_of_voices_no_longer_served() -> None:
    lru, kind = caches(16)
    a, b, c = FakeVoice("a", MIB), FakeVoice("b", 2 * MIB), FakeVoice("c", 3 * MIB)
    for voice in (a, b, c):
        get(lru, voice)
    lru.get(b, 5, 0.7)  # another solver setting of b: its own cache
    assert lru.nbytes == 8 * MIB
    assert lru.retain({a.fingerprint, c.fingerprint}) == 4 * MIB  # both of b's caches go
    assert lru.nbytes == 4 * MIB
    get(lru, a)
    get(lru, c)
    assert kind.built == 4  # a's and c's were kept
    assert lru.retain([]) == 4 * MIB and lru.nbytes == 0
    assert lru.retain([]) == 0


def test_a_cache_built_while_its_voice_was_dropped_is_not_kept() -> None:
    """A request that looked the old voice up before it was deleted finishes its build after ``retain``: the cache
    serves that request, and the LRU does not keep it."""
    lru, kind = caches(16)
    old, new = FakeVoice("old", MIB), FakeVoice("new", 2 * MIB)
    build = kind.build

    def build_while_dropped(*args: object, **kw: object) -> FakeCache:
        lru.retain({new.fingerprint})  # the voice is replaced while its cache is being built
        return build(*args, **kw)

    kind.build = build_while_dropped  # type: ignore[method-assign]
    assert get(lru, old).nbytes == MIB and lru.nbytes == 0
    get(lru, new)  # built during another retain that keeps it: kept
    assert lru.nbytes == 2 * MIB


def test_a_cache_the_budget_let_go_while_a_request_held_it_is_shared_and_kept_again() -> None:
    lru, kind = caches(2)
    a, b, c = FakeVoice("a", MIB), FakeVoice("b", MIB), FakeVoice("c", MIB)
    request: dict = {}
    held = get(lru, a, request)
    get(lru, b)
    get(lru, c)  # 3 MiB > 2: a leaves the LRU, but the request still holds it
    assert lru.nbytes == 2 * MIB
    assert get(lru, a, {}) is held and kind.built == 3 and lru.shared == 1  # another request: shared, not rebuilt
    del held, request
    get(lru, a)  # back in the LRU as its most recent (b went): still no build
    assert kind.built == 3 and lru.nbytes == 2 * MIB
    get(lru, b)
    assert kind.built == 4


def test_a_dropped_voices_cache_a_request_holds_is_shared_but_not_kept_again() -> None:
    lru, kind = caches(16)
    voice = FakeVoice("old", MIB)
    held = get(lru, voice, {})
    lru.retain([])  # the voice is deleted while a request still speaks with it
    assert get(lru, voice, {}) is held and kind.built == 1  # a request that looked it up before: the same cache
    assert lru.nbytes == 0


class CountingEvent(threading.Event):
    """An event that counts the threads waiting on it (every event the LRU makes, in these tests)."""

    waiting = 0
    lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> bool:
        with CountingEvent.lock:
            CountingEvent.waiting += 1
        return super().wait(timeout)


def _until(condition: object, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def counted_waits(monkeypatch: pytest.MonkeyPatch) -> type[CountingEvent]:
    monkeypatch.setattr(prompt_caches, "threading", SimpleNamespace(Event=CountingEvent, Lock=threading.Lock))
    CountingEvent.waiting = 0
    return CountingEvent


def test_requests_at_the_same_time_wait_for_one_build(counted_waits: type[CountingEvent]) -> None:
    """Four requests for a voice whose cache is not built yet (a new voice, or one the budget cannot keep) get one
    build between them, not four copies: the first builds, the others wait for it."""
    lru, kind = caches(0)  # kept by no LRU: only the requests hold it
    release = threading.Event()
    build = kind.build

    def slow_build(*args: object, **kw: object) -> FakeCache:
        assert release.wait(10)
        return build(*args, **kw)

    kind.build = slow_build  # type: ignore[method-assign]
    voice = FakeVoice("v", MIB)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(get, lru, voice, {}) for _ in range(4)]
        _until(lambda: counted_waits.waiting == 3)  # three wait on the build; the first is in it
        release.set()
        got = [f.result(10) for f in futures]
    assert kind.built == 1 and all(c is got[0] for c in got)
    assert lru.misses == 1 and lru.shared == 3


def test_a_failed_build_leaves_the_waiting_request_to_build_its_own(counted_waits: type[CountingEvent]) -> None:
    lru, kind = caches(0)
    release = threading.Event()
    build = kind.build
    calls = []

    def failing_first(*args: object, **kw: object) -> FakeCache:
        calls.append(1)
        if len(calls) == 1:
            assert release.wait(10)
            raise MemoryError("the first build fails")
        return build(*args, **kw)

    kind.build = failing_first  # type: ignore[method-assign]
    voice = FakeVoice("v", MIB)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(get, lru, voice, {})
        _until(lambda: len(calls) == 1)
        second = pool.submit(get, lru, voice, {})
        _until(lambda: counted_waits.waiting == 1)  # the second request waits on the first's build
        release.set()
        with pytest.raises(MemoryError):
            first.result(10)
        assert second.result(10).nbytes == MIB
    assert len(calls) == 2 and lru.misses == 2 and not lru._building
