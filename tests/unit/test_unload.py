"""``--unload-after``: the engine is released after its idle seconds, never while a call or an iteration holds it,
and loaded again on the next use; what the servers read without working is kept across releases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.server.unload import UnloadingEngine


class FakeEngine:
    model_dir, manifest, sample_rate, threads, token_rate, kv_cache_positions = "m", "manifest", 100, 1, 25.0, 64
    scheduler = None

    def __init__(self) -> None:
        self.closed = False
        self.prompt_caches = object()  # the engine's voice caches: a release drops them with the engine

    def close(self) -> None:
        self.closed = True

    def builtin_voices(self) -> dict[str, Any]:
        return {"x": object()}

    def synthesize(self, text: str, voice: Any = None, *options: Any) -> Iterator[str]:
        assert not self.closed
        yield from text.split()

    def make_voice(self, prompt: Any, prompt_text: str = "", name: str = "voice") -> tuple[Any, str, str]:
        return prompt, prompt_text, name

    def segment_cap(self, prompt: Any, *options: Any) -> int:
        assert not self.closed
        return 7


def wait_for(condition: Any, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_released_when_idle_and_loaded_again_on_use() -> None:
    made: list[FakeEngine] = []
    engine = UnloadingEngine(lambda: made.append(FakeEngine()) or made[-1], idle_s=0.2, poll_s=0.02)
    try:
        assert engine.loaded and engine.sample_rate == 100 and list(engine.builtin_voices()) == ["x"]
        assert engine.prompt_caches is made[0].prompt_caches
        wait_for(lambda: not engine.loaded)
        assert made[0].closed and engine.unloads == 1 and engine.prompt_caches is None  # read without loading
        assert not engine.loaded
        assert engine.sample_rate == 100 and engine.token_rate == 25.0  # kept
        assert engine.segment_cap(None) == 7  # a call loads it again
        voice = engine.make_voice("a.wav", "text", name="alice")  # keyword arguments pass through
        assert voice == ("a.wav", "text", "alice")
        assert len(made) == 2 and engine.loaded and engine.loads == 2
    finally:
        engine.close()
    assert made[-1].closed


def test_never_released_while_an_iteration_holds_it() -> None:
    made: list[FakeEngine] = []
    engine = UnloadingEngine(lambda: made.append(FakeEngine()) or made[-1], idle_s=0.1, poll_s=0.02)
    try:
        chunks = engine.synthesize("a b c", None)
        assert next(chunks) == "a"
        time.sleep(0.4)  # idle far past 0.1 s, but held
        assert engine.loaded and list(chunks) == ["b", "c"]
        wait_for(lambda: not engine.loaded)  # released once the iteration ended
        chunks = engine.synthesize("d e", None)
        next(chunks)
        del chunks  # dropped half way: the hold goes with it
        wait_for(lambda: not engine.loaded)
    finally:
        engine.close()


def test_a_bad_idle_time_is_refused() -> None:
    with pytest.raises(ConfigError, match="unload_after"):
        UnloadingEngine(FakeEngine, idle_s=0)
