"""``POST /v1/audio/speech``: the OpenAI request body, admission (bounded queue), and running one synthesis.

A synthesis runs in a worker thread (at most ``max_active`` at once; their LM steps are batched by the engine's
scheduler). Audio chunks are encoded in the worker and cross to the event loop through a bounded queue as they
are produced, so the first chunk is on the wire while later ones are synthesized, and a slow reader pauses its
own synthesis. A client that goes away (seen by a watcher of the ASGI receive channel, also before the first
chunk) sets the job's cancel flag; the engine checks it at every speech token, so the work stops within one LM
step or one flow call. The request's slot is freed when the worker thread
has actually stopped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.server.checks import MAX_MODEL_CHARS, MAX_VOICE_CHARS
from cosyvoice_cpu.server.trim import HeapTrim

if TYPE_CHECKING:
    from cosyvoice_cpu.config import AudioChunk
    from cosyvoice_cpu.server.encode import Encoder

logger = logging.getLogger(__name__)

MAX_PENDING_CHUNKS = 8  # encoded chunks a worker may have made ahead of the client (see Job.chunks)


class SpeechOptions(BaseModel):
    """The fields a speech request and a text stream's ``start`` message (``server.text_ws``) share: model, voice,
    instructions, speed and the synthesis extensions, validated the same way.

    Strict: unknown fields are refused, and so are values of the wrong JSON type (``"speed": "1.0"``,
    ``"stream": "yes"``); an integer is taken for a number. The text fields' limits are the server's settings,
    checked in the handler (``server.checks``); the schema at ``/openapi.json`` states them.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        max_length=MAX_MODEL_CHARS,
        description="the served model id (GET /v1/models), its family "
        "name (cosyvoice2, ...) or an OpenAI name: tts-1, tts-1-hd, gpt-4o-mini-tts, "
        "gpt-4o-mini-tts-2025-12-15",
    )
    voice: str = Field(
        max_length=MAX_VOICE_CHARS,
        description="a saved voice (GET /v1/audio/voices), or an OpenAI "
        "voice name (alloy, ...) when the server has a --default-voice",
    )
    instructions: str | None = Field(None, description="speaking instruction: instruct mode (e.g. 'Speak happily.')")
    speed: float = Field(
        1.0,
        json_schema_extra={"minimum": 0.25, "maximum": 4.0},
        description="speaking rate: "
        "0.25 to 4.0 is taken, and clamped to the 0.5 to 2.0 this server speaks at (the "
        "X-Speed-Clamped header says so)",
    )
    # extensions
    stream: bool = Field(
        True,
        description="true: synthesize chunk by chunk within sentences and send each chunk "
        "as it is made (low first-audio latency; wav and flac then carry an unknown length); "
        "false: a sentence at a time, and the whole file is sent at the end with its real "
        "length",
    )
    seed: int | None = Field(None, description="random seed: the same seed gives the same audio")
    flow_steps: int | None = Field(
        None, description="Euler steps of the flow (default: the server's --flow-steps, 10 unless set; fewer = faster)"
    )
    cfg_rate: float | None = None
    first_chunk_tokens: int | None = Field(None, description="speech tokens (25 per second) in the first chunk")
    chunk_tokens: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None
    normalize: bool | None = Field(None, description="text normalization of numbers, dates, symbols (default on)")

    def synthesis_config(self, base: SynthesisConfig, speed: float) -> SynthesisConfig:
        """The engine config: ``base`` with this request's fields and ``speed`` (the clamped one; validated:
        ConfigError names a bad field)."""
        changes: dict[str, object] = {"speed": speed, "stream": self.stream}
        for name in (
            "seed",
            "flow_steps",
            "cfg_rate",
            "first_chunk_tokens",
            "chunk_tokens",
            "top_p",
            "top_k",
            "win_size",
            "tau_r",
            "normalize",
        ):
            value = getattr(self, name)
            if value is not None:
                changes[name] = value
        if "first_chunk_tokens" in changes and "chunk_tokens" not in changes:
            changes["chunk_tokens"] = max(base.chunk_tokens, changes["first_chunk_tokens"])
        return base.with_(**changes)


class SpeechRequest(SpeechOptions):
    """The OpenAI ``/v1/audio/speech`` body plus documented extensions (:class:`SpeechOptions`)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "examples": [{"model": "tts-1", "input": "Good morning.", "voice": "alloy", "response_format": "wav"}]
        },
    )

    input: str = Field(description="text to speak")
    response_format: str = Field(
        "mp3", max_length=16, description="mp3, opus (Ogg), flac, wav or pcm (16-bit mono little-endian)"
    )
    stream_format: Literal["audio", "sse"] = Field("audio", description="audio bytes, or server-sent events")


class Rejected(Exception):
    """The server is full (429) or shutting down (503)."""

    def __init__(self, status: int, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class Cancelled(Exception):
    """The client went away."""


class StreamAborted(Exception):
    """Raised out of a non-SSE speech body (already counted) so the server cuts the connection instead of ending
    the chunked body cleanly: the client can tell truncated audio from complete audio."""


class TimedOut(Exception):
    """The request ran past the server's per-request timeout."""


class AudioTooLong(Exception):
    """The request's audio ran past the bound the server sets for its input (``AudioBound``)."""


@dataclass(frozen=True)
class AudioBound:
    """The most audio one request may produce: ``floor_s`` plus ``per_char_s`` per input character, divided by the
    speed (slower speech is longer), and at most ``max_s`` (``--max-audio-per-char``, ``--max-audio-seconds``).

    Speech runs at ~0.07 s per character in English and ~0.25 in Chinese; numbers read out digit by digit reach
    ~0.4. A model that does not stop (random weights; a real one on odd input) ran on to the engine's own per
    sentence cap: 1,615 s of audio for 4,096 characters in issue #35.
    """

    per_char_s: float = 0.6
    max_s: float = 1200.0
    floor_s: float = 10.0

    def seconds(self, chars: int, speed: float = 1.0) -> float:
        return min(self.max_s, self.floor_s + self.per_char_s * chars / speed)

    def problem(self, chars: int, speed: float) -> str:
        """The message of a request stopped at its bound."""
        limit = self.seconds(chars, speed)
        rule = (
            f"{self.floor_s:g} s + {self.per_char_s:g} s per input character"
            + (f" at speed {speed:g}" if speed != 1 else "")
            + f", at most {self.max_s:g} s"
        )
        return (
            f"the speech passed the server's limit of {limit:g} s of audio for {chars} characters of input "
            f"({rule}: --max-audio-per-char, --max-audio-seconds) and was stopped: the model did not come to an "
            "end on this text; split it into shorter requests, or try another seed"
        )


class Admission:
    """Bounds the work: ``max_active`` syntheses run, up to ``max_queue`` more wait; beyond that, 429. Each
    synthesis that leaves tells ``heap_trim``, which returns glibc's free heap memory once the server is idle
    (:mod:`cosyvoice_cpu.server.trim`)."""

    def __init__(self, max_active: int, max_queue: int) -> None:
        self.max_active, self.max_queue = max_active, max_queue
        self.active = 0
        self.waiting = 0
        self.draining = False
        self._slots = asyncio.Semaphore(max_active)
        self.heap_trim = HeapTrim(lambda: self.active == 0 and self.waiting == 0)

    async def enter(self) -> float:
        """Wait for a slot; returns the seconds waited. Raises Rejected when full or draining."""
        if self.draining:
            raise Rejected(503, "the server is shutting down; retry on another instance", 5)
        if self.active + self.waiting >= self.max_active + self.max_queue:
            raise Rejected(429, f"the server is busy ({self.active} running, {self.waiting} queued); retry later", 2)
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        return time.perf_counter() - t0

    def leave(self) -> None:
        self.active -= 1
        self._slots.release()
        self.heap_trim.left()


@dataclass(eq=False)  # compared and hashed by identity: the app keeps the running ones in a set
class Job:
    """One synthesis crossing from a worker thread to the event loop."""

    run: Callable[[Callable[[], None]], Iterator[AudioChunk]]  # run(check) -> the synthesis's chunks
    timeout: float
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
    first_audio: float | None = None
    audio: float = 0.0
    future: asyncio.Future[None] | None = None  # the worker's asyncio future, once started
    # the audio bound: its seconds, the message, and how tokens and samples count towards it (0: not counted)
    max_audio_s: float = float("inf")
    too_long: str = ""
    token_seconds: float = 0.0  # seconds of audio per speech token (1 / token rate / speed)
    sample_rate: int = 0
    tokens: int = 0
    samples: int = 0

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the event loop) once the worker thread has stopped, or now if it never ran or
        already stopped: the request's slot is freed then, not when the client went away."""
        if self.future is None or self.future.done():
            callback()
        else:
            self.future.add_done_callback(lambda _: callback())

    def check(self) -> None:
        if self.cancel.is_set():
            raise Cancelled("the client disconnected")
        if time.perf_counter() - self.started > self.timeout:
            raise TimedOut(f"synthesis took longer than the server's timeout of {self.timeout:g} s")

    def token_check(self) -> None:
        """:meth:`check`, called by the engine after every speech token; also stops the request at its audio
        bound, counted in tokens (before the flow renders them: a runaway sentence costs nothing more)."""
        self.tokens += 1
        if self.tokens * self.token_seconds > self.max_audio_s:
            raise AudioTooLong(self.too_long)
        self.check()

    def count_samples(self, n: int) -> None:
        """Count ``n`` samples of made audio towards the bound (exact, where tokens are an estimate)."""
        self.samples += n
        if self.sample_rate and self.samples > self.max_audio_s * self.sample_rate:
            raise AudioTooLong(self.too_long)

    async def chunks(self, executor: Executor, encoder: Encoder) -> AsyncIterator[bytes]:
        """Run the synthesis on ``executor`` and yield each chunk as ``encoder`` (a server ``Encoder``) encodes it,
        then the encoder's tail.

        The encoding runs in the worker thread too: compressed formats cost CPU that would otherwise stall the
        event loop, and with it every other stream. At most :data:`MAX_PENDING_CHUNKS` encoded chunks wait for
        the client: a slow reader pauses its own synthesis (backpressure) instead of piling audio up in memory;
        the wait still ends at a cancel or the timeout. Exceptions of the synthesis are raised here; closing this
        iterator cancels the synthesis.
        """
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        room = threading.Semaphore(MAX_PENDING_CHUNKS)
        done = object()

        def put(samples: int, data: bytes) -> None:
            while not room.acquire(timeout=0.1):
                self.check()  # the client is gone or the time is up: stop waiting for it
            loop.call_soon_threadsafe(q.put_nowait, (samples, data))

        def work() -> None:
            try:
                for chunk in self.run(self.token_check):
                    self.check()
                    self.count_samples(len(chunk.samples))
                    put(len(chunk.samples), encoder.push(chunk.samples))
                put(0, encoder.finish())
                loop.call_soon_threadsafe(q.put_nowait, done)
            except BaseException as e:  # handed to the event loop and raised there
                loop.call_soon_threadsafe(q.put_nowait, e)

        future = self.future = loop.run_in_executor(executor, work)
        try:
            while True:
                item = await q.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                room.release()
                samples, data = item
                if self.first_audio is None and samples:
                    self.first_audio = time.perf_counter() - self.started
                self.audio += samples
                yield data
        finally:
            self.cancel.set()  # a no-op when finished; stops the worker when the client went away
            await asyncio.shield(future)  # (under a cancelled task this may raise at once: see Job.when_done)
