"""The LM scheduler: batched steps give every request the tokens it gets alone; cancel, failure and close."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.hardware.pages import span_resident_bytes
from cosyvoice_cpu.lm.hold import Hold
from cosyvoice_cpu.lm.sampling import RngDraw
from cosyvoice_cpu.lm.scheduler import LMScheduler

TEXT = "Warning: the temperature on line three is too high."


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The LM in the caller's thread, one request alone: the reference for the scheduler's results."""
    return Engine.load(DEMO_MODEL, EngineConfig(threads=2, lm_batch_rows=0))


def _alone(engine: Engine, ids: list[int], seed: int, budget=(None, None)) -> list[int]:
    return list(engine.lm.generate(ids, draw=RngDraw(np.random.default_rng(seed)), budget=budget))


def test_concurrent_requests_get_the_tokens_they_get_alone(engine: Engine) -> None:
    ids = [engine.tokenizer.encode(f"Pump {i} on line {i + 2} is {'hot' if i % 2 else 'cold'}.") for i in range(6)]
    want = [_alone(engine, x, seed) for seed, x in enumerate(ids)]
    scheduler = LMScheduler(engine.lm, max_rows=4)  # 6 requests, 4 rows: two wait for a free row
    try:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda a: list(scheduler.submit(a[1], draw=RngDraw(np.random.default_rng(a[0])))),
                                enumerate(ids)))  # fmt: skip
    finally:
        scheduler.close()
    assert got == want and all(len(t) > 5 for t in got)
    stats = scheduler.stats
    assert stats.requests == 6 and stats.tokens == sum(map(len, want))
    assert max(stats.batch_sizes) >= 3  # rows really shared steps
    fed = sum(n * c for n, c in stats.batch_sizes.items())  # one per token fed back: all but the last ones
    assert stats.tokens - 6 <= fed <= stats.tokens


def test_engine_with_batching_gives_the_same_audio(engine: Engine) -> None:
    voice = engine.make_voice(_tone_wav(), "Good morning everyone.", name="demo")
    batched = Engine.load(DEMO_MODEL, EngineConfig(threads=2, lm_batch_rows=4))
    try:
        for stream in (False, True):
            config = SynthesisConfig(seed=11, stream=stream)
            want = engine.synthesize_wav(TEXT, voice, config)
            with ThreadPoolExecutor(3) as pool:
                outs = list(pool.map(batched.synthesize_wav, [TEXT] * 3, [voice] * 3, [config] * 3))
            for out in outs:
                np.testing.assert_array_equal(out, want)
    finally:
        batched.close()
    assert batched.scheduler.stats.requests == 6


def test_closing_the_token_iterator_frees_the_row(engine: Engine) -> None:
    scheduler = LMScheduler(engine.lm, max_rows=1)
    try:
        ids = engine.tokenizer.encode(TEXT)
        tokens = scheduler.submit(ids, budget=(400, 400))
        next(tokens)
        tokens.close()  # a client that went away
        t0 = time.perf_counter()
        while scheduler.active and time.perf_counter() - t0 < 5:
            time.sleep(0.01)
        assert scheduler.active == 0
        assert scheduler.stats.tokens < 400  # it stopped decoding for nobody
        assert len(list(scheduler.submit(ids, budget=(20, 20)))) == 20  # the single row is free again
    finally:
        scheduler.close()


def test_a_failing_request_fails_alone_and_close_ends_the_rest(engine: Engine, monkeypatch) -> None:
    scheduler = LMScheduler(engine.lm, max_rows=2)
    ids = engine.tokenizer.encode(TEXT)
    with pytest.raises(ConfigError, match="text is empty"):  # bad input is refused at submit
        scheduler.submit([])
    with pytest.raises(ConfigError, match="cache="):
        scheduler.submit(ids, cache=engine.lm.session.new_cache(1))

    class Broken(RngDraw):
        def __call__(self, probs: np.ndarray) -> int:
            raise RuntimeError("sampler exploded")

    bad = scheduler.submit(ids, draw=Broken(np.random.default_rng(0)))
    good = scheduler.submit(ids, draw=RngDraw(np.random.default_rng(0)), budget=(30, 30))
    with pytest.raises(RuntimeError, match="exploded"):
        list(bad)
    assert len(list(good)) == 30
    started = threading.Event()
    results: list[object] = []

    def consume() -> None:
        it = scheduler.submit(ids, budget=(300, 300))
        try:
            for _ in it:
                started.set()
        except ConfigError as e:
            results.append(e)

    t = threading.Thread(target=consume)
    t.start()
    started.wait(10)
    scheduler.close()
    t.join(10)
    assert results and "closed" in str(results[0])
    with pytest.raises(ConfigError, match="closed"):
        scheduler.submit(ids)


def test_a_held_request_waits_at_its_first_chunk_until_released(engine: Engine) -> None:
    scheduler = LMScheduler(engine.lm, max_rows=2)
    try:
        ids = engine.tokenizer.encode(TEXT)
        release = Hold(13)
        held = scheduler.submit(ids, budget=(40, 40), hold=release)
        free = scheduler.submit(ids, budget=(40, 40))  # a neighbour is not held back
        assert len([next(held) for _ in range(13)]) == 13
        assert len(list(free)) == 40
        time.sleep(0.1)
        assert scheduler.stats.tokens == 53  # nothing was decoded for the held request meanwhile
        release.release()
        assert len(list(held)) == 27
    finally:
        scheduler.close()


def test_a_scheduler_whose_rows_are_all_held_sleeps_until_a_release_or_a_cancel(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyvoice_cpu.lm.scheduler as sched

    monkeypatch.setattr(sched, "IDLE_CHECK_S", 60.0)  # only a wake-up can make progress within the test
    scheduler = LMScheduler(engine.lm, max_rows=1)
    steps = 0
    step = scheduler._step

    def counted(admit: list) -> bool:
        nonlocal steps
        steps += 1
        return step(admit)

    scheduler._step = counted  # type: ignore[method-assign]
    ids = engine.tokenizer.encode(TEXT)
    try:
        hold = Hold(5)
        held = scheduler.submit(ids, budget=(20, 20), hold=hold)
        assert len([next(held) for _ in range(5)]) == 5
        before = steps
        time.sleep(0.3)
        assert steps - before <= 2  # asleep, not polling (a 2 ms poll made ~150 steps here)
        hold.release()  # wakes it: the rest arrives long before the 60 s safety net
        assert len(_drain(held, 30)) == 15

        second = Hold(3)
        blocked = scheduler.submit(ids, budget=(10, 10), hold=second)
        assert len([next(blocked) for _ in range(3)]) == 3
        before = steps
        waiting = scheduler.submit(ids, budget=(10, 10))  # one row: waits for the held request's row
        time.sleep(0.3)  # the scheduler is asleep again: a request waits, but no row is free
        assert steps - before <= 4
        blocked.close()  # the consumer leaves: only the cancel can wake the scheduler, which frees the row
        assert len(_drain(waiting, 30)) == 10
    finally:
        scheduler.close()


def _drain(tokens: Iterator[int], timeout: float) -> list[int]:
    """The rest of a token stream, or what arrived within ``timeout`` seconds."""
    done: list[int] = []
    t = threading.Thread(target=lambda: done.extend(tokens), daemon=True)
    t.start()
    t.join(timeout)
    return done


def test_hold_rejects_a_negative_count() -> None:
    with pytest.raises(ConfigError, match="hold after"):
        Hold(-1)


def test_the_scheduler_thread_ends_when_idle_and_restarts_on_the_next_request(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyvoice_cpu.lm.scheduler as sched

    monkeypatch.setattr(sched, "IDLE_EXIT_S", 0.05)
    scheduler = LMScheduler(engine.lm, max_rows=2)
    ids = engine.tokenizer.encode(TEXT)
    try:
        for _ in range(2):
            assert len(list(scheduler.submit(ids, budget=(12, 12)))) == 12
            thread = scheduler._thread
            assert thread is not None
            thread.join(10)  # nothing more to do: the thread ends by itself (no close() needed)
            assert not thread.is_alive() and scheduler._thread is None
    finally:
        scheduler.close()


def test_by_default_a_streamed_request_decodes_ahead_while_its_consumer_is_busy() -> None:
    """The LM/flow pipeline: after the first chunk, the rest of the tokens are decoded in the background even
    while the caller does not ask for the next chunk (with ``lm_batch_rows=0`` they wait for the caller)."""
    default = Engine.load(DEMO_MODEL, EngineConfig(threads=2))
    try:
        assert default.scheduler is not None and default.scheduler.max_rows == EngineConfig().lm_batch_rows
        voice = default.make_voice(_tone_wav(), "Good morning everyone.", name="demo")
        chunks = default.synthesize(TEXT, voice, SynthesisConfig(seed=3, stream=True, min_tokens=80,
                                                                 max_tokens=80, normalize=False))  # fmt: skip
        next(chunks)  # the first chunk; the caller now pauses
        deadline = time.monotonic() + 30
        while default.scheduler.stats.tokens < 80 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert default.scheduler.stats.tokens == 80
        chunks.close()
    finally:
        default.close()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("keep", [64, 512])
def test_a_finished_long_request_gives_its_rows_kv_pages_back(engine: Engine, keep: int) -> None:
    """The scheduler's cache lives as long as the engine; a long sentence's pages past ``keep_positions`` are
    released when it leaves its row (the demo LM's max_len is 512: keep=512 releases nothing, the control)."""
    scheduler = LMScheduler(engine.lm, max_rows=1, keep_positions=keep)
    try:
        ids = engine.tokenizer.encode(TEXT)
        assert len(list(scheduler.submit(ids, budget=(300, 300)))) == 300
        t0 = time.perf_counter()
        while scheduler.active and time.perf_counter() - t0 < 5:
            time.sleep(0.01)
        cache = scheduler._cache
        tail = [a[0, h, 64:] for a in cache.keys + cache.values for h in range(a.shape[1])]
        resident = sum(span_resident_bytes(t.ctypes.data, t.nbytes) for t in tail)
        if keep == 64:
            assert resident == 0 and cache.lengths[0] == 64
        else:
            assert resident > 0 and cache.lengths[0] > 300  # what stays without the release
        assert len(list(scheduler.submit(ids, budget=(20, 20)))) == 20  # the row serves the next request
    finally:
        scheduler.close()
    with pytest.raises(ConfigError, match="keep_positions"):
        LMScheduler(engine.lm, keep_positions=-1)
