"""Text that arrives in pieces, spoken sentence by sentence: the shape of the engine's text-stream API
(``engine.open_text_stream(voice, config, instruct)`` -> ``feed`` / ``close`` / ``cancel`` / iterate), built here on
``engine.synthesize`` for engines that do not have it yet.

:func:`open_text_stream` uses the engine's own ``open_text_stream`` when it has one; otherwise a
:class:`SentenceTextStream`, which cuts the text at sentence ends as it arrives and synthesizes each finished
sentence with ``engine.synthesize`` (so a sentence starts only once its end has been written, where the engine's
API may start earlier). Either way the consumer sees the same thing: :class:`~cosyvoice_cpu.config.AudioChunk` s,
``chunk.text`` the sentence spoken, the last one ``final``.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from cosyvoice_cpu.config import AudioChunk, SynthesisConfig

logger = logging.getLogger(__name__)

# a sentence ends at . ! ? ; … (runs of them, closing quotes and brackets after) followed by white space, or at
# the CJK full stops, which need no space after them
_LATIN_END = re.compile(r"[.!?;…]+[\"'”’)\]]*\s+")
_CJK_END = re.compile(r"[。！？；]+[”’」』）]*")


class StreamCancelled(Exception):
    """The text stream was cancelled (:meth:`SentenceTextStream.cancel`): its iteration ends with this."""


def cut_sentences(buffer: str) -> tuple[list[str], str]:
    """(the finished sentences at the start of ``buffer``, the unfinished rest). A sentence is finished once its
    end mark is followed by white space (Latin) or at once (CJK full stops); blank pieces are dropped."""
    done: list[str] = []
    start = 0
    while True:
        ends = [m for m in (_LATIN_END.search(buffer, start), _CJK_END.search(buffer, start)) if m is not None]
        if not ends:
            break
        end = min(m.end() for m in ends)
        piece = buffer[start:end].strip()
        if piece:
            done.append(piece)
        start = end
    return done, buffer[start:]


_END = object()


class SentenceTextStream:
    """``open_text_stream`` on ``engine.synthesize``: ``feed`` text (any thread, returns at once), ``close`` at the
    end of the text, iterate (one thread) for the audio; ``cancel`` abandons it (the sentence being spoken stops
    at its next speech token, and the iteration raises :class:`StreamCancelled`).

    Args:
        engine: an :class:`~cosyvoice_cpu.engine.Engine` (anything with its ``synthesize``).
        voice, config, instruct: as for ``engine.synthesize`` (the same for every sentence).
    """

    def __init__(self, engine: Any, voice: Any, config: SynthesisConfig | None = None, instruct: str | None = None):
        self.engine, self.voice, self.config, self.instruct = engine, voice, config, instruct
        self._lock = threading.Lock()
        self._buffer = ""
        self._closed = False
        self._cancelled = threading.Event()
        self._sentences: queue.Queue = queue.Queue()

    def feed(self, text: str) -> None:
        """Add ``text``; each sentence it finishes is queued for synthesis. Refused after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise ValueError("feed after close: the text stream has ended")
            done, self._buffer = cut_sentences(self._buffer + text)
            for sentence in done:
                self._sentences.put(sentence)

    def close(self) -> None:
        """The end of the text: the unfinished rest is spoken as the last sentence. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rest, self._buffer = self._buffer.strip(), ""
            if rest:
                self._sentences.put(rest)
            self._sentences.put(_END)

    def cancel(self) -> None:
        """Abandon the stream: work stops within a speech token, and the iteration raises StreamCancelled."""
        self._cancelled.set()
        self._sentences.put(_END)

    def _check(self) -> None:
        if self._cancelled.is_set():
            raise StreamCancelled("the text stream was cancelled")

    def __iter__(self) -> Iterator[AudioChunk]:
        rate = int(self.engine.sample_rate)
        last_text = ""
        while True:
            item = self._sentences.get()
            self._check()
            if item is _END:
                break
            last_text = item
            for chunk in self.engine.synthesize(item, self.voice, self.config, self.instruct, check=self._check):
                self._check()
                if len(chunk.samples):
                    yield AudioChunk(chunk.samples, rate, False, item, chunk.span)
        yield AudioChunk(np.zeros(0, np.float32), rate, True, last_text)


class TextInbox:
    """The text of a stream that is not open yet (its voice being loaded, its slot awaited): what is fed, closed or
    cancelled meanwhile is handed to the stream when it is :meth:`attach` ed; from then on it passes through."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.pending: list[str] = []
        self.closed = self.cancelled = False

    def feed(self, text: str) -> None:
        if self.stream is not None:
            self.stream.feed(text)
        else:
            self.pending.append(text)

    def close(self) -> None:
        self.closed = True
        if self.stream is not None:
            self.stream.close()

    def cancel(self) -> None:
        self.cancelled = True
        if self.stream is not None:
            self.stream.cancel()

    def attach(self, stream: Any) -> Any:
        """Hand ``stream`` what came so far; returns it."""
        self.stream = stream
        for text in self.pending:
            stream.feed(text)
        self.pending.clear()
        if self.cancelled:
            stream.cancel()
        elif self.closed:
            stream.close()
        return stream


def open_text_stream(
    engine: Any, voice: Any, config: SynthesisConfig | None = None, instruct: str | None = None
) -> Any:
    """The engine's ``open_text_stream`` where it has one, else a :class:`SentenceTextStream` on it."""
    native = getattr(engine, "open_text_stream", None)
    if callable(native):
        return native(voice, config, instruct)
    return SentenceTextStream(engine, voice, config, instruct)
