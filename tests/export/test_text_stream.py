"""Text streams (Engine.open_text_stream): speech starts while the text is still being written, and every way a
writer can misbehave ends cleanly, on the tiny exported fixtures (CosyVoice2 interleaved, CosyVoice-300M by
sentence)."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.errors import ConfigError, WorkCancelled
from cosyvoice_cpu.lm.source import EarlyTokens
from cosyvoice_cpu.text_stream import MAX_STREAM_CHARS, TextStreamCancelled

REPLY = "The alarm on line three is active. Please check the pressure valve at 3.5 bar now, then call the supervisor."
STREAM = SynthesisConfig(stream=True, seed=3, first_chunk_tokens=5, chunk_tokens=10)


def _tone(seconds: float = 2.0, sr: int = 16000) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    wave = (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, wave, sr, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine(tiny_export_dir: Path) -> Engine:
    with Engine.load(tiny_export_dir, EngineConfig(threads=2, streaming_estimator=True)) as e:
        yield e


@pytest.fixture(scope="module")
def voice(engine: Engine):
    return engine.make_voice(_tone(), "Good morning everyone, welcome.", name="t")


def _words(text: str) -> list[str]:
    out, word = [], ""
    for ch in text:  # pieces that cut words and numbers in half, as an LLM's tokens do
        word += ch
        if len(word) == 3:
            out.append(word)
            word = ""
    return [*out, word] if word else out


def test_audio_starts_before_the_text_ends(engine: Engine, voice) -> None:
    stream = engine.open_text_stream(voice, STREAM)
    pieces = _words(REPLY)
    half = len(pieces) // 2
    for p in pieces[:half]:
        stream.feed(p)
    chunks = iter(stream)
    first = next(chunks)  # must come while the second half is not written yet
    assert len(first.samples) > 0 and not first.final
    assert stream.timings.first_audio is not None
    for p in pieces[half:]:
        stream.feed(p)
    stream.close()
    rest = list(chunks)
    assert rest[-1].final and all(not c.final for c in rest[:-1])
    wave = np.concatenate([first.samples, *(c.samples for c in rest)])
    assert np.isfinite(wave).all() and np.abs(wave).max() <= 1.0 and len(wave) > engine.sample_rate * 0.5


def test_synthesize_takes_a_generator_and_is_reproducible(engine: Engine, voice) -> None:
    def writer():
        for p in _words(REPLY):
            time.sleep(0.001)
            yield p

    a = np.concatenate([c.samples for c in engine.synthesize(writer(), voice, STREAM)])
    b = np.concatenate([c.samples for c in engine.synthesize(iter(_words(REPLY)), voice, STREAM)])
    assert len(a) > 0 and np.array_equal(a, b)  # pieces' timing does not change the audio, the seed decides


def test_sentence_mode_without_stream(engine: Engine, voice) -> None:
    stream = engine.open_text_stream(voice, SynthesisConfig(seed=1))
    stream.feed("First sentence here. Second one")
    chunks = iter(stream)
    first = next(chunks)  # the first sentence is spoken before the second is complete
    assert first.text.strip().startswith("First") and len(first.samples) > 0
    stream.feed(" ends now.")
    stream.close()
    assert list(chunks)[-1].final


def test_cancel_frees_the_lm_row(engine: Engine, voice) -> None:
    stream = engine.open_text_stream(voice, STREAM)
    for p in _words(REPLY)[:12]:
        stream.feed(p)
    chunks = iter(stream)
    next(chunks)
    threading.Timer(0.2, stream.cancel).start()
    with pytest.raises(TextStreamCancelled) as caught:
        list(chunks)  # the writer never closed it: only cancel ends it
    assert isinstance(caught.value, WorkCancelled) and not isinstance(caught.value, ConfigError)  # not a bad request
    deadline = time.monotonic() + 5
    while engine.scheduler.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.scheduler.active == 0


def _second_passage_held(engine: Engine, voice):
    """A stream fed and closed at once, read up to its first chunk: its second passage, started ahead."""
    stream = engine.open_text_stream(voice, STREAM)
    for p in _words(REPLY):
        stream.feed(p)
    stream.close()
    chunks = iter(stream)
    next(chunks)  # the reader is on the first passage
    ahead = stream._state.passages[0]
    assert isinstance(ahead.source, EarlyTokens)
    deadline = time.monotonic() + 60
    while len(ahead.request.tokens) < STREAM.first_chunk_tokens and time.monotonic() < deadline:
        time.sleep(0.02)
    return chunks, ahead


def test_the_next_passage_starts_while_the_one_before_is_spoken(engine: Engine, voice) -> None:
    chunks, ahead = _second_passage_held(engine, voice)
    time.sleep(0.2)
    assert len(ahead.request.tokens) == STREAM.first_chunk_tokens  # its first chunk decoded, then held
    rest = list(chunks)
    assert rest[-1].final and len({c.text for c in rest if len(c.samples)}) >= 2


def test_a_reader_that_stops_early_frees_the_passage_started_ahead(engine: Engine, voice) -> None:
    chunks, ahead = _second_passage_held(engine, voice)
    chunks.close()
    deadline = time.monotonic() + 10
    while engine.scheduler.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.scheduler.active == 0 and ahead.request.stop_reason == "cancelled"


def test_writer_error_reaches_the_reader(engine: Engine, voice) -> None:
    def broken():
        yield "Hello there, "
        raise RuntimeError("the LLM connection dropped")

    with pytest.raises(RuntimeError, match="connection dropped"):
        list(engine.synthesize(broken(), voice, STREAM))


def test_bad_writers(engine: Engine, voice) -> None:
    stream = engine.open_text_stream(voice, STREAM)
    stream.close()
    with pytest.raises(ConfigError, match="without speech"):
        list(stream)
    stream = engine.open_text_stream(voice, STREAM)
    with pytest.raises(UnicodeEncodeError):
        stream.feed("bad \ud800 surrogate")
    with pytest.raises(ConfigError, match="str"):
        stream.feed(b"bytes")
    with pytest.raises(ConfigError, match="at most"):
        stream.feed("a " * MAX_STREAM_CHARS)
    stream.cancel()
    with pytest.raises(ConfigError, match="closed"):
        stream.feed("more")


def test_waiting_streams_do_not_hold_others(engine: Engine, voice) -> None:
    """Eight streams whose writers stall mid-reply: a plain request still finishes, and they finish after."""
    streams = [engine.open_text_stream(voice, STREAM) for _ in range(8)]
    readers = []
    results: list[int] = []
    for s in streams:
        for p in _words(REPLY)[:10]:
            s.feed(p)
        t = threading.Thread(target=lambda s=s: results.append(sum(len(c.samples) for c in s)))
        t.start()
        readers.append(t)
    t0 = time.monotonic()
    wave = engine.synthesize_wav("Plain request.", voice, SynthesisConfig(seed=2))
    assert len(wave) > 0 and time.monotonic() - t0 < 60
    for s in streams:
        s.feed(" and the end.")
        s.close()
    for t in readers:
        t.join(120)
    assert len(results) == 8 and all(n > 0 for n in results)


def test_cosyvoice_300m_speaks_by_sentence(tiny_v1_export_dir: Path) -> None:
    with Engine.load(tiny_v1_export_dir, EngineConfig(threads=2)) as e:
        voice = e.make_voice(_tone(), "Good morning everyone.")
        chunks = list(e.synthesize(iter(["Hello the", "re. How are", " you?"]), voice, SynthesisConfig(seed=1)))
    assert chunks[-1].final and sum(len(c.samples) for c in chunks) > 0
    assert {c.text.strip() for c in chunks if len(c.samples)} >= {"Hello there."}


def test_cli_speaks_stdin_as_it_arrives(tiny_export_dir: Path, tmp_path: Path) -> None:
    """`say --stream --text-stream -o -`: PCM comes out while standard input is still open."""
    import subprocess
    import sys

    wav = tmp_path / "p.wav"
    wav.write_bytes(_tone())
    cmd = [
        sys.executable,
        "-m",
        "cosyvoice_cpu",
        "say",
        "-m",
        str(tiny_export_dir),
        "--prompt-wav",
        str(wav),
        "--prompt-text",
        "Good morning everyone, welcome.",
        "--stream",
        "--text-stream",
        "--first-chunk-tokens",
        "5",
        "--seed",
        "1",
        "--threads",
        "2",
        "-o",
        "-",
    ]
    log = tmp_path / "stderr.txt"
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("wb"))
    got = bytearray()

    def read() -> None:
        while data := os.read(proc.stdout.fileno(), 4096):
            got.extend(data)

    reader = threading.Thread(target=read)
    reader.start()
    proc.stdin.write(b"The alarm on line three is active. Please check the val")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while len(got) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    if len(got) < 2:
        proc.kill()
    assert len(got) >= 2, f"no audio before the end of the text: {log.read_text()[-2000:]}"
    proc.stdin.write("ve now. 三号线".encode() + "温度".encode()[:4])  # a character cut between two writes
    proc.stdin.write("温度".encode()[4:] + "过高。".encode())
    proc.stdin.close()
    assert proc.wait(120) == 0, log.read_text()[-2000:]
    reader.join(10)
    assert len(got) % 2 == 0 and len(got) > 2 * 24000 * 0.5
