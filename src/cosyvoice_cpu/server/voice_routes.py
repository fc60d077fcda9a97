"""The saved-voice routes: ``GET``/``POST /v1/audio/voices`` and ``DELETE /v1/audio/voices/{name}``.

An upload is checked before any work, in this order: its size (from ``Content-Length``, then while it is read),
the multipart form, the text fields' lengths (``name``, ``prompt_text``, ``overwrite``), the name (NFKC, then
:func:`~cosyvoice_cpu.voices.voice.check_name`), and only then is the audio decoded and the voice made.

Imported only by :func:`cosyvoice_cpu.server.app.create_app`, after it checked that the [server] extra is there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.server.checks import MAX_VOICE_CHARS, RequestProblem, check_text, voice_name
from cosyvoice_cpu.server.handlers import ApiError
from cosyvoice_cpu.server.voices import VoiceExistsError, VoiceNotFoundError
from cosyvoice_cpu.voices.voice import VoiceError, check_name

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.datastructures import FormData, UploadFile

    from cosyvoice_cpu.server.state import State

logger = logging.getLogger(__name__)

VOICES = "/v1/audio/voices"
TRANSCRIPT_FIELDS = ("prompt_text", "text", "transcript")  # the current name first, then the aliases old clients send
FIELDS = ("name", "file", *TRANSCRIPT_FIELDS, "overwrite")
BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def add_routes(app: FastAPI, state: State) -> None:
    """Register the voice routes on ``app`` (``state``: the app's :class:`~cosyvoice_cpu.server.state.State`)."""
    settings, m = state.settings, state.metrics

    @app.get(VOICES)
    async def list_voices() -> dict[str, Any]:
        """The saved voices (and the model's built-in speakers)."""
        out = []
        for name in state.voices.names():
            try:
                v = state.voices.get(name)
            except VoiceNotFoundError:  # deleted through another replica since the listing
                continue
            out.append(
                {
                    "id": name,
                    "name": name,
                    "prompt_text": v.prompt_text,
                    "mode": "built-in" if v.builtin else "zero-shot" if v.prompt_text else "cross-lingual",
                    "duration_s": round(v.duration, 2),
                    "created": v.meta.get("created"),
                }
            )
        return {"object": "list", "voices": out}

    @app.post(VOICES, status_code=201)
    async def add_voice(request: Request) -> dict[str, Any]:
        """Save a voice from 3-10 s of speech and its transcript (multipart: name, file, prompt_text, overwrite;
        ``text`` and ``transcript`` are other names of prompt_text)."""
        limit = int(settings.max_upload_mb * 2**20)
        form = await _read_form(request, limit, settings.max_upload_mb)
        unknown = sorted(set(form.keys()) - set(FIELDS))
        if unknown:
            raise RequestProblem(
                f"unknown form fields {unknown}; send name, file, prompt_text (the transcript; "
                "'text' and 'transcript' are taken as its other names) and overwrite",
                "unknown_field",
            )
        name, upload = form.get("name"), form.get("file")
        text, overwrite = _transcript(form), form.get("overwrite", "false")
        if not isinstance(name, str) or not isinstance(text, str) or not isinstance(overwrite, str):
            raise RequestProblem("fields 'name', 'prompt_text' and 'overwrite' must be text", "bad_upload")
        check_text("name", name, MAX_VOICE_CHARS, required=False)
        check_text("prompt_text", text, settings.max_prompt_chars, required=False)
        if overwrite.strip().lower() not in BOOLEANS:
            raise RequestProblem(f"overwrite must be true or false, not {overwrite[:20]!r}", "invalid_field")
        name = _checked_name(name)
        if upload is None or isinstance(upload, str):
            raise RequestProblem("field 'file' must be an uploaded audio file (wav, flac, ogg, mp3)", "bad_upload")
        data = await upload.read(limit + 1)
        await upload.close()
        if len(data) > limit:
            raise _too_large("the audio file", settings.max_upload_mb)
        replace = BOOLEANS[overwrite.strip().lower()]
        if name in state.voices.names() and not replace:
            raise ApiError(
                409, f"a voice named {name!r} exists; DELETE it first or send overwrite=true", code="voice_exists"
            )
        async with state.voice_lock:  # one voice at a time: the speech tokenizer is big
            loop = asyncio.get_running_loop()
            try:
                voice = await loop.run_in_executor(None, state.engine.make_voice, data, text.strip(), name)
            except ConfigError as e:  # undecodable, silent, too short or too long audio; a prompt too long
                raise RequestProblem(str(e), "bad_prompt") from e
            try:
                await loop.run_in_executor(None, state.voices.add, voice, replace)
            except VoiceExistsError as e:
                raise ApiError(409, str(e), code="voice_exists") from e
            if replace:  # the voice it replaced, if any, keeps no cache
                await loop.run_in_executor(None, state.drop_stale_voice_caches)
        m.count(VOICES, "ok")
        return {"id": name, "name": name, "prompt_text": voice.prompt_text, "duration_s": round(voice.duration, 2)}

    @app.delete(VOICES + "/{name}", status_code=204, response_model=None)
    async def delete_voice(name: str) -> Response:
        """Delete a saved voice."""
        name = _checked_name(name)
        if name == settings.default_voice and name in state.voices.names():
            message = (
                f"{name!r} is the server's default voice (--default-voice), which OpenAI's voice names speak "
                "with; restart the server with another default to delete it"
            )
            raise ApiError(409, message, code="voice_is_default")
        loop = asyncio.get_running_loop()
        try:
            state.voices.remove(name)
        except VoiceNotFoundError as e:  # perhaps deleted through another replica: its caches here go now
            await loop.run_in_executor(None, state.drop_stale_voice_caches)
            raise ApiError(404, str(e), code="voice_not_found") from e
        except VoiceExistsError as e:  # a built-in speaker of the model
            raise ApiError(409, str(e), code="voice_builtin") from e
        await loop.run_in_executor(None, state.drop_stale_voice_caches)
        m.count(VOICES, "ok")
        return Response(status_code=204)


def _transcript(form: FormData) -> str | UploadFile:
    """The upload's transcript: ``prompt_text``, or one of its other names ``text`` (what clients of the first
    server sent; it was ignored then, and the voice silently became cross-lingual) and ``transcript``. Two of them
    with different values are refused rather than one picked."""
    given = {f: form.get(f) for f in TRANSCRIPT_FIELDS if f in form}
    values = {v for v in given.values() if isinstance(v, str)}
    if len(values) > 1:
        raise RequestProblem(
            f"the transcript was sent twice with different text, as {' and '.join(given)}; send it "
            "once, as prompt_text",
            "invalid_field",
        )
    return next(iter(given.values()), "")


def _checked_name(name: str) -> str:
    """The stored form of a voice name (NFKC), refused (400) when it is not allowed."""
    name = voice_name(name)
    try:
        return check_name(name)
    except VoiceError as e:
        raise RequestProblem(str(e), "invalid_voice_name") from e


def _too_large(what: str, max_mb: float) -> ApiError:
    return ApiError(413, f"{what} is over the limit of {max_mb:g} MB; send 3-10 s of speech", code="upload_too_large")


async def _read_form(request: Request, limit: int, max_mb: float) -> FormData:
    """The multipart form of an upload, read under a hard cap (also for chunked uploads without Content-Length)."""
    body_limit = limit + 64 * 1024  # the audio plus the multipart framing and the text fields
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_limit:
        raise _too_large(f"upload of {int(declared)} bytes", max_mb)
    received = bytearray()
    async for part in request.stream():
        received += part
        if len(received) > body_limit:
            raise _too_large("upload", max_mb)
    request._body = bytes(received)  # Starlette's form parser reads the cached body
    try:
        return await request.form(max_files=1, max_fields=8)
    except Exception as e:  # malformed multipart
        raise RequestProblem(
            f"send multipart/form-data with fields name, file (audio) and prompt_text ({e})", "bad_upload"
        ) from e
