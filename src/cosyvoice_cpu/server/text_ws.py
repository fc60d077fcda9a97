"""``/v1/audio/speech/stream``: speech of text that is still being written, over a WebSocket (docs/server.md).

The client sends JSON text messages: one ``start`` (the fields of ``/v1/audio/speech`` but ``input``, checked the
same way, plus ``audio`` and ``api_key``), any number of ``text`` pieces, then ``end`` (speak the rest) or
``cancel`` (stop now). The server answers ``started``, the audio as binary frames of 16-bit mono little-endian
PCM (or ``audio`` JSON messages in base64), and one final ``done`` message with the stop reason and timings; then
it closes the socket (1000, or a 4xxx code that mirrors the HTTP status of the same refusal: :data:`CLOSE_CODES`).

The text goes to the engine's push-form text stream (``Engine.open_text_stream``) through the Wyoming server's
:class:`~cosyvoice_cpu.server.wyoming_audio.TextInbox` (text sent while the request waits for a slot is kept) and
its ``pump`` (a bounded queue: a client that does not read its audio pauses its own synthesis). Host, Origin and a
wrong ``Authorization`` header are refused at the handshake by ``server.guard``; admission, the timeout, the
audio bound and the metrics are the speech route's. Imported only by ``create_app``, after it checked that the
[server] extra is there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pydantic import ValidationError
from starlette.websockets import WebSocket

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.server.checks import RequestProblem, check_model, check_speed, check_text, resolve_voice
from cosyvoice_cpu.server.guard import key_matches
from cosyvoice_cpu.server.handlers import error_body, validation_problem
from cosyvoice_cpu.server.speech import Job, Rejected
from cosyvoice_cpu.server.text_ws_messages import (
    BAD_REQUEST_CLOSE,
    CLOSE_CODES,
    PATH,
    StreamError,
    StreamStart,
    ending_of,
    protocol_error,
)
from cosyvoice_cpu.server.wyoming_audio import WIDTH, TextInbox, pump

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import Message

    from cosyvoice_cpu.config import AudioChunk
    from cosyvoice_cpu.server.state import State

logger = logging.getLogger(__name__)


def add_route(app: FastAPI, state: State) -> None:
    """Register the text stream WebSocket on ``app`` (``state``: the app's ``State``)."""

    @app.websocket(PATH)
    async def text_stream(ws: WebSocket) -> None:
        await TextSocket(state, ws).run()


class TextSocket:
    """One text stream connection: a reader of the client's messages (this task) and a speaker task."""

    def __init__(self, state: State, ws: WebSocket) -> None:
        self.state, self.ws, self.settings = state, ws, state.settings
        self.inbox = TextInbox()
        self.job: Job | None = None
        self.speaker: asyncio.Task | None = None
        self.admitted = False
        self.ending: tuple[str, StreamError | None] | None = None  # (stop reason, error): the first one wins
        self.send_lock = asyncio.Lock()
        self.gone = False
        self.chars = 0
        self.opened = time.perf_counter()
        self.last_activity = time.monotonic()
        self.first_text: float | None = None
        self.first_audio: float | None = None
        self.queue_wait = 0.0
        self.audio_samples = 0

    # ------------------------------------------------------------------ the connection

    async def run(self) -> None:
        await self.ws.accept()
        self.state.text_streams += 1
        reader: asyncio.Task | None = None
        try:
            start = await self._start()
            if start is None:
                return
            self.speaker = asyncio.ensure_future(self._speak(start))
            reader = asyncio.ensure_future(self._read())
            await asyncio.wait({reader, self.speaker}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # a refused message raises its StreamError here
        except StreamError as e:
            self.stop("error", e)
        except BaseException:
            self.stop("cancel")  # the server is stopping, or a bug: the work stops either way
            raise
        finally:
            if reader is not None and not reader.done():
                reader.cancel()  # the audio ended: only a cancel or the client's going was still awaited
            try:
                await self._finish()
            finally:
                self.state.text_streams -= 1  # after the outcome is counted

    def stop(self, reason: str, error: StreamError | None = None) -> None:
        """End the stream (the first call decides why): its text stream and worker are cancelled."""
        if self.ending is None:
            self.ending = (reason, error)
        if reason != "end":
            self.inbox.cancel()
            if self.job is not None:
                self.job.cancel.set()
            if self.speaker is not None and asyncio.current_task() is not self.speaker:
                self.speaker.cancel()  # waiting for a slot, or for a client that does not read to take its audio

    async def _finish(self) -> None:
        """Wait for the speaker, count the outcome, send ``done`` and close (if the client is still there)."""
        if self.speaker is not None:
            await asyncio.gather(self.speaker, return_exceptions=True)
        reason, error = self.ending or ("cancel", None)
        outcome = "ok" if reason == "end" else error.outcome if error is not None else "cancelled"
        self.state.metrics.count(PATH, outcome)
        audio = self.audio_samples / self.state.engine.sample_rate
        if outcome == "ok":
            total = time.perf_counter() - self.opened
            self.state.metrics.speech_done(self.queue_wait, self._first_audio(), total, audio)
        done: JsonObject = {"type": "done", "stop_reason": reason, "timings": self._timings(audio)}
        if error is not None:
            done.update(error_body(str(error), error.kind, error.code))
            logger.info("text stream closed: %s (%s)", error.code, error)
        await self._send({"text": json.dumps(done)})
        code = 1000 if error is None else CLOSE_CODES.get(error.code, BAD_REQUEST_CLOSE)
        reason_text = "" if error is None else error.code
        await self._send({"close": (code, reason_text)})

    def _first_audio(self) -> float | None:
        if self.first_audio is None or self.first_text is None:
            return None
        return max(self.first_audio - self.first_text, 0.0)

    def _timings(self, audio: float) -> JsonObject:
        first = self._first_audio()
        return {
            "first_audio_s": None if first is None else round(first, 3),  # from the first text to the first audio
            "queue_wait_s": round(self.queue_wait, 3),
            "total_s": round(time.perf_counter() - self.opened, 3),
            "audio_s": round(audio, 3),
            "text_chars": self.chars,
        }

    async def _send(self, what: Message) -> None:
        """Send ``{"text": str}``, ``{"bytes": bytes}`` or ``{"close": (code, reason)}``; a client that went away
        stops the stream instead of raising."""
        if self.gone:
            return
        async with self.send_lock:
            try:
                if "close" in what:
                    code, reason = what["close"]
                    await self.ws.close(code, reason[:120])
                    self.gone = True
                elif "bytes" in what:
                    await self.ws.send_bytes(what["bytes"])
                else:
                    await self.ws.send_text(what["text"])
            except Exception as e:  # the socket is closed (WebSocketDisconnect, RuntimeError, OSError)
                logger.debug("text stream client gone while sending: %s", e)
                self.gone = True
                self.stop("cancel")

    # ------------------------------------------------------------------ the client's messages

    async def _message(self, idle: bool = True) -> Message | None:
        """The next JSON message (None: the client went away). ``idle``: refused after ``stream_idle_timeout`` s
        without a message from the client or audio to it."""
        limit = self.settings.stream_idle_timeout
        while True:
            queued = self.speaker is not None and not self.admitted  # the server keeps it waiting: not idle
            wait = self.last_activity + limit - time.monotonic() if not queued else 1.0
            if idle and wait <= 0:
                raise StreamError(
                    f"no message for {limit:g} s while no audio was being sent: closing (the server's "
                    "--stream-idle-timeout; send text, or end the stream)",
                    "idle_timeout",
                    outcome="timeout",
                )
            try:
                message = await asyncio.wait_for(self.ws.receive(), wait if idle else None)
            except asyncio.TimeoutError:
                continue  # audio may have been sent meanwhile: look again
            except RuntimeError:  # received after the disconnect
                return None
            break
        if message["type"] == "websocket.disconnect":
            self.gone = True
            if message.get("code") in (1007, 1009):  # invalid UTF-8, a message past the size limit
                self.ending = self.ending or ("error", protocol_error(message))
            return None
        self.last_activity = time.monotonic()
        if message.get("text") is None:
            raise StreamError("binary messages are not taken: send JSON text messages", "binary_message")
        try:
            data = json.loads(message["text"])
        except (ValueError, RecursionError) as e:
            raise StreamError(f"a message is not valid JSON ({type(e).__name__}: {e})"[:300], "invalid_json") from e
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise StreamError('every message is a JSON object with a "type" (start, text, end, cancel)', "bad_message")
        return data

    async def _start(self) -> StreamStart | None:
        """Read and check the ``start`` message: fields, key, model, speed, voice, instructions (None: the client
        went away first)."""
        data = await self._message()
        if data is None:
            self.stop("cancel")
            return None
        if data.get("type") != "start":
            raise StreamError(f"the first message must be a start message, not {data['type'][:32]!r}", "bad_message")
        try:
            start = StreamStart.model_validate(data)
        except ValidationError as e:
            message, code = validation_problem(list(e.errors()))
            raise StreamError(message, code) from e
        key = self.settings.api_key
        if key is not None and self.ws.headers.get("authorization") is None:  # a wrong header was refused already
            if start.api_key is None or not key_matches(f"Bearer {start.api_key}".encode(), key):
                raise StreamError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the handshake, or "
                    '"api_key" in the start message',
                    "invalid_api_key",
                    "authentication_error",
                )
        try:
            check_model(start.model, self.state.model_id, self.state.engine.manifest.family)
            self.speed, _ = check_speed(start.speed)
            self.voice, self.voice_name = resolve_voice(self.state.voices, start.voice, self.settings.default_voice)
            self.instruct = None
            if start.instructions is not None:
                check_text("instructions", start.instructions, self.settings.max_instructions_chars, required=False)
                self.instruct = start.instructions.strip() or None
            self.config = start.synthesis_config(self.settings.defaults, self.speed)
            if self.instruct is not None:
                from cosyvoice_cpu.server.routes import check_instruction_room

                check_instruction_room(self.state.engine, self.voice, self.instruct, self.config)
        except RequestProblem as e:
            raise StreamError(str(e), e.code) from e
        except ConfigError as e:
            raise StreamError(str(e), "invalid_request") from e
        return start

    async def _read(self) -> None:
        """Text pieces to the stream until ``end`` (then only ``cancel`` is heard), a cancel, a refusal or the
        client going away."""
        ended = False
        while self.ending is None or self.ending[0] == "end":
            data = await self._message(idle=not ended)
            if data is None:
                self.stop("cancel")
                return
            kind = data["type"]
            if kind == "cancel":
                self.stop("cancel")
                return
            if ended:
                raise StreamError(f"a {kind[:32]!r} message after end: only cancel is taken", "bad_message")
            if kind == "end":
                ended = True
                self.inbox.close()
            elif kind == "text":
                self._feed(data)
            else:
                raise StreamError(f"unknown message type {kind[:32]!r} (start, text, end, cancel)", "bad_message")

    def _feed(self, data: JsonObject) -> None:
        text, limit = data.get("text"), self.settings.max_input_chars
        if not isinstance(text, str) or set(data) - {"type", "text"}:
            raise StreamError('a text message is {"type": "text", "text": STRING} and nothing else', "bad_message")
        self.chars += len(text)
        if self.chars > limit:
            raise StreamError(
                f"the stream's text passed {limit} characters, this server's limit per request "
                "(--max-input-chars); end this stream and open another",
                "text_too_long",
            )
        try:
            check_text("text", text, limit, required=False)  # lone surrogates, control characters
            if self.first_text is None and text.strip():
                self.first_text = time.perf_counter()
            self.inbox.feed(text)
        except RequestProblem as e:
            raise StreamError(str(e), e.code) from e
        except (ConfigError, UnicodeError) as e:  # what the engine's stream refuses
            raise StreamError(str(e), "invalid_text") from e
        if self.job is not None:  # the audio bound grows with the text
            bound = self.settings.audio_bound
            self.job.max_audio_s = bound.seconds(self.chars, self.speed)
            self.job.too_long = bound.problem(self.chars, self.speed)

    # ------------------------------------------------------------------ the audio

    async def _speak(self, start: StreamStart) -> None:
        """Take a slot, run the text stream in a worker, send its audio; the ending is set however it ends."""
        state, settings, engine = self.state, self.settings, self.state.engine
        try:
            self.queue_wait = await state.admission.enter()
        except Rejected as e:
            code = "server_busy" if e.status == 429 else "shutting_down"
            self.stop("error", StreamError(str(e), code, code, outcome="rejected"))
            return
        self.admitted, self.last_activity = True, time.monotonic()  # the wait in the queue was not the client's
        voice, config, instruct, inbox = self.voice, self.config, self.instruct, self.inbox

        # run in the worker: a ConfigError of the engine comes out of pump
        def run(check: Callable[[], None]) -> Iterator[AudioChunk]:
            return iter(inbox.attach(engine.open_text_stream(voice, config, instruct, check=check)))

        bound = settings.audio_bound
        chars = max(self.chars, 1)
        job = self.job = Job(
            run,
            settings.timeout,
            max_audio_s=bound.seconds(chars, self.speed),
            too_long=bound.problem(chars, self.speed),
            token_seconds=1.0 / engine.token_rate / self.speed,
            sample_rate=engine.sample_rate,
        )
        state.jobs.add(job)
        if self.ending is not None and self.ending[0] != "end":
            job.cancel.set()
        loop = asyncio.get_running_loop()
        timer = loop.call_later(settings.timeout, self._timed_out)  # a stream waiting for text checks no token
        chunks = pump(job, state.executor, on_stop=inbox.cancel)
        try:
            hello = {
                "type": "started",
                "sample_rate": engine.sample_rate,
                "encoding": "pcm_s16le",
                "channels": 1,
                "voice": self.voice_name,
                "model": state.model_id,
                "speed": self.speed,
            }
            await self._send({"text": json.dumps(hello)})
            async for pcm, (text, _) in chunks:
                if not pcm:
                    continue
                if self.first_audio is None:
                    self.first_audio = time.perf_counter()
                self.audio_samples += len(pcm) // WIDTH
                self.last_activity = time.monotonic()
                if start.audio == "binary":
                    await self._send({"bytes": pcm})
                else:
                    message = {"type": "audio", "audio": base64.b64encode(pcm).decode(), "text": text}
                    await self._send({"text": json.dumps(message)})
            self.stop("end")
        except Exception as e:
            self.stop(*ending_of(e))
        finally:
            timer.cancel()
            job.cancel.set()
            job.when_done(lambda: (state.jobs.discard(job), state.admission.leave()))
            await chunks.aclose()

    def _timed_out(self) -> None:
        message = f"the stream ran past the server's timeout of {self.settings.timeout:g} s (--timeout)"
        self.stop("error", StreamError(message, "timeout", "timeout", outcome="timeout"))
