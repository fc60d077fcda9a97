"""Checks of a speech or voice request, done in the handler before any work: text fields, voice names, the model
name and the speed.

Every check raises :class:`RequestProblem` (answered as a 400 with its ``code``) with a message that names the
field, what is wrong with it and what to send instead. Length limits come first, so a megabyte of text costs a
``len()`` and nothing else: before these checks, a 1 MB ``instructions`` reached the tokenizer in a synthesis
worker, and the glibc arena of that worker thread kept the tokenizer's freed memory (see docs/server.md).
"""

from __future__ import annotations

import logging
import re
import unicodedata
from typing import TYPE_CHECKING

from cosyvoice_cpu.facts import FAMILIES, facts
from cosyvoice_cpu.server.voices import VoiceNotFoundError, VoiceStore

if TYPE_CHECKING:
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

# OpenAI's model and voice names, as the openai SDK's types list them (``SpeechModel`` and the ``voice`` Literal of
# ``openai.types.audio.speech_create_params``; tests/server/test_openai.py compares these with the installed SDK)
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")  # aliases of the loaded model
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "cedar",
    "coral",
    "echo",
    "fable",
    "marin",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
)
OPENAI_SPEED = (0.25, 4.0)  # what OpenAI's API takes
ENGINE_SPEED = (0.5, 2.0)  # what the engine does (SynthesisConfig.speed); OpenAI's range is clamped to it
MAX_MODEL_CHARS = 128


def family_aliases(family: str) -> tuple[str, ...]:
    """The model names a family answers to besides the served model id (the facts table's ``model_names``)."""
    return facts(family).model_names if family in FAMILIES else ()


MAX_VOICE_CHARS = 64  # voice names are 1-64 characters (voices.voice.check_name)

# lone UTF-16 surrogates (not valid Unicode: the tokenizer refuses them) and control characters other than tab,
# newline and carriage return (NUL and friends: not speech, and wetext's grammars assert on them)
_FORBIDDEN = re.compile("[\ud800-\udfff\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class RequestProblem(Exception):
    """A request the server refuses before any work: ``status`` (400 unless said), a message and an error code."""

    def __init__(self, message: str, code: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.status = code, status


def check_text(field: str, value: str, limit: int, required: bool = True) -> str:
    """``value`` of text field ``field`` if it is at most ``limit`` characters of valid, speakable text.

    Refused: over-long text (checked first, before the text is even scanned), lone surrogates, control characters
    other than tab/newline/carriage return, and (``required``) text with nothing visible in it (only whitespace
    or invisible format characters such as U+200B).
    """
    if len(value) > limit:
        raise RequestProblem(
            f"{field} has {len(value)} characters; this server takes at most {limit} per request"
            + (" (split the text)" if field == "input" else ""),
            f"{field}_too_long",
        )
    bad = _FORBIDDEN.search(value)
    if bad is not None:
        ch, at = bad.group(), bad.start()
        if "\ud800" <= ch <= "\udfff":
            message = (
                f"{field} holds a lone surrogate U+{ord(ch):04X} at character {at}: that is not valid "
                "Unicode; send UTF-8 text (\\uD800-\\uDFFF escapes only as pairs)"
            )
            raise RequestProblem(message, "invalid_text")
        message = (
            f"{field} holds the control character U+{ord(ch):04X} at character {at}; remove it (tab, "
            "newline and carriage return are allowed)"
        )
        raise RequestProblem(message, "invalid_text")
    if required and not any(not c.isspace() and unicodedata.category(c) != "Cf" for c in value):
        what = "empty" if not value.strip() else "only invisible characters"
        raise RequestProblem(f"{field} is {what}: give the text to speak", f"empty_{field}")
    return value


def voice_name(name: str) -> str:
    """A voice name as the server stores and looks it up: NFKC-normalized (full-width ``．．／`` is ``../``, then
    refused by ``check_name``), and with no format or bidi controls (U+202E, U+FEFF, ...)."""
    name = unicodedata.normalize("NFKC", name)
    bad = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), None)
    if bad is not None:
        message = (
            f"voice name {name!r} holds the invisible character U+{ord(bad):04X} (a control, format or "
            "bidi character); use letters, digits, '_', '-', '.' and spaces"
        )
        raise RequestProblem(message, "invalid_voice_name")
    return name


def check_model(model: str, model_id: str, family: str) -> None:
    """Refuse a ``model`` that is none of: the served id, the family's names (``cosyvoice2``, ...), an OpenAI name
    (case-insensitive)."""
    names = {model_id.casefold(), family.casefold(), *family_aliases(family), *OPENAI_MODELS}
    if model.strip().casefold() not in names:
        message = (
            f"unknown model {model!r}; this server has {model_id!r}, a {family} model: send that, "
            f"{family!r}, or an OpenAI name ({', '.join(OPENAI_MODELS)})"
        )
        raise RequestProblem(message, "model_not_found")


def check_speed(speed: float) -> tuple[float, bool]:
    """(the speed the engine uses, whether it was clamped): OpenAI's 0.25-4.0 is taken and clamped to the
    engine's 0.5-2.0; anything else is refused."""
    lo, hi = OPENAI_SPEED
    if not lo <= speed <= hi:  # also NaN
        message = (
            f"speed {speed} is out of range: send 0.25 to 4.0 (OpenAI's range); this server speaks at "
            f"{ENGINE_SPEED[0]} to {ENGINE_SPEED[1]} and clamps the rest"
        )
        raise RequestProblem(message, "invalid_speed")
    applied = min(max(speed, ENGINE_SPEED[0]), ENGINE_SPEED[1])
    return applied, applied != speed


def resolve_voice(voices: VoiceStore, name: str, default: str | None) -> tuple[Voice, str]:
    """(voice, its name) for a request's ``voice``: a saved voice, or for an OpenAI voice name (``alloy``, ...)
    that is not saved, the server's ``--default-voice``. ``voices`` is the app's VoiceStore."""
    name = voice_name(name)
    try:
        return voices.get(name), name
    except VoiceNotFoundError as e:
        if name.casefold() not in OPENAI_VOICES:
            raise RequestProblem(str(e), "voice_not_found") from e
        if default is None:
            known = ", ".join(voices.names()) or "none yet; add one with POST /v1/audio/voices"
            raise RequestProblem(
                f"{name!r} is an OpenAI voice; this server speaks with saved voices ({known}): send "
                "one of them, or start the server with --default-voice NAME to speak OpenAI's voice "
                "names with a saved voice",
                "voice_not_found",
            ) from e
    try:
        return voices.get(default), default
    except VoiceNotFoundError as e:
        raise RequestProblem(
            f"{name!r} maps to the default voice {default!r} (--default-voice), which is not saved: "
            f"add it with POST /v1/audio/voices",
            "voice_not_found",
        ) from e
