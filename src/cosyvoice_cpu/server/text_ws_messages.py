"""The messages of the text stream WebSocket (``server.text_ws``): the ``start`` message's fields, the error that
ends a stream, and the close code of each error (docs/server.md lists them)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from cosyvoice_cpu.errors import ConfigError, WorkCancelled
from cosyvoice_cpu.server.speech import AudioTooLong, Cancelled, SpeechOptions, TimedOut

if TYPE_CHECKING:
    from starlette.types import Message

logger = logging.getLogger(__name__)

PATH = "/v1/audio/speech/stream"
# error code -> WebSocket close code: 4000 + the HTTP status of the same refusal; 1011 for a failed synthesis
CLOSE_CODES = {
    "invalid_api_key": 4401,
    "idle_timeout": 4408,
    "text_too_long": 4413,
    "audio_too_long": 4422,
    "server_busy": 4429,
    "shutting_down": 4503,
    "timeout": 4504,
    "synthesis_failed": 1011,
    "binary_message": 1003,
}
BAD_REQUEST_CLOSE = 4400  # any other refused message


class StreamStart(SpeechOptions):
    """The first message of a text stream: ``/v1/audio/speech``'s fields but ``input`` (the text comes in
    ``text`` messages), ``response_format`` and ``stream_format`` (the audio is 16-bit PCM)."""

    type: Literal["start"]
    audio: Literal["binary", "base64"] = Field(
        "binary",
        description="binary: each chunk a binary frame of 16-bit mono little-endian PCM; base64: each chunk a "
        'JSON message {"type": "audio", "audio": BASE64, "text": SENTENCE}',
    )
    api_key: str | None = Field(None, max_length=1024, description="the API key, when the handshake had none")


class StreamError(Exception):
    """Ends a stream with an ``error`` (``code``, ``kind``) and the close code :data:`CLOSE_CODES` gives it."""

    def __init__(self, message: str, code: str, kind: str = "invalid_request_error", outcome: str = "bad_request"):
        super().__init__(message)
        self.code, self.kind, self.outcome = code, kind, outcome


def ending_of(e: Exception) -> tuple[str, StreamError | None]:
    """(stop reason, error) of a synthesis that raised ``e``."""
    if isinstance(e, (Cancelled, WorkCancelled)):  # the client's cancel, or the stop() of an error: set already
        return "cancel", None
    if isinstance(e, AudioTooLong):
        return "error", StreamError(str(e), "audio_too_long")
    if isinstance(e, TimedOut):
        return "error", StreamError(str(e), "timeout", "timeout", outcome="timeout")
    if isinstance(e, ConfigError):  # e.g. no speakable text at all
        return "error", StreamError(str(e), "invalid_request")
    logger.error("text stream synthesis failed: %s", e, exc_info=e)
    message = f"synthesis failed ({type(e).__name__}); the server keeps running"
    return "error", StreamError(message, "synthesis_failed", "server_error", outcome="error")


def protocol_error(message: Message) -> StreamError:
    """The error of a connection the WebSocket protocol closed (the close went out already)."""
    if message.get("code") == 1009:
        return StreamError(f"a message over the server's size limit ({message.get('reason') or ''})", "too_big")
    return StreamError("a text message that is not valid UTF-8", "invalid_utf8")
