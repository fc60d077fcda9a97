"""The bench's text-stream workload: a simulated LLM writes a reply into a text stream while it is spoken.

A :class:`Writer` feeds the reply one text token of the model's tokenizer at a time at ``rate`` tokens per second
(:func:`llm_pieces`). Two ways of speaking it are measured in the same process, one after the other:

- ``text_stream``: :meth:`~cosyvoice_cpu.engine.Engine.open_text_stream` (CosyVoice2 / Fun-CosyVoice3: the
  interleaved LM, docs/streaming.md; CosyVoice-300M: its sentence mode behind the same API);
- ``by_sentence``: what a caller without text streams does: wait until a sentence is complete (the same
  :class:`~cosyvoice_cpu.text.phrases.PhraseCutter` cut), then speak it with the normal streamed
  :meth:`~cosyvoice_cpu.engine.Engine.synthesize`, the next sentence once the previous one is spoken.

Both are timed from the first text piece. :class:`Playback` is the listener: a player that starts with the first
chunk and plays without pause while it holds audio; a *stall* is a time it runs dry before the next chunk comes.
Random weights seldom sample EOS, so both ways use ``SynthesisConfig.forced_token_ratio`` (``speech_ratio``
speech tokens per text token; the default 3 is the LM's own 15 speech tokens per 5 text tokens).
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.jsontypes import JsonObject, JsonValue
from cosyvoice_cpu.text.phrases import PhraseCutter, ends_sentence
from cosyvoice_cpu.text.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

RATE = 20.0  # text tokens per second the simulated LLM writes
SENTENCES = 3
SENTENCE_TOKENS = 25
SPEECH_RATIO = 3.0  # speech tokens per text token (the interleaved LM's 15 per 5)
STALL_TOLERANCE_S = 0.01  # a chunk this late is not counted as a stall (a player's period)
SOURCES = (
    "The pressure in the second cooling loop has dropped below its normal range over the last ten minutes, and "
    "the flow meters on both pumps show the same slow decline since the morning shift began",
    "I recommend that the operators close valve seven, restart the backup pump and watch the readings for a "
    "quarter of an hour before they decide whether the main pump has to be replaced today",
    "After that, please ask the maintenance team to check the temperature sensors on line three and send me "
    "their new readings, so that I can compare them with the values from last week",
)


def reply_text(tokenizer: TextTokenizer, sentences: int = SENTENCES, tokens: int = SENTENCE_TOKENS) -> str:
    """``sentences`` sentences of at most ``tokens`` text tokens each (the model's tokenizer, final period
    included): the leading words of :data:`SOURCES` (cycled), as many as fit."""
    if sentences < 1 or tokens < 3:
        raise ConfigError(f"a reply needs >= 1 sentence of >= 3 tokens, got {sentences} x {tokens}")
    out: list[str] = []
    for i in range(sentences):
        words = SOURCES[i % len(SOURCES)].split()
        n = 1
        while n < len(words) and tokenizer.count(" ".join(words[: n + 1]) + ".") <= tokens:
            n += 1
        out.append(" ".join(words[:n]) + ".")
    return " ".join(out)


def llm_pieces(tokenizer: TextTokenizer, text: str) -> list[str]:
    """``text`` as an LLM writes it: one piece per text token of ``tokenizer`` (``""`` for a token that ends
    inside a character: its text comes with the next). Raises ConfigError if the tokenizer does not give the
    text back."""
    ids = tokenizer.encode(text)
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:i])
        if decoded.endswith("\ufffd") and i < len(ids):
            pieces.append("")
            continue
        pieces.append(decoded[len(done) :])
        done = decoded
    if done != text:
        raise ConfigError("the model's tokenizer does not give this reply back; use plain text for --reply")
    return pieces


def due_times(n: int, rate: float) -> list[float]:
    """Seconds after the start at which each of ``n`` pieces is written: the first at once, then 1/``rate`` apart."""
    if rate <= 0:
        raise ConfigError(f"the writing rate must be > 0 text tokens/s, got {rate}")
    return [i / rate for i in range(n)]


@dataclass
class Writer:
    """The simulated LLM: :meth:`run` feeds ``pieces`` on :func:`due_times` (late pieces go at once, never
    bunched ahead of time). ``first``/``last``: clock readings at the first and the last piece."""

    pieces: Sequence[str]
    rate: float = RATE
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    first: float | None = None
    last: float | None = None

    def run(self, feed: Callable[[str], None], close: Callable[[], None]) -> None:
        start = self.clock()
        for due, piece in zip(due_times(len(self.pieces), self.rate), self.pieces, strict=True):
            wait = start + due - self.clock()
            if wait > 0:
                self.sleep(wait)
            now = self.clock()
            self.first = now if self.first is None else self.first
            self.last = now
            if piece:
                feed(piece)
        close()


@dataclass
class Playback:
    """A player fed chunks as they arrive: it starts with the first and plays continuously while it holds audio.

    :meth:`add` takes (arrival time, seconds of audio); ``stalls`` holds (when the audio ran dry, seconds until
    the next chunk) for every gap longer than ``tolerance``."""

    tolerance: float = STALL_TOLERANCE_S
    start: float | None = None
    end: float = 0.0  # when the audio received so far has played out
    audio: float = 0.0
    last: float | None = None  # arrival of the last chunk
    stalls: list[tuple[float, float]] = field(default_factory=list)

    def add(self, t: float, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.start is None:
            self.start, self.end = t, t
        elif t > self.end + self.tolerance:
            self.stalls.append((self.end, t - self.end))
        self.end = max(self.end, t) + seconds
        self.audio += seconds
        self.last = t

    def summary(self, origin: float, text_end: float) -> JsonObject:
        """Seconds from ``origin`` (the first text piece): first audio, stalls (all, and those that began before
        ``text_end``, the last piece), streamed RTF (origin to the last chunk, per second of audio)."""
        if self.start is None or self.last is None:
            raise ConfigError("no audio was played: nothing to measure")
        return {
            "first_audio_s": self.start - origin,
            "audio_s": self.audio,
            "stalls": len(self.stalls),
            "stall_s": sum(s for _, s in self.stalls),
            "stalls_while_writing": sum(1 for at, _ in self.stalls if at < text_end),
            "stall_at_s": [[round(at - origin, 3), round(s, 3)] for at, s in self.stalls],
            "stream_rtf": (self.last - origin) / self.audio,
        }


def speak_text_stream(
    engine: Engine, voice: Voice, pieces: Sequence[str], rate: float, config: SynthesisConfig
) -> JsonObject:
    """One reply through :meth:`Engine.open_text_stream`, written by a :class:`Writer` thread."""
    stream = engine.open_text_stream(voice, config)
    writer, play = Writer(pieces, rate), Playback()
    thread = threading.Thread(target=writer.run, args=(stream.feed, stream.close), name="bench-writer", daemon=True)
    thread.start()
    starts, gaps, text = [], [], None  # a passage's text grows as it is written: a chunk whose text does not
    for chunk in stream:  # extend the previous chunk's starts the next passage
        now = time.perf_counter()
        if len(chunk.samples) and (text is None or not chunk.text.startswith(text)):
            starts.append(now)
            if play.last is not None:  # the boundary: the last chunk of the passage before to this one
                gaps.append(round(now - play.last, 3))
        play.add(now, chunk.duration)
        text = chunk.text if len(chunk.samples) else text
    thread.join()
    mode = "interleaved" if stream.interleaved else "sentence"
    return {**play.summary(writer.first, writer.last), "mode": mode, **_passages(starts, writer.first, gaps)}


def _passages(starts: list[float], origin: float, gaps: list[float]) -> JsonObject:
    """When each passage's (or sentence's) first chunk came, and the seconds from the chunk before it."""
    return {"passages": len(starts), "passage_at_s": [round(t - origin, 3) for t in starts], "boundary_gap_s": gaps}


class SentenceQueue:
    """The writer's pieces cut into complete sentences (a :class:`PhraseCutter` and :func:`ends_sentence`, as a
    text stream's sentence mode cuts them); ``get()`` gives the next one, None after the last."""

    def __init__(self) -> None:
        self._cutter, self._text, self._q = PhraseCutter(), "", queue.Queue()

    def feed(self, piece: str) -> None:
        for phrase in self._cutter.push(piece):
            self._phrase(phrase)

    def close(self) -> None:
        self._phrase(self._cutter.flush())
        if self._text.strip():
            self._q.put(self._text)
        self._q.put(None)

    def _phrase(self, phrase: str) -> None:
        self._text += phrase
        if ends_sentence(phrase) and self._text.strip():
            self._q.put(self._text)
            self._text = ""

    def get(self) -> str | None:
        return self._q.get()


def speak_by_sentence(
    engine: Engine, voice: Voice, pieces: Sequence[str], rate: float, config: SynthesisConfig
) -> JsonObject:
    """The same reply spoken sentence by sentence: each once complete, with the normal streamed synthesize."""
    sentences, play = SentenceQueue(), Playback()
    writer = Writer(pieces, rate)
    thread = threading.Thread(target=writer.run, args=(sentences.feed, sentences.close), daemon=True)
    thread.start()
    starts, gaps = [], []
    while (sentence := sentences.get()) is not None:
        first = True
        for chunk in engine.synthesize(sentence.strip(), voice, config):
            now = time.perf_counter()
            if first and len(chunk.samples):
                starts.append(now)
                gaps += [round(now - play.last, 3)] if play.last is not None else []
                first = False
            play.add(now, chunk.duration)
    thread.join()
    return {**play.summary(writer.first, writer.last), "mode": "sentence", **_passages(starts, writer.first, gaps)}


def measure(
    engine: Engine,
    voice: Voice,
    reply: str,
    rate: float = RATE,
    runs: int = 3,
    speech_ratio: float = SPEECH_RATIO,
    seed: int = 0,
) -> JsonObject:
    """Both ways, alternated ``runs`` times after one untimed warm-up of each; medians of the times, the worst
    run's stalls. Returns the ``text_stream`` section of a bench result (:func:`summarize`)."""
    pieces = llm_pieces(engine.tokenizer, reply)
    config = SynthesisConfig(stream=True, seed=seed, forced_token_ratio=speech_ratio)
    ways = {"text_stream": speak_text_stream, "by_sentence": speak_by_sentence}
    rows: dict[str, list[dict]] = {k: [] for k in ways}
    for i in range(runs + 1):
        for name, way in ways.items():
            row = way(engine, voice, pieces, rate, config)
            if i:
                rows[name].append(row)
    sentence_tokens = []
    queue_ = SentenceQueue()
    for p in pieces:
        queue_.feed(p)
    queue_.close()
    while (s := queue_.get()) is not None:
        sentence_tokens.append(engine.tokenizer.count(s.strip()))
    return summarize(
        rows,
        family=engine.facts.title,
        rate=rate,
        speech_ratio=speech_ratio,
        sentence_tokens=sentence_tokens,
        writing_s=(len(pieces) - 1) / rate,
    )


def summarize(rows: dict[str, list[JsonObject]], **workload: JsonValue) -> JsonObject:
    """Per way: medians of the times over the runs, the largest stall count and stall seconds, the mode and the
    passages; ``first_audio_ratio``: by-sentence first audio / text-stream first audio (> 1: the stream is
    sooner); ``runs``: every run's row."""
    out: JsonObject = {**workload, "runs": rows}
    for name, rs in rows.items():
        if not rs:
            raise ConfigError(f"no timed run of {name}")
        out[name] = {
            **{k: statistics.median(r[k] for r in rs) for k in ("first_audio_s", "stream_rtf", "audio_s")},
            **{k: max(r[k] for r in rs) for k in ("stalls", "stall_s", "stalls_while_writing")},
            "mode": rs[0]["mode"],
            "passages": rs[0]["passages"],
        }
    ts, bs = out.get("text_stream"), out.get("by_sentence")
    out["first_audio_ratio"] = bs["first_audio_s"] / ts["first_audio_s"] if ts and bs else None
    return out
