"""The OpenAPI schema at ``/openapi.json``, made true to what the server sends.

FastAPI's generated schema said a speech 200 is ``application/json``, documented a 422 that the server never sends
(validation errors are 400s), left out the 400/401/403/404/409/413/429/5xx answers, and had no request body for
the voice upload (the route reads the multipart form itself). :func:`install` amends the generated schema once,
with this server's settings (its text limits, whether a key is needed); ``tests/server/test_openapi.py`` keeps it
true with a bounded schemathesis run against a live server.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.server.checks import MAX_VOICE_CHARS
from cosyvoice_cpu.server.encode import FORMATS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from cosyvoice_cpu.server.state import ServerSettings

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "An OpenAI-compatible text-to-speech API (docs/server.md). Every error is JSON, "
    '`{"error": {"message", "type", "code"}}`, with a message that says what to do and a code for programs. '
    "Text that is still being written is spoken over the WebSocket `/v1/audio/speech/stream` (not an OpenAPI "
    'operation): a `{"type": "start", "model", "voice", ...}` message with this API\'s speech fields but `input`, '
    '`{"type": "text", "text"}` pieces, then `{"type": "end"}`; PCM frames back, then a `done` message with timings '
    "(docs/server.md lists the messages, close codes, limits and timeouts)."
)
_STRING, _INT, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {"message": _STRING, "type": _STRING, "code": _STRING},
        }
    },
}
_SCHEMAS: JsonObject = {
    "Error": _ERROR,
    "Voice": {
        "type": "object",
        "required": ["id", "name", "prompt_text", "mode", "duration_s", "created"],
        "properties": {
            "id": _STRING,
            "name": _STRING,
            "prompt_text": _STRING,
            "mode": {"enum": ["zero-shot", "cross-lingual", "built-in"]},
            "duration_s": _NUMBER,
            "created": {"type": ["string", "null"]},
        },
    },
    "VoiceList": {
        "type": "object",
        "required": ["object", "voices"],
        "properties": {
            "object": {"const": "list"},
            "voices": {"type": "array", "items": {"$ref": "#/components/schemas/Voice"}},
        },
    },
    "NewVoice": {
        "type": "object",
        "required": ["id", "name", "prompt_text", "duration_s"],
        "properties": {"id": _STRING, "name": _STRING, "prompt_text": _STRING, "duration_s": _NUMBER},
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by", "family", "sample_rate"],
                    "properties": {
                        "id": _STRING,
                        "object": {"const": "model"},
                        "created": _INT,
                        "owned_by": _STRING,
                        "family": _STRING,
                        "recipe": {"type": ["string", "null"]},
                        "sample_rate": _INT,
                    },
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "required": [
            "status",
            "model",
            "family",
            "sample_rate",
            "rss_mb",
            "active",
            "queued",
            "voices",
            "uptime_s",
            "replica",
            "pid",
            "replicas",
        ],
        "properties": {
            "status": {"enum": ["ok", "draining"]},
            "model": _STRING,
            "family": _STRING,
            "sample_rate": _INT,
            "rss_mb": _NUMBER,
            "active": _INT,
            "queued": _INT,
            "voices": _INT,
            "uptime_s": _NUMBER,
            "replica": _STRING,
            "pid": _INT,
            "replicas": {"type": ["integer", "null"]},
        },
    },
}
_ERRORS = {
    400: "a bad field, text or voice name; unknown voice, model or format; malformed JSON or form",
    401: "missing or wrong API key",
    403: "a Host name this server does not serve (--allow-host), or a write from another site's page (--allow-origin)",
    404: "no voice of that name",
    408: "the request's headers or body did not arrive in time (--header-timeout, --body-timeout); the connection "
    "is closed",
    409: "the voice exists (send overwrite=true), is a built-in speaker, or is the server's default voice",
    413: "the body (or the uploaded audio) is over the server's limit",
    415: "the body is not declared as JSON: send it with Content-Type: application/json",
    422: "the speech passed the audio this server allows for the input (--max-audio-per-char, --max-audio-seconds)",
    429: "the server is busy: retry after Retry-After seconds",
    500: "the synthesis failed; the server keeps running",
    503: "the server is shutting down: retry on another instance",
    504: "the synthesis took longer than the server's timeout",
}
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _error(status: int) -> JsonObject:
    out = _json(_ERRORS[status], "Error")
    if status in (429, 503):
        out["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": _INT}}
    return out


def _json(description: str, name: str) -> JsonObject:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def _speech_ok() -> JsonObject:
    content = {media: _BINARY for media in FORMATS.values()}
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": _STRING,
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "description": 'JSON: {"type": "speech.audio.delta", "audio": base64}, then {"type": '
                '"speech.audio.done", "usage": {"output_audio_seconds"}} or {"type": "error", '
                '"error": {"message", "type", "code"}}',
            },
        },
    }
    content["text/event-stream"] = {"schema": event}  # Open API 3.1: the schema of one event
    header = {
        "X-Sample-Rate": {"description": "the audio's sample rate (Hz)", "schema": _INT},
        "X-Speed-Clamped": {
            "description": "present when the requested speed was clamped to 0.5-2.0: the speed used",
            "schema": _NUMBER,
        },
        "X-Voice": {
            "description": "present when the voice used differs from the one asked for (an OpenAI "
            "voice name mapped to --default-voice)",
            "schema": _STRING,
        },
    }
    return {
        "description": "the audio, in response_format (stream_format sse: server-sent events)",
        "headers": header,
        "content": content,
    }


def _upload_body(settings: ServerSettings) -> JsonObject:
    rule = "1-64 letters, digits, '_', '-', '.' or spaces, starting with a letter or digit"
    name = {"type": "string", "minLength": 1, "maxLength": MAX_VOICE_CHARS, "description": rule}
    text = {
        "type": "string",
        "maxLength": settings.max_prompt_chars,
        "description": "the transcript of the audio (omit it for a cross-lingual voice)",
    }
    schema = {
        "type": "object",
        "required": ["name", "file"],
        "additionalProperties": False,
        "properties": {
            "name": name,
            "file": {
                "type": "string",
                "format": "binary",
                "description": "3-10 s of clean speech: wav, flac, ogg or mp3",
            },
            "prompt_text": text,
            "text": {**text, "description": "another name of prompt_text"},
            "transcript": {**text, "description": "another name of prompt_text"},
            "overwrite": {"type": "boolean", "default": False, "description": "replace a voice of that name"},
        },
    }
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}


def amend(schema: JsonObject, settings: ServerSettings) -> JsonObject:
    """Make FastAPI's generated ``schema`` describe this server (with ``settings``: a ServerSettings)."""
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for gone in ("HTTPValidationError", "ValidationError"):
        schemas.pop(gone, None)
    schemas.update(_SCHEMAS)
    props = schemas["SpeechRequest"]["properties"]
    props["input"].update(minLength=1, maxLength=settings.max_input_chars)
    for option in props["instructions"].get("anyOf", []):
        if option.get("type") == "string":
            option["maxLength"] = settings.max_instructions_chars
    props["response_format"]["enum"] = list(FORMATS)
    paths = schema["paths"]
    ops = {
        ("/v1/audio/speech", "post"): ({"200": _speech_ok()}, (400, 408, 413, 415, 422, 429, 500, 503, 504)),
        ("/v1/models", "get"): ({"200": _json("the loaded model", "ModelList")}, ()),
        ("/v1/audio/voices", "get"): ({"200": _json("the saved voices", "VoiceList")}, ()),
        ("/v1/audio/voices", "post"): ({"201": _json("the voice was saved", "NewVoice")}, (400, 408, 409, 413)),
        ("/v1/audio/voices/{name}", "delete"): ({"204": {"description": "deleted"}}, (400, 404, 409)),
        ("/health", "get"): ({"200": _json("the server's state", "Health")}, ()),
        ("/metrics", "get"): (
            {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": _STRING}}}},
            (),
        ),
    }
    keyed = bool(settings.api_key)
    if keyed:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for (path, method), (ok, errors) in ops.items():
        op = paths[path][method]
        needs_key = keyed and (path.startswith("/v1/") or path == "/metrics")
        op["responses"] = {**ok, **{str(s): _error(s) for s in (*errors, 403, *((401,) if needs_key else ()))}}
        if needs_key:
            op["security"] = [{"bearer": []}]
    paths["/v1/audio/voices"]["post"]["requestBody"] = _upload_body(settings)
    name = paths["/v1/audio/voices/{name}"]["delete"]["parameters"][0]
    name["schema"] = {"type": "string", "minLength": 1, "maxLength": MAX_VOICE_CHARS}
    return schema


def install(app: FastAPI, settings: ServerSettings) -> None:
    """Serve the amended schema at ``/openapi.json`` (built once, at the first request for it)."""
    from fastapi.openapi.utils import get_openapi

    def build() -> JsonObject:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes)
            app.openapi_schema = amend(schema, settings)
        return app.openapi_schema

    app.openapi = build
