"""The speech route, ``POST /v1/audio/speech``: audio chunks or server-sent events as they are made, or (with
``"stream": false``) the whole file at the end, with its real length in the container and ``Content-Length``.

Imported only by :func:`cosyvoice_cpu.server.app.create_app`, after it checked that the [server] extra is there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cosyvoice_cpu.errors import ConfigError, WorkCancelled
from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.server.checks import RequestProblem, check_model, check_speed, check_text, resolve_voice
from cosyvoice_cpu.server.encode import Encoder, UnsupportedFormatError, check_format
from cosyvoice_cpu.server.handlers import ApiError
from cosyvoice_cpu.server.speech import AudioTooLong, Cancelled, Job, SpeechRequest, StreamAborted, TimedOut

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.types import Receive, Scope, Send

    from cosyvoice_cpu.config import SynthesisConfig
    from cosyvoice_cpu.server.engine_api import SpeechEngine
    from cosyvoice_cpu.server.metrics import Metrics
    from cosyvoice_cpu.server.state import State
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

SPEECH = "/v1/audio/speech"
FILE_BLOCK = 256 << 10  # a whole file is sent in blocks of this size


def add_routes(app: FastAPI, state: State) -> None:
    """Register ``/v1/models`` and the speech route on ``app`` (``state``: the app's
    :class:`~cosyvoice_cpu.server.state.State`)."""
    settings, m = state.settings, state.metrics

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The loaded model: its id, family, recipe and sample rate."""
        manifest = state.engine.manifest
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_id,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "cosyvoice-cpu",
                    "family": manifest.family,
                    "recipe": manifest.recipe.get("name"),
                    "sample_rate": state.engine.sample_rate,
                }
            ],
        }

    @app.post(SPEECH)
    async def speech(body: SpeechRequest, request: Request) -> Response:
        """Speak ``input`` with ``voice``: audio chunks as they are made (``"stream": false``: the whole file at
        the end), or server-sent events."""
        # every check before any work: lengths first (a megabyte of text costs a len()), then content
        check_text("input", body.input, settings.max_input_chars)
        instruct = None
        if body.instructions is not None:
            check_text("instructions", body.instructions, settings.max_instructions_chars, required=False)
            instruct = body.instructions.strip() or None
        check_model(body.model, state.model_id, state.engine.manifest.family)
        try:
            fmt = check_format(body.response_format)
        except UnsupportedFormatError as e:
            raise RequestProblem(str(e), "unsupported_format") from e
        speed, clamped = check_speed(body.speed)
        voice, voice_name = resolve_voice(state.voices, body.voice, settings.default_voice)
        config = body.synthesis_config(settings.defaults, speed)
        if instruct is not None:
            check_instruction_room(state.engine, voice, instruct, config)
        sse = body.stream_format == "sse"
        whole = not body.stream and not sse  # the whole file at the end: real lengths in wav/flac, an mp3 Info tag
        encoder = Encoder(fmt, state.engine.sample_rate, streaming=not whole, spool=True)  # before taking a slot
        headers = {"Cache-Control": "no-store", "X-Sample-Rate": str(state.engine.sample_rate)}
        if clamped:
            headers["X-Speed-Clamped"] = f"{speed:g}"
        if voice_name != body.voice:
            headers["X-Voice"] = voice_name.encode("ascii", "backslashreplace").decode()
        try:
            queue_wait = await state.admission.enter()
        except BaseException:
            encoder.close()
            raise
        bound = settings.audio_bound
        rate = state.engine.token_rate
        job = Job(
            lambda check: state.engine.synthesize(body.input, voice, config, instruct, check=check),
            settings.timeout,
            max_audio_s=bound.seconds(len(body.input), speed),
            too_long=bound.problem(len(body.input), speed),
            token_seconds=1.0 / rate / speed,
            sample_rate=state.engine.sample_rate,
        )
        state.jobs.add(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        parts: list[bytes] = []
        try:
            chunks = job.chunks(state.executor, encoder)
            async for data in chunks:  # streamed: the first chunk before the status line, so early failures
                parts.append(data)  # still get their 4xx/5xx; whole: every chunk (empty: the file is spooled)
                if not whole:
                    break
        except BaseException as e:
            watcher.cancel()
            job.cancel.set()
            job.when_done(lambda: _release(state, job))
            encoder.close()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _as_api_error(e, m) from e
        stream = _SpeechStream(b"".join(parts), chunks, job, sse, queue_wait, state, watcher)
        if whole:
            await stream.close("ok")
            file, size = encoder.output()
            return _FileResponse(file, size, media_type=encoder.media_type, headers=headers)
        media = "text/event-stream" if sse else encoder.media_type
        return _StreamResponse(stream, media_type=media, headers=headers)


def check_instruction_room(engine: SpeechEngine, voice: Voice, instruct: str, config: SynthesisConfig) -> None:
    """Refuse instructions that leave the LM's KV cache no room for text (the engine's message would blame the
    voice prompt). The instructions are short by now (``max_instructions_chars``): tokenizing them is cheap."""
    prompt = engine.lm_prompt(voice, instruct, config.normalize)
    try:
        engine.segment_cap(prompt, config.max_tokens)
    except ConfigError as e:
        raise RequestProblem(
            f"instructions take {len(prompt.text_ids)} tokens and leave the model's KV cache of "
            f"{engine.kv_cache_positions} positions no room for the text to speak; shorten the "
            "instructions (or re-export the model with a larger --max-len)",
            "instructions_too_long",
        ) from e


def _outcome(e: BaseException) -> str:
    """The metrics outcome of a synthesis that raised ``e``."""
    kinds = (
        (ConfigError, "bad_request"),
        (AudioTooLong, "bad_request"),
        (TimedOut, "timeout"),
        (Cancelled, "cancelled"),
        (WorkCancelled, "cancelled"),  # a text stream cancelled (TextStreamCancelled): not the client's error
    )
    for kind, outcome in kinds:
        if isinstance(e, kind):
            return outcome
    return "error"


def _as_api_error(e: BaseException, m: Metrics) -> Exception:
    """The ApiError for a synthesis that failed before its first audio (or, sent whole, before its end; counted)."""
    outcome = _outcome(e)
    m.count(SPEECH, outcome)
    if isinstance(e, AudioTooLong):
        logger.warning("speech stopped at its audio bound: %s", e)
        return ApiError(422, str(e), code="audio_too_long", counted=True)
    if outcome == "bad_request":
        return ApiError(400, str(e), code="invalid_request", counted=True)
    if outcome == "timeout":
        return ApiError(504, str(e), "timeout", "timeout", counted=True)
    if outcome == "cancelled":
        return ApiError(499, "the request was cancelled", "cancelled", "cancelled", counted=True)
    logger.error("synthesis failed: %s", e, exc_info=e)
    return ApiError(
        500,
        f"synthesis failed ({type(e).__name__}); the server keeps running",
        "server_error",
        "synthesis_failed",
        counted=True,
    )


def _release(state: State, job: Job) -> None:
    """Free a request's slot; called once its worker thread has stopped."""
    state.jobs.discard(job)
    state.admission.leave()


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` when the client goes away (also while the first chunk is still being made)."""
    while not job.cancel.is_set():
        if await request.is_disconnected():
            logger.info("client went away: cancelling its synthesis")
            job.cancel.set()
            return
        await asyncio.sleep(0.1)


def _sse(event: JsonObject) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class _SpeechStream:
    """The body of one speech response, and the cleanup that must run exactly once however the response ends
    (finished, failed, client gone, or never started): free the slot, stop the worker, count the outcome."""

    def __init__(
        self,
        first: bytes,
        chunks: AsyncIterator[bytes],
        job: Job,
        sse: bool,
        queue_wait: float,
        state: State,
        watcher: asyncio.Task,
    ) -> None:
        self.first, self.chunks, self.job, self.sse = first, chunks, job, sse
        self.queue_wait, self.state, self.watcher = queue_wait, state, watcher
        self.closed = False

    def _emit(self, data: bytes) -> bytes:
        if not self.sse or not data:
            return data
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})

    async def body(self) -> AsyncIterator[bytes]:
        """Encoded audio (or SSE events) per chunk, the encoder's tail last."""
        outcome = "cancelled"
        try:
            if out := self._emit(self.first):
                yield out
            async for data in self.chunks:
                if out := self._emit(data):
                    yield out
            if self.sse:
                seconds = round(self.job.audio / self.state.engine.sample_rate, 3)
                yield _sse({"type": "speech.audio.done", "usage": {"output_audio_seconds": seconds}})
            outcome = "ok"
        except Cancelled:
            pass  # the client is gone (or the server is stopping): nobody to tell
        except Exception as e:  # the status line is sent: SSE clients get an error event, others a cut connection
            outcome = _outcome(e) if isinstance(e, (TimedOut, AudioTooLong)) else "error"
            logger.warning("stream stopped: %s", e, exc_info=outcome == "error")
            if not self.sse:
                raise StreamAborted(f"speech stream aborted: {e}") from e  # no final chunk: clients see truncation
            kind, message, code = {
                "timeout": ("timeout", str(e), "timeout"),
                "bad_request": ("invalid_request_error", str(e), "audio_too_long"),
            }.get(outcome, ("server_error", "synthesis failed", "synthesis_failed"))
            yield _sse({"type": "error", "error": {"message": message, "type": kind, "code": code}})
        finally:
            await self.close(outcome)

    async def close(self, outcome: str = "cancelled") -> None:
        """Once only. The bookkeeping comes before any await: under a cancelled task, every await may raise."""
        if self.closed:
            return
        self.closed = True
        job, state = self.job, self.state
        self.watcher.cancel()
        job.cancel.set()  # a no-op when it finished; otherwise the worker stops at its next token
        job.when_done(lambda: _release(state, job))
        state.metrics.count(SPEECH, outcome)
        if outcome == "ok":
            first = None if job.first_audio is None else self.queue_wait + job.first_audio  # from arrival
            audio = job.audio / state.engine.sample_rate
            state.metrics.speech_done(self.queue_wait, first, time.perf_counter() - job.started, audio)
        await self.chunks.aclose()


class _FileResponse(StreamingResponse):
    """A whole file (``"stream": false``) from the encoder's spooled temporary file, sent in blocks with its
    ``Content-Length``; the file is closed (and deleted, when on disk) however the response ends."""

    def __init__(self, file: IO[bytes], size: int, **kw: object) -> None:
        super().__init__(self._blocks(file), **kw)
        self.headers["content-length"] = str(size)
        self.file = file

    @staticmethod
    async def _blocks(file: IO[bytes]) -> AsyncIterator[bytes]:
        while block := file.read(FILE_BLOCK):
            yield block

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.file.close()


class _StreamResponse(StreamingResponse):
    """A StreamingResponse that closes its :class:`_SpeechStream` even when the body was never iterated (a client
    that hung up before the status line went out)."""

    def __init__(self, stream: _SpeechStream, **kw: object) -> None:
        super().__init__(stream.body(), **kw)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()
