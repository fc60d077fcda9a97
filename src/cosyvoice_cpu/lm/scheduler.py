"""Continuous batching of the LM across concurrent requests: one decode call per step for every active stream.

Without it, N concurrent requests make N one-row LM calls per token and fight over the cores. With it, one thread
owns a KV cache of ``max_rows`` rows; a request that arrives is given a free row, prefilled on its own and then
joins the next step, where the speech tokens of *all* active rows are decoded in a single call
(:meth:`~cosyvoice_cpu.lm.session.LMSession.decode` takes rows of different lengths). Each request samples from its own
row with its own random source and sampling settings, so a request's tokens depend only on its seed, never on its
neighbours (up to float rounding: a batched GEMM may round differently from a one-row one; with the default int8w
weights the kernels are row-independent).

The flow and vocoder stay in the requesting thread: they consume tokens from a queue while the scheduler decodes
ahead. Closing the token iterator (a client that went away) cancels the request at the next step and frees its row.
A text stream (:meth:`LMScheduler.submit_stream`) takes a row once its first input exists and, while it waits for
text, is left out of the steps of the others.

    scheduler = LMScheduler(engine.lm, max_rows=8)
    for token in scheduler.submit(text_ids, prompt_ids, prompt_speech, draw=draw):
        ...
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from cosyvoice_cpu.errors import ConfigError, need
from cosyvoice_cpu.lm.bistream import BistreamRequest
from cosyvoice_cpu.lm.generate import SpeechTokenGenerator, TokenRequest
from cosyvoice_cpu.lm.hold import Hold
from cosyvoice_cpu.lm.hold import notify as _notify
from cosyvoice_cpu.lm.kv_cache import KEEP_POSITIONS

logger = logging.getLogger(__name__)

_END = object()  # end of a request's token stream
IDLE_CHECK_S = 1.0  # a scheduler whose rows are all held is woken by a release or a cancel; this is a safety net
IDLE_EXIT_S = 2.0  # the thread ends after this long without any request


@dataclass
class SchedulerStats:
    """Counters since start (read by ``/metrics``; updated by the scheduler thread only)."""

    requests: int = 0
    tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    batch_sizes: Counter = field(default_factory=Counter)  # rows per decode step -> steps

    @property
    def tokens_per_second(self) -> float:
        """Speech tokens decoded per second of LM time (prefill included)."""
        busy = self.decode_seconds + self.prefill_seconds
        return self.tokens / busy if busy > 0 else 0.0


def _startable(job: _Job) -> bool:
    """Whether a waiting job can start: not a text stream, or one whose first input exists."""
    return not job.streamed or job.request.next_input() is not None


class _Job:
    """One request inside the scheduler: its TokenRequest, its row, and the queue its consumer reads."""

    def __init__(
        self, request: TokenRequest | BistreamRequest, wake: threading.Condition, hold: Hold | None = None
    ) -> None:
        self.request = request
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.row: int | None = None
        self.pending: int | None = None  # the last token, to be fed back at the next step
        self.cancelled = threading.Event()
        self.hold = hold
        self._wake = wake

    @property
    def held(self) -> bool:
        """Paused after ``hold.after`` tokens until the hold is released (see :meth:`LMScheduler.submit`)."""
        return self.hold is not None and len(self.request.tokens) >= self.hold.after and not self.hold.released

    @property
    def ready(self) -> bool:
        """Has a token to feed back, and is neither cancelled nor held: the next decode step includes it."""
        return self.pending is not None and not self.cancelled.is_set() and not self.held

    @property
    def streamed(self) -> bool:
        """A text stream's request (:class:`BistreamRequest`): between decode runs it waits for text."""
        return isinstance(self.request, BistreamRequest)

    def input_ready(self) -> bool:
        """A text stream between decode runs whose next input exists (no token pending, not finished)."""
        return (
            self.streamed
            and self.pending is None
            and not self.request.finished
            and not self.cancelled.is_set()
            and not self.held
            and self.request.next_input() is not None
        )

    def deliver(self, token: int | None) -> bool:
        """Hand a sampled token (or the end) to the consumer; True while the job goes on."""
        if token is not None:
            self.out.put(token)
        if self.request.finished or (token is None and not self.streamed):
            self.out.put(_END)
            return False
        self.pending = token  # None: a text stream awaiting its next text group keeps its row
        return True

    def tokens(self) -> Iterator[int]:
        """The consumer side: blocks for each token; closing it cancels the job."""
        try:
            while True:
                item = self.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled.set()
            _notify(self._wake)  # a held row is freed now, not when the scheduler next happens to look


class LMScheduler:
    """Decodes the LM for every submitted request in shared batched steps (one background thread).

    Args:
        generator: the engine's :class:`SpeechTokenGenerator` (its session runs the batched calls).
        max_rows: KV-cache rows, i.e. requests decoded at once; more wait in line (FIFO) for a free row.
        keep_positions: KV-cache positions a freed row keeps resident; a longer request's pages beyond them are
            given back when it leaves its row (:meth:`~cosyvoice_cpu.lm.kv_cache.KVCache.release`).
    """

    def __init__(
        self, generator: SpeechTokenGenerator, max_rows: int = 8, keep_positions: int = KEEP_POSITIONS
    ) -> None:
        need(
            isinstance(max_rows, int) and 1 <= max_rows <= 256,
            "max_rows",
            max_rows,
            "1 to 256 requests decoded at once",
        )
        need(
            isinstance(keep_positions, int) and keep_positions >= 0,
            "keep_positions",
            keep_positions,
            "KV-cache positions (>= 0) a freed row keeps",
        )
        self.generator = generator
        self.max_rows = max_rows
        self.keep_positions = keep_positions
        self.stats = SchedulerStats()
        self._cache = generator.session.new_cache(max_rows)
        self._waiting: deque[_Job] = deque()
        self._active: dict[int, _Job] = {}  # row -> job
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def active(self) -> int:
        """Requests holding a row now."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return len(self._waiting)

    def submit(
        self,
        text: Sequence[int],
        prompt_text: Sequence[int] = (),
        prompt_speech: Sequence[int] = (),
        hold: Hold | None = None,
        **kw: object,
    ) -> Iterator[int]:
        """Queue a request (arguments of :meth:`SpeechTokenGenerator.request`, checked now) and return its
        speech tokens as they are decoded. Raises ConfigError at once for bad input or after :meth:`close`.

        ``hold=Hold(n)`` pauses the request after n tokens until ``hold.release()``. A streaming caller holds
        the LM at its first chunk while that chunk's flow runs: on a small machine, decoding ahead would only
        take cores from the first audio.
        """
        if kw.get("cache") is not None:
            raise ConfigError("the scheduler owns the KV cache; do not pass cache= to submit")
        return self.run(self.generator.request(text, prompt_text, prompt_speech, **kw), hold)

    def submit_stream(self, request: BistreamRequest, hold: Hold | None = None) -> Iterator[int]:
        """Queue a text stream's request (:mod:`cosyvoice_cpu.lm.bistream`); its speech tokens as decoded. It
        takes a row once its first input exists; while it waits for text the other rows' steps go on."""
        request.wake = lambda: _notify(self._wake)
        return self.run(request, hold)

    def run(self, request: TokenRequest | BistreamRequest, hold: Hold | None = None) -> Iterator[int]:
        """Queue a request made by the caller (see :meth:`submit`)."""
        if hold is not None:
            hold.attach(self._wake)
        job = _Job(request, self._wake, hold)
        with self._wake:
            if self._closed:
                raise ConfigError("the LM scheduler is closed (the engine is shutting down)")
            self._waiting.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lm-scheduler", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job.tokens()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still queued or running end with a ConfigError."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ---- the scheduler thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._active:
                    if not self._wake.wait(IDLE_EXIT_S) and not self._waiting and not self._active:
                        # idle: end the thread (the next submit starts another), so an engine that is dropped
                        # without close() is not kept alive, sessions and KV cache included, by its thread
                        self._thread = None
                        return
                if self._closed:
                    break
                admit = self._admissible()
            try:
                busy = self._step(admit)
            except Exception:  # never let the thread die: _step already failed the jobs involved
                logger.exception("LM scheduler step failed")
                busy = True
            if not busy:  # every active row is held: sleep until a release, a cancel or a new request
                with self._wake:
                    if not self._closed and not self._runnable():
                        self._wake.wait(IDLE_CHECK_S)
        error = ConfigError("the LM scheduler was closed before this request finished")
        with self._wake:
            jobs = list(self._waiting) + list(self._active.values())
            self._waiting.clear()
            self._active.clear()
        for job in jobs:
            job.out.put(error)

    def _runnable(self) -> bool:
        """Whether a step would do anything now: admit a waiting request into a free row, drop a cancelled row or
        decode one that is not held (called under ``_wake``)."""
        if any(j.streamed and j.request.finished for j in self._waiting):
            return True
        if len(self._active) < self.max_rows and any(_startable(j) for j in self._waiting):
            return True
        return any(
            j.cancelled.is_set() or j.ready or j.input_ready() or (j.streamed and j.request.finished)
            for j in self._active.values()
        )

    def _admissible(self) -> list[_Job]:
        """Take the waiting jobs that get a row now, first come first served (called under ``_wake``). A text
        stream whose first input does not exist yet keeps its place without a row; a cancelled job leaves."""
        admit, keep = [], deque()
        for job in self._waiting:
            if job.cancelled.is_set():
                continue
            if job.streamed and job.request.finished:  # a text stream cancelled before it got a row
                job.out.put(_END)
                continue
            if len(self._active) + len(admit) < self.max_rows and _startable(job):
                admit.append(job)
            else:
                keep.append(job)
        self._waiting = keep
        return admit

    def _free_row(self) -> int:
        return min(set(range(self.max_rows)) - set(self._active))

    def _step(self, admit: list[_Job]) -> bool:
        """Drop cancelled jobs, prefill the newcomers (one row each), then one decode over all active rows that
        are not held. Returns whether anything was run."""
        for row, job in list(self._active.items()):
            if job.cancelled.is_set():
                logger.debug("row %d cancelled", row)
                self._vacate(row)
            elif job.streamed and job.pending is None and job.request.finished:  # a text stream cancelled
                job.out.put(_END)
                self._vacate(row)
        for job in admit:
            if job.cancelled.is_set():
                continue
            row = self._free_row()
            self._active[row] = job
            self.stats.requests += 1
            t0 = time.perf_counter()
            try:
                job.request.attach(self._cache, row)
                first = self._feed(job) if job.streamed else job.request.advance(job.request.prefill())
            except Exception as e:  # a bad request fails alone
                self._fail([row], e)
                continue
            finally:
                self.stats.prefill_seconds += time.perf_counter() - t0
            self._deliver(row, first)
        fed = False
        for row, job in list(self._active.items()):  # text streams whose next text group has come
            if row not in self._active or not job.input_ready():
                continue
            t0 = time.perf_counter()
            try:
                token = self._feed(job)
            except Exception as e:
                self._fail([row], e)
                continue
            finally:
                self.stats.prefill_seconds += time.perf_counter() - t0
            self._deliver(row, token)
            fed = True
        rows = sorted(r for r, j in self._active.items() if j.ready)
        if not rows:
            return bool(admit) or fed
        tokens = [self._active[r].pending for r in rows]
        t0 = time.perf_counter()
        try:
            logps = self.generator.session.decode(self._cache, rows, tokens)
        except Exception as e:
            self._fail(rows, e)
            return True
        finally:
            self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self.stats.batch_sizes[len(rows)] += 1
        for row, logp in zip(rows, logps):
            job = self._active[row]
            job.pending = None
            try:
                token = job.request.advance(np.asarray(logp))
            except Exception as e:
                self._fail([row], e)
                continue
            self._deliver(row, token)
        return True

    def _feed(self, job: _Job) -> int | None:
        """Run a text stream's next input (T positions) on its row alone and sample after it."""
        request = job.request
        embeds = request.next_input()
        if embeds is None or not request.room_for(embeds):
            return None
        request.fed(embeds)
        return request.advance(self.generator.session.prefill(self._cache, request.row, embeds))

    def _deliver(self, row: int, token: int | None) -> None:
        if token is not None:
            self.stats.tokens += 1
        if not self._active[row].deliver(token):
            self._vacate(row)

    def _vacate(self, row: int) -> _Job | None:
        """Take the job off ``row`` and give the row's memory past the usual working size back (KVCache.release:
        the cache lives as long as the engine, and one long sentence would otherwise keep its pages)."""
        job = self._active.pop(row, None)
        released = self._cache.release(row, self.keep_positions)
        if released:
            logger.debug("row %d: %.1f MB of KV cache released", row, released / 2**20)
        return job

    def _fail(self, rows: list[int], error: Exception) -> None:
        logger.warning("LM failed for %d request(s): %s", len(rows), error)
        for row in rows:
            job = self._vacate(row)
            if job is not None:
                job.out.put(error)
