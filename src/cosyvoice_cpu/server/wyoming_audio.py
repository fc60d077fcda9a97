"""What the Wyoming handler needs besides the protocol: the voice a request names (saved or built-in, its language
checked against the family), a synthesis run in a worker thread with its audio handed to the event loop as
16-bit PCM as it is made (bounded: a slow client pauses its own synthesis), and the text of a stream that comes
before the engine's text stream (``Engine.open_text_stream``) is open."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol, TypeVar

from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.jsontypes import JsonValue
from cosyvoice_cpu.server.checks import RequestProblem, voice_name
from cosyvoice_cpu.server.speech import MAX_PENDING_CHUNKS, Job
from cosyvoice_cpu.server.voices import VoiceNotFoundError

if TYPE_CHECKING:
    from cosyvoice_cpu.server.state import State
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

WIDTH = 2  # bytes per sample: 16-bit PCM


def check_language(family: str, language: object) -> None:
    """Refuse a ``language`` (``en``, ``en-US``, ``en_US``, ``zh-Hans``; case-insensitive) whose primary subtag is not
    one the family speaks (the facts table's ``languages``)."""
    if language is None:
        return
    if not isinstance(language, str):
        raise RequestProblem(f"voice.language must be a string, not {type(language).__name__}", "invalid_language")
    spoken = facts(family).languages
    primary = re.split(r"[-_]", language.strip().lower(), maxsplit=1)[0]
    if primary not in spoken:
        raise RequestProblem(
            f"language {language[:32]!r} is not one this {family} model speaks ({', '.join(spoken)})",
            "language_not_supported",
        )


def resolve_voice(state: State, voice: JsonValue) -> Voice:
    """The :class:`~cosyvoice_cpu.voices.voice.Voice` of a request's ``voice`` (``{name, language, speaker}`` or
    None): the named saved or built-in voice; an unknown name, or none, speaks with ``--default-voice`` when there
    is one; no name and no default: the first voice of ``info``. Reads the voices directory: call it off the loop.

    Raises:
        RequestProblem: a bad or unknown voice or language (``voice_not_found``, ``language_not_supported``).
    """
    if voice is None:
        voice = {}
    if not isinstance(voice, dict):
        raise RequestProblem("voice must be an object {name, language, speaker}", "invalid_voice")
    voices, default = state.voices, state.settings.default_voice
    check_language(voices.family, voice.get("language"))
    name = voice.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise RequestProblem("voice.name must be a string", "invalid_voice")
        try:
            return voices.get(voice_name(name))
        except VoiceNotFoundError as e:
            if default is None:
                raise RequestProblem(str(e), "voice_not_found") from e
            logger.info("Wyoming: unknown voice %r, speaking with the default voice %r", name[:64], default)
    if default is not None:
        try:
            return voices.get(default)
        except VoiceNotFoundError as e:
            message = f"the default voice {default!r} (--default-voice) is not saved"
            raise RequestProblem(message, "voice_not_found") from e
    names = voices.names()
    if not names:
        raise RequestProblem("this server has no voices yet: add one (cosyvoice-cpu voice add)", "voice_not_found")
    return voices.get(names[0])


async def pump(
    job: Job, executor: Executor, on_stop: Callable[[], None] | None = None
) -> AsyncIterator[tuple[bytes, tuple[str, tuple[int, int]]]]:
    """Run ``job`` on ``executor`` and yield ``(16-bit PCM bytes, (sentence text, span))`` per chunk as made.

    The job's ``run(check)`` gives the :class:`~cosyvoice_cpu.config.AudioChunk` s; each is checked (cancel,
    timeout, audio bound) and counted. At most ``MAX_PENDING_CHUNKS`` chunks wait for the client. Exceptions of
    the synthesis are raised here; closing this iterator sets the job's cancel flag and calls ``on_stop`` (a text
    stream's ``cancel``), so the worker stops at its next speech token.
    """
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    room = threading.Semaphore(MAX_PENDING_CHUNKS)
    done = object()

    def put(item: object) -> None:
        while not room.acquire(timeout=0.1):
            job.check()  # the client is gone or the time is up: stop waiting for it
        loop.call_soon_threadsafe(q.put_nowait, item)

    def work() -> None:
        try:
            for chunk in job.run(job.token_check):
                job.check()
                job.count_samples(len(chunk.samples))
                put((chunk.pcm16(), (chunk.text, tuple(chunk.span))))
            loop.call_soon_threadsafe(q.put_nowait, done)
        except BaseException as e:  # handed to the event loop and raised there
            loop.call_soon_threadsafe(q.put_nowait, e)

    job.future = loop.run_in_executor(executor, work)
    try:
        while True:
            item = await q.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            room.release()
            if job.first_audio is None and item[0]:
                job.first_audio = time.perf_counter() - job.started
            job.audio += len(item[0]) // WIDTH
            yield item
    finally:
        job.cancel.set()
        if on_stop is not None:
            on_stop()


class TextSink(Protocol):
    """Where streamed text goes: an open text stream (``Engine.open_text_stream``, or the unloading engine's)."""

    def feed(self, text: str) -> None: ...

    def close(self) -> None: ...

    def cancel(self) -> None: ...


Sink = TypeVar("Sink", bound=TextSink)


class TextInbox:
    """The text of a stream that is not open yet (its voice being loaded, its slot awaited): what is fed, closed or
    cancelled meanwhile is handed to the stream when it is :meth:`attach` ed; from then on it passes through."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # fed on the event loop, attached in the synthesis worker
        self.stream: TextSink | None = None
        self.pending: list[str] = []
        self.closed = self.cancelled = False

    def feed(self, text: str) -> None:
        with self.lock:
            if self.stream is None:
                self.pending.append(text)
                return
        self.stream.feed(text)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if self.stream is None:
                return
        self.stream.close()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.stream is None:
                return
        self.stream.cancel()

    def attach(self, stream: Sink) -> Sink:
        """Hand ``stream`` what came so far (then everything passes through); returns it."""
        with self.lock:
            for text in self.pending:
                stream.feed(text)
            self.pending.clear()
            if self.cancelled:
                stream.cancel()
            elif self.closed:
                stream.close()
            self.stream = stream
        return stream
