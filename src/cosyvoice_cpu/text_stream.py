"""Speech while the text is still being written: :class:`TextStream`, made by :meth:`Engine.open_text_stream`.

    stream = engine.open_text_stream(voice, SynthesisConfig(stream=True))
    threading.Thread(target=lambda: [stream.feed(p) for p in llm_pieces()] and stream.close()).start()
    for chunk in stream:          # AudioChunks as soon as they exist; the last one has final=True
        play(chunk.samples)

The writer calls :meth:`TextStream.feed` (any thread, returns at once) and :meth:`TextStream.close`; the reader
iterates. Text is cut into phrases that are safe to normalize and tokenize alone (:mod:`cosyvoice_cpu.text.phrases`),
then:

- CosyVoice2 / Fun-CosyVoice3 with ``stream=True``: each phrase goes to the LM at once, interleaved with the
  voice's prompt as the official ``inference_bistream`` does (:mod:`cosyvoice_cpu.lm.bistream`); speech tokens
  flow into the family's streamed recipe as they are decoded. The text is spoken in passages: a passage ends at a
  sentence end once it holds half the engine's text-token cap, or at the cap, so one LM request never outgrows
  the KV cache and memory stays flat however long the stream runs;
- CosyVoice-300M (its LM was not trained on interleaved text), or ``stream=False``: each sentence is spoken as
  soon as it is complete, normalized whole as :meth:`Engine.synthesize` does.

:meth:`TextStream.cancel` (or closing the iterator) stops the work at once. Passages decode on the engine's LM
scheduler, so a stream that waits for text takes no time from other requests' decode steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cosyvoice_cpu.config import AudioChunk, SynthesisConfig
from cosyvoice_cpu.errors import ConfigError, WorkCancelled
from cosyvoice_cpu.facts import FamilyFacts
from cosyvoice_cpu.families.base import LMPrompt
from cosyvoice_cpu.flow.prompt_caches import RequestCaches
from cosyvoice_cpu.lm.bistream import BistreamRequest
from cosyvoice_cpu.lm.generate import SpeechTokenGenerator
from cosyvoice_cpu.lm.sampling import RngDraw, SamplingConfig
from cosyvoice_cpu.lm.scheduler import LMScheduler
from cosyvoice_cpu.lm.source import EarlyTokens, SentenceTokens, StreamTokens, TokenSource
from cosyvoice_cpu.sentence import Piece, Timings
from cosyvoice_cpu.text import normalize_text, prepare
from cosyvoice_cpu.text.normalize import detect_language
from cosyvoice_cpu.text.phrases import PhraseCutter, ends_sentence
from cosyvoice_cpu.text.tokenizer import TextTokenizer
from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

MAX_STREAM_CHARS = 100_000  # characters one text stream may be fed (a reply, not a book)


class Speaker(Protocol):
    """What a text stream asks of the engine (:class:`~cosyvoice_cpu.engine.Engine` is one)."""

    tokenizer: TextTokenizer
    lm: SpeechTokenGenerator
    scheduler: LMScheduler | None
    sample_rate: int

    @property
    def facts(self) -> FamilyFacts: ...

    @property
    def fill_token(self) -> int: ...

    def lm_prompt(self, voice: Voice, instruct: str | None = None, normalize: bool = True) -> LMPrompt: ...

    def segment_cap(
        self, prompt: LMPrompt, max_tokens: int | None = None, minimum: int = 8, ratio: float | None = None
    ) -> int: ...

    def sampling_for(self, config: SynthesisConfig) -> SamplingConfig: ...

    def speak(
        self,
        tokens: TokenSource,
        voice: Voice,
        config: SynthesisConfig,
        rng: np.random.Generator,
        t: Timings,
        caches: RequestCaches | None = None,
    ) -> Iterator[Piece]: ...


class TextStreamCancelled(WorkCancelled):
    """The text stream was cancelled (:meth:`TextStream.cancel`) before it was spoken to the end: a
    :class:`~cosyvoice_cpu.errors.WorkCancelled`, not a ConfigError, so a server tells a client's cancel from a bad
    request."""


@dataclass
class _Passage:
    """A run of text spoken by one LM request."""

    source: TokenSource
    text: str = ""
    tokens: int = 0
    request: BistreamRequest | None = None  # a text-stream passage, fed while open
    span: tuple[int, int] = (0, 0)


@dataclass
class _State:
    passages: deque[_Passage] = field(default_factory=deque)
    open: _Passage | None = None  # the passage text goes to now (interleaved mode)
    sentence: str = ""  # the sentence being written (sentence mode)
    sentence_start: int = 0
    chars: int = 0
    closed: bool = False
    cancelled: bool = False
    first_text: float | None = None
    speaking: bool = False  # the reader has taken a passage: the next one's LM may start early


class TextStream:
    """An open text stream of one voice; see the module docstring. Build it with
    :meth:`~cosyvoice_cpu.engine.Engine.open_text_stream`."""

    def __init__(
        self,
        engine: Speaker,
        voice: Voice,
        config: SynthesisConfig,
        instruct: str | None = None,
        check: Callable[[], None] | None = None,
        timings: Timings | None = None,
    ) -> None:
        self.engine, self.voice, self.config, self.check = engine, voice, config, check
        self.timings = timings or Timings()
        self.prompt = engine.lm_prompt(voice, instruct, config.normalize)
        self.cap = engine.segment_cap(self.prompt, config.max_tokens, ratio=config.forced_token_ratio)
        self.interleaved = config.stream and engine.facts.mix_ratio is not None
        lm_rng, self._rng = config.rngs()
        self._caches: RequestCaches = {}  # the voice's prompt cache, shared by the stream's passages
        self._seeds = lm_rng  # one child generator per passage, in text order: passages may decode concurrently
        self._sampling = engine.sampling_for(config)
        self._cutter = PhraseCutter()
        self._lock = threading.Condition()
        self._state = _State()
        self._iterated = False
        self._error: BaseException | None = None

    # ---- the writer's side ------------------------------------------------------------------------------------

    def feed(self, text: str) -> None:
        """Add text (any length, any split: mid-word and mid-number are fine). Returns at once."""
        if not isinstance(text, str):
            raise ConfigError(f"text stream pieces must be str, got {type(text).__name__}")
        text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError here, not deep in the tokenizer
        with self._lock:
            st = self._state
            if st.closed or st.cancelled:
                raise ConfigError("this text stream is closed; open a new one to speak more")
            if st.chars + len(text) > MAX_STREAM_CHARS:
                raise ConfigError(f"a text stream takes at most {MAX_STREAM_CHARS} characters; open another one")
            st.chars += len(text)
            if st.first_text is None and text.strip():
                st.first_text = time.perf_counter()
            for phrase in self._cutter.push(text):
                self._phrase(phrase)

    def close(self) -> None:
        """No more text: what is held back is spoken, then the audio ends (its last chunk ``final``)."""
        with self._lock:
            st = self._state
            if st.closed or st.cancelled:
                return
            rest = self._cutter.flush()
            if rest:
                self._phrase(rest)
            self._end_sentence()
            self._end_passage()
            st.closed = True
            self._lock.notify_all()

    def cancel(self) -> None:
        """Abandon the stream: its LM work stops, and the reader's iteration ends with TextStreamCancelled."""
        with self._lock:
            st = self._state
            st.cancelled = True
            for p in [*st.passages, *([st.open] if st.open else [])]:
                if p.request is not None:
                    p.request.cancel()
                if isinstance(p.source, EarlyTokens):
                    p.source.abandon()
            self._lock.notify_all()

    def abort(self, error: BaseException) -> None:
        """Cancel because the writer failed: the reader's iteration raises ``error``."""
        self._error = error
        self.cancel()

    def _phrase(self, phrase: str) -> None:
        """Route one phrase (called under the lock)."""
        if not self.interleaved:
            self._state.sentence += phrase
            if ends_sentence(phrase) or self.engine.tokenizer.count(self._state.sentence) >= self.cap:
                self._end_sentence()
            return
        ids = self._ids(phrase)
        if not ids:
            return
        st = self._state
        if st.open is None:
            request = BistreamRequest(self.engine.lm, self.prompt.text_ids, self.prompt.speech,
                                      self.engine.facts.mix_ratio, self.engine.fill_token,
                                      draw=self._draw(), sampling=self._sampling,
                                      forced_ratio=self.config.forced_token_ratio)  # fmt: skip
            st.open = _Passage(StreamTokens(request, self.engine.scheduler, self._check), request=request)
            st.passages.append(st.open)
            self._start_next()
            self._lock.notify_all()
        p = st.open
        p.request.feed(ids)
        p.text += phrase
        p.tokens += len(ids)
        if p.tokens >= self.cap or (ends_sentence(phrase) and p.tokens >= self.cap // 2):
            self._end_passage()

    def _start_next(self) -> None:
        """Start the LM of the next interleaved passage while the reader speaks the one before (called under the
        lock): it prefills and decodes its first chunk's tokens, then waits for its turn, so the audio does not
        run dry at the passage boundary. (Sentence mode keeps one LM request at a time.)"""
        st = self._state
        head = st.passages[0] if st.passages else None
        if st.speaking and head is not None and head.request is not None and not isinstance(head.source, EarlyTokens):
            head.source = EarlyTokens(head.source, self.config.first_chunk_tokens)

    def _ids(self, phrase: str) -> list[int]:
        """A phrase normalized (as the engine's text is) and tokenized; a leading blank is kept for the BPE."""
        text = phrase
        if self.config.normalize and phrase.strip():
            lang = detect_language(phrase)
            text = normalize_text(phrase, lang)
            if phrase[:1].isspace() and lang == "en" and text and not text[:1].isspace():
                text = " " + text
        return self.engine.tokenizer.encode(text) if text.strip() else []

    def _end_passage(self) -> None:
        st = self._state
        if st.open is not None:
            st.open.request.end()
            st.open = None

    def _end_sentence(self) -> None:
        """Speak the sentence written so far (sentence mode; called under the lock)."""
        st = self._state
        text, st.sentence = st.sentence, ""
        start, st.sentence_start = st.sentence_start, st.sentence_start + len(text)
        if not text.strip():
            return
        try:
            segments = list(prepare(text, self.engine.tokenizer, self.config.normalize, max_tokens=self.cap))
        except ConfigError:  # nothing speakable in it (punctuation only)
            logger.debug("text stream: nothing to speak in %r", text)
            return
        p = self.prompt
        for seg in segments:
            source = SentenceTokens(self.engine.lm, self.engine.scheduler, list(seg.token_ids), p.text_ids, p.speech,
                                    p.speaker, self._draw(), self._sampling,
                                    self.config.token_budget(len(seg.token_ids)), self._check)  # fmt: skip
            st.passages.append(_Passage(source, seg.text, len(seg.token_ids), span=(start, start + len(text))))
        self._lock.notify_all()

    def _draw(self) -> RngDraw:
        """A passage's random source: the request's LM generator seeds one per passage, in text order."""
        return RngDraw(np.random.default_rng(int(self._seeds.integers(2**63))))

    def _check(self) -> None:
        if self._state.cancelled:
            raise TextStreamCancelled("the text stream was cancelled")
        if self.check is not None:
            self.check()

    # ---- the reader's side ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[AudioChunk]:
        if self._iterated:
            raise ConfigError("a text stream can be iterated only once")
        self._iterated = True
        return self._run()

    def _next(self) -> _Passage | None:
        """The next passage to speak (waits for text); None once the stream is closed and all is spoken."""
        with self._lock:
            st = self._state
            while not st.passages and not st.closed and not st.cancelled:
                self._lock.wait()
            if st.cancelled:
                raise self._error or TextStreamCancelled("the text stream was cancelled")
            if not st.passages:
                return None
            p = st.passages.popleft()
            st.speaking = True
            self._start_next()
            return p

    def _run(self) -> Iterator[AudioChunk]:
        t, sr = self.timings, self.engine.sample_rate
        produced, done = 0, False
        try:
            while (p := self._next()) is not None:
                for samples, _ in self.engine.speak(p.source, self.voice, self.config, self._rng, t, self._caches):
                    self._check()
                    if not len(samples):
                        continue
                    if t.first_audio is None and self._state.first_text is not None:
                        t.first_audio = time.perf_counter() - self._state.first_text
                    t.audio += len(samples) / sr
                    produced += len(samples)
                    yield AudioChunk(samples, sr, False, p.text, p.span)
            done = True
        finally:
            self._caches.clear()  # the voice's cache goes back to the LRU's care (or is freed) with the reading
            if not done:  # the reader stopped early: a passage started ahead of its turn must not keep its row
                self.cancel()
        if not produced:
            raise ConfigError("the text stream ended without speech: it held no speakable text")
        yield AudioChunk(np.zeros(0, np.float32), sr, True, "", (0, 0))


def pump(stream: TextStream, pieces: Iterable[str]) -> Iterator[AudioChunk]:
    """Feed ``pieces`` to ``stream`` from a background thread while the caller iterates its audio; an error of
    the pieces' iterator comes out of the audio iteration."""

    def write() -> None:
        try:
            for piece in pieces:
                stream.feed(piece)
            stream.close()
        except BaseException as e:  # the reader re-raises it
            stream.abort(e)

    threading.Thread(target=write, name="text-stream-writer", daemon=True).start()
    return iter(stream)
