"""The text-stream adapter the Wyoming server speaks streamed text with until the engine's own ``open_text_stream``
exists: sentences cut as the text arrives, each spoken once finished, the last chunk final; cancel stops it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cosyvoice_cpu.config import AudioChunk
from cosyvoice_cpu.server.text_stream import (
    SentenceTextStream,
    StreamCancelled,
    TextInbox,
    cut_sentences,
    open_text_stream,
)


@pytest.mark.parametrize(
    ("text", "done", "rest"),
    [
        ("Hello there. How are", ["Hello there."], "How are"),
        ("Hello there.", [], "Hello there."),  # no space yet: "there.5" or "there.com" may follow
        ("It is 3.5 degrees! Really? Yes ", ["It is 3.5 degrees!", "Really?"], "Yes "),
        ('He said "stop." Then', ['He said "stop."'], "Then"),
        ("你好。今天天气很好！明天", ["你好。", "今天天气很好！"], "明天"),
        ("Wait... what", ["Wait..."], "what"),
        ("", [], ""),
    ],
)
def test_cut_sentences(text: str, done: list[str], rest: str) -> None:
    assert cut_sentences(text) == (done, rest)


class FakeEngine:
    """Speaks each text as one chunk of len(text) samples; records what it was asked and checks ``check``."""

    sample_rate = 100

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.spoken: list[str] = []
        self.gate = gate

    def synthesize(
        self, text: str, voice: Any, config: Any = None, instruct: Any = None, check: Any = None
    ) -> Iterator[AudioChunk]:
        self.spoken.append(text)
        for _ in range(100):
            if self.gate is not None and not self.gate.wait(0.01) and check is not None:
                check()
            if self.gate is None or self.gate.is_set():
                break
        yield AudioChunk(np.ones(len(text), np.float32), self.sample_rate, True, text, (0, len(text)))


def test_sentences_are_spoken_as_they_are_finished() -> None:
    engine = FakeEngine()
    stream = open_text_stream(engine, voice=None)
    assert isinstance(stream, SentenceTextStream)  # the engine has no open_text_stream of its own
    chunks: list[AudioChunk] = []
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    stream.feed("Good morning. The pump")
    for _ in range(200):
        if chunks:
            break
        threading.Event().wait(0.01)
    assert [c.text for c in chunks] == ["Good morning."]  # spoken before the rest of the text came
    stream.feed(" is hot")
    stream.close()
    reader.join(5)
    assert engine.spoken == ["Good morning.", "The pump is hot"]
    assert [c.final for c in chunks] == [False, False, True] and len(chunks[-1].samples) == 0
    with pytest.raises(ValueError, match="after close"):
        stream.feed("more")


def test_cancel_stops_the_sentence_being_spoken() -> None:
    gate = threading.Event()  # never set: the engine works until its check raises
    stream = SentenceTextStream(FakeEngine(gate), voice=None)
    stream.feed("A long sentence. ")
    errors: list[BaseException] = []

    def read() -> None:
        try:
            list(stream)
        except StreamCancelled as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    threading.Event().wait(0.05)
    stream.cancel()
    reader.join(5)
    assert not reader.is_alive() and errors


def test_the_inbox_hands_over_what_came_before_the_stream_opened() -> None:
    engine = FakeEngine()
    inbox = TextInbox()
    inbox.feed("One. ")
    inbox.feed("Two")
    inbox.close()
    stream = inbox.attach(SentenceTextStream(engine, voice=None))
    assert [c.text for c in stream] == ["One.", "Two", "Two"]
    assert engine.spoken == ["One.", "Two"]


def test_an_engine_with_open_text_stream_is_used_as_it_is() -> None:
    class Native(FakeEngine):
        def open_text_stream(self, voice: Any, config: Any = None, instruct: Any = None) -> str:
            return "native"

    assert open_text_stream(Native(), voice=None) == "native"
