"""The ``/v1`` routes: speech (audio chunks or server-sent events), models, and the saved voices.

Imported only by :func:`cosyvoice_cpu.server.app.create_app`, after it checked that the [server] extra is there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.server.encode import Encoder, UnsupportedFormatError, check_format
from cosyvoice_cpu.server.speech import OPENAI_MODELS, Cancelled, Job, SpeechRequest, StreamAborted, TimedOut
from cosyvoice_cpu.voice import check_name

logger = logging.getLogger(__name__)

SPEECH = "/v1/audio/speech"
VOICES = "/v1/audio/voices"


def add_routes(app: Any, state: Any, api_error: type, exists: type, not_found: type) -> None:
    """Register the ``/v1`` routes on ``app`` (``state``: the app's :class:`~cosyvoice_cpu.server.app.State`)."""
    settings, m = state.settings, state.metrics

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        manifest = state.engine.manifest
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": int(state.started),
                "owned_by": "cosyvoice-cpu", "family": manifest.family, "recipe": manifest.recipe.get("name"),
                "sample_rate": state.engine.sample_rate}]}  # fmt: skip

    @app.post(SPEECH)
    async def speech(body: SpeechRequest, request: Request) -> Any:
        if body.model not in (state.model_id, state.engine.manifest.family, *OPENAI_MODELS):
            raise api_error(400, f"unknown model {body.model!r}; this server has {state.model_id!r} "
                            f"(or use {', '.join(OPENAI_MODELS)})", code="model_not_found")  # fmt: skip
        if not body.input.strip():
            raise api_error(400, "input is empty: give the text to speak", code="empty_input")
        if len(body.input) > settings.max_input_chars:
            raise api_error(400, f"input has {len(body.input)} characters; this server takes at most "
                            f"{settings.max_input_chars} per request (split the text)",
                            code="input_too_long")  # fmt: skip
        try:
            fmt = check_format(body.response_format)
        except UnsupportedFormatError as e:
            raise api_error(400, str(e), code="unsupported_format") from e
        try:
            voice = state.voices.get(body.voice)
        except not_found as e:
            raise api_error(400, str(e), code="voice_not_found") from e
        config = body.synthesis_config(settings.defaults)
        instruct = body.instructions.strip() if body.instructions and body.instructions.strip() else None
        encoder = Encoder(fmt, state.engine.sample_rate, streaming=True)  # before taking a slot: it may fail
        queue_wait = await state.admission.enter()
        job = Job(lambda check: state.engine.synthesize(body.input, voice, config, instruct, check=check),
                  settings.timeout)  # fmt: skip
        state.jobs.add(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            chunks = job.chunks(state.executor, encoder)
            try:  # the first chunk before the status line: early failures still get their 4xx/5xx
                first = await chunks.__anext__()
            except StopAsyncIteration:  # not reached: the encoder's tail always comes
                first = b""
        except BaseException as e:
            watcher.cancel()
            job.cancel.set()
            job.when_done(lambda: _release(state, job))
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _as_api_error(e, m, api_error) from e
        stream = _SpeechStream(first, chunks, job, body.stream_format == "sse", queue_wait, state, watcher)
        media = "text/event-stream" if stream.sse else encoder.media_type
        return _StreamResponse(stream, media_type=media,
                               headers={"Cache-Control": "no-store", "X-Sample-Rate": str(state.engine.sample_rate)})

    @app.get(VOICES)
    async def list_voices() -> dict[str, Any]:
        out = []
        for name in state.voices.names():
            v = state.voices.get(name)
            out.append({"id": name, "name": name, "prompt_text": v.prompt_text,
                        "mode": "built-in" if v.builtin else "zero-shot" if v.prompt_text else "cross-lingual",
                        "duration_s": round(v.duration, 2), "created": v.meta.get("created")})  # fmt: skip
        return {"object": "list", "voices": out}

    @app.post(VOICES, status_code=201)
    async def add_voice(request: Request) -> dict[str, Any]:
        limit = int(settings.max_upload_mb * 2**20)
        body_limit = limit + 64 * 1024  # the audio plus the multipart framing and the text fields

        def too_large(what: str) -> Exception:
            return api_error(413, f"{what} is over the limit of {settings.max_upload_mb:g} MB; send 3-10 s of speech",
                             code="upload_too_large")  # fmt: skip

        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > body_limit:
            raise too_large(f"upload of {int(declared)} bytes")
        received = bytearray()
        async for part in request.stream():  # a hard cap, also for chunked uploads without Content-Length
            received += part
            if len(received) > body_limit:
                raise too_large("upload")
        request._body = bytes(received)  # Starlette's form parser reads the cached body
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as e:  # malformed multipart
            raise api_error(400, f"send multipart/form-data with fields name, file (audio) and prompt_text ({e})",
                            code="bad_upload") from e  # fmt: skip
        name, upload = form.get("name"), form.get("file")
        text = form.get("prompt_text", form.get("transcript", ""))
        if not isinstance(name, str) or not isinstance(text, str):
            raise api_error(400, "fields 'name' and 'prompt_text' must be text", code="bad_upload")
        check_name(name)  # VoiceError -> 400 before any work
        if upload is None or isinstance(upload, str):
            raise api_error(400, "field 'file' must be an uploaded audio file (wav, flac, ogg, mp3)",
                            code="bad_upload")  # fmt: skip
        data = await upload.read(limit + 1)
        await upload.close()
        if len(data) > limit:
            raise too_large("the audio file")
        overwrite = str(form.get("overwrite", "false")).lower() in ("1", "true", "yes")
        if name in state.voices.names() and not overwrite:
            raise api_error(409, f"a voice named {name!r} exists; DELETE it first or send overwrite=true",
                            code="voice_exists")  # fmt: skip
        async with state.voice_lock:  # one voice at a time: the speech tokenizer is big
            loop = asyncio.get_running_loop()
            voice = await loop.run_in_executor(None, state.engine.make_voice, data, text.strip(), name)
            try:
                await loop.run_in_executor(None, state.voices.add, voice, overwrite)
            except exists as e:
                raise api_error(409, str(e), code="voice_exists") from e
        m.count(VOICES, "ok")
        return {"id": name, "name": name, "prompt_text": voice.prompt_text, "duration_s": round(voice.duration, 2)}

    @app.delete(VOICES + "/{name}", status_code=204, response_model=None)
    async def delete_voice(name: str) -> Any:
        try:
            state.voices.remove(name)
        except not_found as e:
            raise api_error(404, str(e), code="voice_not_found") from e
        except exists as e:  # a built-in speaker of the model
            raise api_error(409, str(e), code="voice_builtin") from e
        return Response(status_code=204)


def _outcome(e: BaseException) -> str:
    """The metrics outcome of a synthesis that raised ``e``."""
    for kind, outcome in ((ConfigError, "bad_request"), (TimedOut, "timeout"), (Cancelled, "cancelled")):
        if isinstance(e, kind):
            return outcome
    return "error"


def _as_api_error(e: BaseException, m: Any, api_error: type) -> Exception:
    """The ApiError for a synthesis that failed before its first audio (counted)."""
    outcome = _outcome(e)
    m.count(SPEECH, outcome)
    if outcome == "bad_request":
        return api_error(400, str(e))
    if outcome == "timeout":
        return api_error(504, str(e), "timeout")
    if outcome == "cancelled":
        return api_error(499, "the request was cancelled", "cancelled")
    logger.error("synthesis failed: %s", e, exc_info=e)
    return api_error(500, f"synthesis failed ({type(e).__name__}); the server keeps running", "server_error")


def _release(state: Any, job: Job) -> None:
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


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class _SpeechStream:
    """The body of one speech response, and the cleanup that must run exactly once however the response ends
    (finished, failed, client gone, or never started): free the slot, stop the worker, count the outcome."""

    def __init__(self, first: bytes, chunks: AsyncIterator[bytes], job: Job, sse: bool, queue_wait: float,
                 state: Any, watcher: asyncio.Task) -> None:  # fmt: skip
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
            outcome = "timeout" if isinstance(e, TimedOut) else "error"
            logger.warning("stream stopped: %s", e, exc_info=outcome == "error")
            if not self.sse:
                raise StreamAborted(f"speech stream aborted: {e}") from e  # no final chunk: clients see truncation
            kind, message = ("timeout", str(e)) if outcome == "timeout" else ("server_error", "synthesis failed")
            yield _sse({"type": "error", "error": {"message": message, "type": kind}})
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


class _StreamResponse(StreamingResponse):
    """A StreamingResponse that closes its :class:`_SpeechStream` even when the body was never iterated (a client
    that hung up before the status line went out)."""

    def __init__(self, stream: _SpeechStream, **kw: Any) -> None:
        super().__init__(stream.body(), **kw)
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.close()
