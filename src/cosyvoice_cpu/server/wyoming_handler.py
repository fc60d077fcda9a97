"""One Wyoming connection: ``describe`` -> ``info``; ``synthesize`` -> ``audio-start``, ``audio-chunk`` s,
``audio-stop``; ``synthesize-start``/``-chunk``/``-stop`` -> per sentence ``audio-start``/chunks/``audio-stop``, then
``synthesize-stopped``; ``ping`` -> ``pong``; anything else -> ``error``.

Events are read by the ``wyoming`` package's ``async_read_event`` through
:class:`~cosyvoice_cpu.server.wyoming_reader.BoundedReader`, which refuses an announced data or payload length past
the limit before reading it. Synthesis runs as a task beside the reading loop, so ``describe`` is answered while
audio is made (on the loop, with the voices listed off it: never behind a synthesis slot), a client that hangs up is
seen at once and its work is cancelled, and streamed text is fed while earlier sentences are spoken. A request the
server refuses (bad text, unknown voice or language, server busy) or a synthesis that fails gets an ``error`` event
(``text``, ``code``) and the connection is closed (after a bad event, in order: :func:`~.wyoming_reader.linger`):
Home Assistant reads a TTS answer until ``audio-stop`` or the end of the connection and skips other events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from cosyvoice_cpu.errors import ConfigError, WorkCancelled
from cosyvoice_cpu.server.checks import RequestProblem, check_text
from cosyvoice_cpu.server.speech import AudioTooLong, Cancelled, Job, Rejected, TimedOut
from cosyvoice_cpu.server.wyoming_audio import WIDTH, TextInbox, pump, resolve_voice
from cosyvoice_cpu.server.wyoming_reader import BoundedReader, linger

if TYPE_CHECKING:
    from cosyvoice_cpu.config import AudioChunk
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

ENDPOINT = "wyoming"  # the metrics label of Wyoming syntheses


class CosyVoiceHandler(AsyncEventHandler):
    """The events of one connection (see the module doc); ``service`` is its
    :class:`~cosyvoice_cpu.server.wyoming.WyomingService`."""

    def __init__(self, service: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.service, self.state = service, service.state
        self.options = service.options
        self.bounded = BoundedReader(reader, self.options.max_event_bytes)
        self.task: asyncio.Task | None = None  # the synthesis running (one-shot or streamed)
        self.stream: TextInbox | None = None  # the open text stream (synthesize-start .. synthesize-stop)
        self.stream_chars = 0
        self.job: Job | None = None
        self.closed = False
        self.failed = False  # an error event was sent

    # ------------------------------------------------------------------ the connection

    async def run(self) -> None:
        """Read events until the client closes, a bad event, an idle timeout or a refusal; then clean up."""
        service = self.service
        if service.connections >= self.options.max_connections:
            await self.fail(f"the server has {service.connections} connections open, its limit; retry later", "busy")
            await linger(self.reader, self.writer)
            self.writer.close()
            return
        service.connections += 1
        service.handlers.add(self)
        try:
            while not self.closed:
                event = await self._next_event()
                if event is None or not await self.handle_event(event):
                    break
        finally:
            service.connections -= 1
            service.handlers.discard(self)
            if self.failed:  # an error was sent: let the client read it before the connection ends
                await linger(self.reader, self.writer)
            await self.close()

    async def _next_event(self) -> Event | None:
        """The next event; None at the end of the connection, after a bad event (answered with an ``error``) or
        after ``idle_timeout`` seconds with nothing sent and nothing running."""
        read = asyncio.ensure_future(async_read_event(self.bounded))
        idle_since = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self.options.idle_timeout)
                if done:
                    break
                if self.task is not None and not self.task.done():
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.options.idle_timeout:
                    logger.info("closing a Wyoming connection idle for %g s", self.options.idle_timeout)
                    await self.fail(f"no event for {self.options.idle_timeout:g} s: closing", "idle_timeout")
                    return None
            event = read.result()
        except (asyncio.IncompleteReadError, ConnectionError):
            return None  # the client went away in the middle of an event
        except (TypeError, AttributeError, KeyError, asyncio.LimitOverrunError) as e:  # JSON of the wrong shape
            await self.fail(f"a malformed event ({type(e).__name__}: {e})", "bad_event")
            return None
        finally:
            if not read.done():
                read.cancel()
        if event is None and (problem := self.bounded.problem()):
            logger.warning("Wyoming client sent %s: closing its connection", problem)
            await self.fail(f"refused {problem}; closing the connection", "bad_event")
        return event

    async def fail(self, message: str, code: str) -> None:
        """Send an ``error`` event (if the client is still there)."""
        self.failed = True
        try:
            await self.write_event(Error(text=message, code=code).event())
        except (ConnectionError, RuntimeError):
            pass

    async def close(self) -> None:
        """Cancel the running synthesis (its worker stops at its next speech token) and close the connection."""
        self.closed = True
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
        if self.job is not None:
            self.job.cancel.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.writer.close()
        self.reader.feed_eof()

    async def finish(self) -> None:
        """Wait for the synthesis running (stdio: the input ended before the audio)."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    # ------------------------------------------------------------------ events

    async def handle_event(self, event: Event) -> bool:
        """Answer one event; False closes the connection."""
        if Describe.is_type(event.type):
            info = await asyncio.get_running_loop().run_in_executor(None, self.service.info)
            await self.write_event(info.event())
            return True
        if Ping.is_type(event.type):
            await self.write_event(Pong(text=Ping.from_event(event).text).event())
            return True
        if Synthesize.is_type(event.type):
            if self.stream is not None:
                return True  # the whole text a streaming client also sends (Home Assistant does): spoken already
            return await self._start(self._one_shot(event))
        if SynthesizeStart.is_type(event.type):
            if self.stream is not None or (self.task is not None and not self.task.done()):
                await self.fail("one synthesis at a time on a connection", "busy")
                return True
            self.stream, self.stream_chars = TextInbox(), 0  # chunks may come before the stream is open
            return await self._start(self._streamed(event, self.stream))
        if SynthesizeChunk.is_type(event.type):
            return await self._feed(event)
        if SynthesizeStop.is_type(event.type):
            if self.stream is None:
                await self.fail("synthesize-stop without synthesize-start", "bad_event")
                return True
            self.stream.close()  # the task sends synthesize-stopped after the last audio
            self.stream = None
            return True
        await self.fail(f"unknown event type {event.type[:64]!r} (this is a TTS server)", "unknown_event")
        return True

    async def _start(self, work: Coroutine[object, object, None]) -> bool:
        """Run ``work`` (a synthesis) beside the reading loop, unless one runs already."""
        if self.task is not None and not self.task.done():
            work.close()
            await self.fail("one synthesis at a time on a connection", "busy")
            return True
        self.task = asyncio.ensure_future(work)
        return True

    async def _feed(self, event: Event) -> bool:
        if self.stream is None:
            await self.fail("synthesize-chunk without synthesize-start", "bad_event")
            return True
        limit = self.state.settings.max_input_chars
        try:
            text = event.data.get("text") if isinstance(event.data, dict) else None
            if not isinstance(text, str):
                raise RequestProblem("synthesize-chunk text must be a string", "invalid_text")
            self.stream_chars += len(text)
            if self.stream_chars > limit:
                raise RequestProblem(
                    f"the streamed text passed {limit} characters, this server's limit per request", "input_too_long"
                )
            check_text("text", text, limit, required=False)
        except RequestProblem as e:
            await self.fail(str(e), e.code)
            return False
        if self.job is not None:
            bound = self.state.settings.audio_bound
            self.job.max_audio_s = bound.seconds(self.stream_chars)
            self.job.too_long = bound.problem(self.stream_chars, 1.0)
        try:
            self.stream.feed(text)  # the engine's stream refuses text it cannot take (ConfigError, UnicodeError)
        except (ConfigError, UnicodeError) as e:
            await self.fail(str(e), "invalid_text")
            return False
        return True

    # ------------------------------------------------------------------ synthesis

    def _job(self, run: Callable[[Callable[[], None]], Iterator[AudioChunk]], chars: int) -> Job:
        settings, engine = self.state.settings, self.state.engine
        bound = settings.audio_bound
        return Job(
            run,
            settings.timeout,
            max_audio_s=bound.seconds(chars),
            too_long=bound.problem(chars, 1.0),
            token_seconds=1.0 / engine.token_rate,
            sample_rate=engine.sample_rate,
        )

    async def _admit(self) -> bool:
        """Take a synthesis slot (shared with the HTTP server); False (with an ``error`` sent) when refused."""
        try:
            await self.state.admission.enter()
        except Rejected as e:
            self.state.metrics.count(ENDPOINT, "rejected")
            await self.fail(str(e), "busy")
            return False
        return True

    def _release(self, job: Job) -> None:
        def leave() -> None:
            self.state.jobs.discard(job)
            self.state.admission.leave()

        job.when_done(leave)

    async def _one_shot(self, event: Event) -> None:
        settings = self.state.settings
        try:
            synthesize = Synthesize.from_event(event)
            text = synthesize.text
            if not isinstance(text, str):
                raise RequestProblem("synthesize text must be a string", "invalid_text")
            check_text("text", text, settings.max_input_chars)
            voice = await self._voice(event)
        except (RequestProblem, KeyError, TypeError, AttributeError) as e:
            await self._refuse(e)
            return
        if not await self._admit():
            await self.close()
            return
        config = settings.defaults.with_(stream=True)
        engine = self.state.engine
        job = self.job = self._job(lambda check: engine.synthesize(text, voice, config, check=check), len(text))
        await self._speak(job, pump(job, self.state.executor), streamed=False)

    async def _streamed(self, event: Event, inbox: TextInbox) -> None:
        try:
            SynthesizeStart.from_event(event)  # the event's shape
            voice = await self._voice(event)
        except (RequestProblem, KeyError, TypeError, AttributeError) as e:
            await self._refuse(e)
            return
        if not await self._admit():
            await self.close()
            return
        config = self.state.settings.defaults.with_(stream=True)
        engine = self.state.engine

        # run in the worker: a ConfigError of the engine comes out of pump
        def run(check: Callable[[], None]) -> Iterator[AudioChunk]:
            return iter(inbox.attach(engine.open_text_stream(voice, config, check=check)))

        job = self.job = self._job(run, max(self.stream_chars, 1))
        # a stream waiting for text decodes no token to check the time at: the timeout cancels it
        timer = asyncio.get_running_loop().call_later(self.state.settings.timeout, inbox.cancel)
        try:
            await self._speak(job, pump(job, self.state.executor, on_stop=inbox.cancel), streamed=True)
        finally:
            timer.cancel()

    async def _voice(self, event: Event) -> Voice:
        """The request's voice (reads the voices directory: off the loop)."""
        voice = event.data.get("voice")
        return await asyncio.get_running_loop().run_in_executor(None, resolve_voice, self.state, voice)

    async def _refuse(self, e: Exception) -> None:
        code = e.code if isinstance(e, RequestProblem) else "bad_event"
        self.state.metrics.count(ENDPOINT, "bad_request")
        await self.fail(str(e) if isinstance(e, RequestProblem) else f"a malformed request ({e!r})", code)
        await self.close()

    async def _speak(
        self, job: Job, chunks: AsyncIterator[tuple[bytes, tuple[str, tuple[int, int]]]], streamed: bool
    ) -> None:
        """Send the audio of ``chunks`` (one-shot: one audio-start..audio-stop; streamed: one per sentence, then
        synthesize-stopped); on failure an ``error`` and the connection closes. The slot is freed when the worker
        has stopped."""
        self.state.jobs.add(job)
        rate, n = self.state.engine.sample_rate, self.options.samples_per_chunk
        sent = 0  # samples
        sentence: tuple[str, tuple[int, int]] | None = None
        outcome = "cancelled"
        try:
            if not streamed:
                await self.write_event(AudioStart(rate=rate, width=WIDTH, channels=1).event())
            async for pcm, key in chunks:
                if streamed and pcm and key != sentence:
                    if sentence is not None:
                        await self.write_event(AudioStop(timestamp=_ms(sent, rate)).event())
                    start = AudioStart(rate=rate, width=WIDTH, channels=1, timestamp=_ms(sent, rate))
                    await self.write_event(start.event())
                    sentence = key
                for at in range(0, len(pcm), n * WIDTH):
                    piece = pcm[at : at + n * WIDTH]
                    await self.write_event(AudioChunk(rate, WIDTH, 1, piece, timestamp=_ms(sent, rate)).event())
                    sent += len(piece) // WIDTH
            if not streamed or sentence is not None:
                await self.write_event(AudioStop(timestamp=_ms(sent, rate)).event())
            if streamed:
                await self.write_event(SynthesizeStopped().event())
            outcome = "ok"
        except (Cancelled, asyncio.CancelledError, ConnectionError):
            pass  # the client went away: nobody to tell
        except Exception as e:
            outcome, message, code = _failure(e, time.perf_counter() - job.started > job.timeout)
            await self.fail(message, code)
            await self.close()
        finally:
            job.cancel.set()
            self._release(job)
            self.state.metrics.count(ENDPOINT, outcome)
            if outcome == "ok" and job.first_audio is not None:
                logger.info("wyoming: %.2f s of audio, first after %.2f s", sent / rate, job.first_audio)
            if self.job is job:
                self.job = None
            await chunks.aclose()


def _ms(samples: int, rate: int) -> int:
    return int(samples * 1000 // rate)


def _failure(e: Exception, late: bool) -> tuple[str, str, str]:
    """(metrics outcome, message, error code) of a synthesis that raised ``e`` (``late``: past its timeout)."""
    if isinstance(e, AudioTooLong):
        return "bad_request", str(e), "audio_too_long"
    if isinstance(e, TimedOut) or late:  # a text stream cancelled by the timeout raises TextStreamCancelled
        return "timeout", f"synthesis took longer than the server's timeout ({e})", "timeout"
    if isinstance(e, WorkCancelled):  # cancelled by the server (shutdown) or the client: not a bad request
        return "cancelled", str(e), "cancelled"
    if isinstance(e, ConfigError):
        return "bad_request", str(e), "invalid_request"
    logger.error("Wyoming synthesis failed: %s", e, exc_info=e)
    return "error", f"synthesis failed ({type(e).__name__}); the server keeps running", "synthesis_failed"
