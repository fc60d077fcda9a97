"""``--unload-after S``: an engine that gives its memory back after S idle seconds and loads again on the next use,
for a small box that runs other things too (docs/wyoming.md has the measured costs).

:class:`UnloadingEngine` stands where the servers keep their engine (``State.engine``). What a server reads without
working (model directory, manifest, sample rate, token rate, KV positions, built-in voices) is kept from the first
load; every call that works (``synthesize``, ``make_voice``, ``lm_prompt``, ``segment_cap``) takes the engine,
loading it first when it was released, and holds it until that call (for ``synthesize``: its iteration) is over.
A reaper thread releases it once nothing has held it for S seconds: the engine is closed, dropped, the garbage
collected, ONNX Runtime's shared arena shrunk and glibc's free memory returned (``malloc_trim``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cosyvoice_cpu.backends.registry import release_idle_memory
from cosyvoice_cpu.errors import need
from cosyvoice_cpu.hardware.malloc import trim_heaps
from cosyvoice_cpu.hardware.pages import status_mb
from cosyvoice_cpu.server.engine_api import PromptAudio

if TYPE_CHECKING:
    from cosyvoice_cpu.config import AudioChunk, SynthesisConfig
    from cosyvoice_cpu.engine import Engine, Timings
    from cosyvoice_cpu.families.base import LMPrompt
    from cosyvoice_cpu.flow.prompt_caches import PromptCaches
    from cosyvoice_cpu.lm.scheduler import LMScheduler
    from cosyvoice_cpu.text_stream import TextStream
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident memory (MB), 0 where /proc is not there."""
    return status_mb("VmRSS") or 0.0


class _Held:
    """An iterator of the engine's chunks that releases its hold on the engine once, however it ends."""

    def __init__(self, chunks: Iterator[AudioChunk], release: Callable[[], None]) -> None:
        self.chunks, self._release = chunks, release
        self.done = False

    def __iter__(self) -> _Held:
        return self

    def __next__(self) -> AudioChunk:
        try:
            return next(self.chunks)
        except BaseException:
            self.release()
            raise

    def close(self) -> None:
        try:
            close = getattr(self.chunks, "close", None)
            if close is not None:
                close()
        finally:
            self.release()

    def release(self) -> None:
        if not self.done:
            self.done = True
            self._release()

    def __del__(self) -> None:
        self.release()


class UnloadingEngine:
    """An :class:`~cosyvoice_cpu.engine.Engine` that is released after ``idle_s`` seconds without use.

    Args:
        load: loads the engine (``lambda: Engine.load(model_dir, config)``); called now and after each release.
        idle_s: seconds without use before the engine is released (above 0).
        poll_s: how often the reaper looks (default: a quarter of ``idle_s``, at most 1 s).
    """

    def __init__(self, load: Callable[[], Engine], idle_s: float, poll_s: float | None = None) -> None:
        need(0 < idle_s <= 7 * 86_400, "unload_after", idle_s, "above 0, at most a week (seconds)")
        self._load, self.idle_s = load, float(idle_s)
        self._lock = threading.Lock()
        self._engine: Engine | None = load()
        self._users = 0
        self._releasing = False
        self._last = time.monotonic()
        self.loads, self.unloads = 1, 0
        self.last_load_s = 0.0
        e = self._engine
        self.model_dir, self.manifest, self.sample_rate, self.threads = (
            e.model_dir,
            e.manifest,
            e.sample_rate,
            e.threads,
        )
        self.token_rate, self.kv_cache_positions = e.token_rate, e.kv_cache_positions
        self._builtin = e.builtin_voices()
        self._stop = threading.Event()
        poll = poll_s if poll_s is not None else min(1.0, self.idle_s / 4)
        self._reaper = threading.Thread(target=self._reap, args=(poll,), name="engine-unload", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------ holding

    @property
    def loaded(self) -> bool:
        """Whether the engine holds its memory: False once a release has finished (not while it runs)."""
        return self._engine is not None or self._releasing

    def _acquire(self) -> Engine:
        with self._lock:
            self._users += 1
            if self._engine is None:
                t0 = time.perf_counter()
                try:
                    self._engine = self._load()
                except BaseException:
                    self._users -= 1
                    raise
                self.loads += 1
                self.last_load_s = time.perf_counter() - t0
                logger.info("engine loaded again in %.2f s (RSS %.0f MB)", self.last_load_s, rss_mb())
            return self._engine

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            self._last = time.monotonic()

    @contextmanager
    def _held(self) -> Iterator[Engine]:
        """The engine (loaded first when released), held for the ``with`` block."""
        engine = self._acquire()
        try:
            yield engine
        finally:
            self._release()

    # ------------------------------------------------------------------ the engine's calls

    def synthesize(
        self,
        text: str | Iterable[str],
        voice: Voice,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        timings: Timings | None = None,
        check: Callable[[], None] | None = None,
    ) -> Iterator[AudioChunk]:
        """``Engine.synthesize``; the engine is held until the iteration ends (or the iterator is dropped)."""
        engine = self._acquire()
        try:
            chunks = engine.synthesize(text, voice, config, instruct, timings, check)
        except BaseException:
            self._release()
            raise
        return _Held(chunks, self._release)

    def open_text_stream(
        self,
        voice: Voice,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        check: Callable[[], None] | None = None,
        timings: Timings | None = None,
    ) -> _HeldStream:
        """``Engine.open_text_stream``; the engine is held until the stream's iteration ends."""
        engine = self._acquire()
        try:
            stream = engine.open_text_stream(voice, config, instruct, check, timings)
        except BaseException:
            self._release()
            raise
        return _HeldStream(stream, self._release)

    def make_voice(self, prompt: PromptAudio, prompt_text: str = "", name: str = "voice") -> Voice:
        with self._held() as engine:
            return engine.make_voice(prompt, prompt_text, name)

    def lm_prompt(self, voice: Voice, instruct: str | None = None, normalize: bool = True) -> LMPrompt:
        with self._held() as engine:
            return engine.lm_prompt(voice, instruct, normalize)

    def segment_cap(
        self, prompt: LMPrompt, max_tokens: int | None = None, minimum: int = 8, ratio: float | None = None
    ) -> int:
        with self._held() as engine:
            return engine.segment_cap(prompt, max_tokens, minimum, ratio)

    def builtin_voices(self) -> dict[str, Voice]:
        return dict(self._builtin)

    @property
    def scheduler(self) -> LMScheduler | None:
        """The loaded engine's LM scheduler (None while released: its counters start again at the next load)."""
        engine = self._engine
        return None if engine is None else engine.scheduler

    @property
    def prompt_caches(self) -> PromptCaches | None:
        """The loaded engine's voice caches (None while released: a release frees them with the engine)."""
        engine = self._engine
        return None if engine is None else engine.prompt_caches

    # ------------------------------------------------------------------ releasing

    def _reap(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            taken: list[Engine] = []  # the engine is handed over in a list: no frame of this loop keeps it alive
            with self._lock:
                idle = time.monotonic() - self._last
                if self._engine is not None and self._users == 0 and idle >= self.idle_s:
                    taken.append(self._engine)
                    self._engine, self._releasing = None, True
            if taken:
                try:
                    self._unload(taken, idle)
                except Exception as e:  # the reaper goes on; the next use loads a fresh engine
                    logger.error("releasing the engine failed: %s", e, exc_info=e)
                finally:
                    self._releasing = False

    def _unload(self, taken: list[Engine], idle: float) -> None:
        before = rss_mb()
        taken.pop().close()  # the last reference: the sessions, caches and the scheduler go with it
        gc.collect()
        release_idle_memory()  # ONNX Runtime's process-wide arena keeps its regions after its sessions closed
        trim_heaps()
        self.unloads += 1
        logger.info("engine released after %.0f s idle: RSS %.0f -> %.0f MB", idle, before, rss_mb())

    def close(self) -> None:
        """Stop the reaper and close the engine if it is loaded."""
        self._stop.set()
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


class _HeldStream:
    """A text stream (``feed``/``close``/``cancel``/iterate) that holds the engine until its iteration ends."""

    def __init__(self, stream: TextStream, release: Callable[[], None]) -> None:
        self.stream = stream
        self.held = _Held(iter(()), release)

    def feed(self, text: str) -> None:
        self.stream.feed(text)

    def close(self) -> None:
        self.stream.close()

    def cancel(self) -> None:
        self.stream.cancel()

    def __iter__(self) -> Iterator[AudioChunk]:
        try:
            yield from self.stream
        finally:
            self.held.release()
