"""The bench's text-stream workload without timing: the simulated writer's pacing on a fake clock, the stall
accounting on made-up chunk timelines, the reply and its pieces, the sentence cut, the summary and the report."""

from __future__ import annotations

import pytest

from cosyvoice_cpu.benchmark.report import markdown, text_stream_rows
from cosyvoice_cpu.benchmark.text_stream import (
    Playback,
    SentenceQueue,
    Writer,
    due_times,
    llm_pieces,
    reply_text,
    summarize,
)
from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.errors import ConfigError


class FakeClock:
    """A clock that moves only when slept on or when ``work`` is spent."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class CharTokenizer:
    """One token per character; ``count`` of a sentence = its characters."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def count(self, text: str) -> int:
        return len(text)


def test_writer_feeds_each_piece_on_time_and_never_early() -> None:
    clock = FakeClock()
    fed: list[tuple[float, str]] = []
    closed: list[float] = []
    writer = Writer(["a", "", "b", "c"], rate=4.0, clock=clock, sleep=clock.sleep)
    writer.run(lambda p: fed.append((clock.now, p)), lambda: closed.append(clock.now))
    assert fed == [(100.0, "a"), (100.5, "b"), (100.75, "c")]  # the empty piece takes its slot, is not fed
    assert writer.first == 100.0 and writer.last == 100.75 and closed == [100.75]
    assert due_times(3, 20.0) == [0.0, 0.05, 0.1]
    with pytest.raises(ConfigError, match="rate"):
        due_times(3, 0.0)


def test_a_slow_feed_delays_later_pieces_without_bunching() -> None:
    clock = FakeClock()
    fed: list[float] = []

    def feed(piece: str) -> None:  # the first feed takes 0.6 s (a reader holding the lock)
        fed.append(clock.now)
        if len(fed) == 1:
            clock.now += 0.6

    Writer(["a", "b", "c", "d"], rate=4.0, clock=clock, sleep=clock.sleep).run(feed, lambda: None)
    assert fed == [100.0, 100.6, 100.6, 100.75]  # b and c were due: at once; d waits for its own time
    assert all(s > 0 for s in clock.slept)


def test_playback_counts_the_times_the_audio_runs_dry() -> None:
    play = Playback(tolerance=0.01)
    for t, seconds in [(1.0, 0.4), (1.3, 0.4), (1.8, 0.5), (2.8, 0.5), (2.805, 0.1), (3.405, 1.0)]:
        play.add(t, seconds)
    play.add(4.0, 0.0)  # an empty (final) chunk changes nothing
    # plays out: 1.4, 1.8, 2.3 -> dry until 2.8 (0.5 s) -> 3.3, 3.4 -> 3.405 is within the tolerance
    assert play.start == 1.0 and play.stalls == [(2.3, pytest.approx(0.5))]
    s = play.summary(origin=0.5, text_end=2.0)
    assert s["first_audio_s"] == 0.5 and s["stalls"] == 1 and s["stall_s"] == pytest.approx(0.5)
    assert s["stalls_while_writing"] == 0 and s["stall_at_s"] == [[1.8, 0.5]]
    assert s["audio_s"] == pytest.approx(2.9) and s["stream_rtf"] == pytest.approx((3.405 - 0.5) / 2.9)
    with pytest.raises(ConfigError, match="no audio"):
        Playback().summary(0.0, 1.0)


def test_playback_without_gaps_has_no_stalls_and_a_stall_while_writing_is_told_apart() -> None:
    steady = Playback()
    for i in range(10):
        steady.add(1.0 + 0.4 * i, 0.5)  # each chunk lasts longer than the time to the next
    assert steady.stalls == []
    late = Playback(tolerance=0.0)
    late.add(1.0, 0.2)
    late.add(1.5, 0.2)  # dry from 1.2 to 1.5, before the text ended at 1.3
    late.add(3.0, 0.2)  # dry from 1.7 to 3.0, after
    s = late.summary(origin=0.0, text_end=1.3)
    assert s["stalls"] == 2 and s["stalls_while_writing"] == 1 and s["stall_s"] == pytest.approx(1.6)


def test_reply_and_pieces() -> None:
    tok = CharTokenizer()
    reply = reply_text(tok, sentences=4, tokens=30)
    sentences = [s if s.endswith(".") else s + "." for s in reply.split(". ")]
    assert len(sentences) == 4 and all(len(s) <= 30 for s in sentences) and reply.endswith(".")
    assert sentences[0] == sentences[3]  # the sources are cycled
    assert llm_pieces(tok, "Hi there.") == list("Hi there.")
    with pytest.raises(ConfigError, match="sentence"):
        reply_text(tok, sentences=0)

    class Lossy(CharTokenizer):
        def decode(self, ids: list[int]) -> str:
            return super().decode(ids).replace("!", "")

    with pytest.raises(ConfigError, match="does not give this reply back"):
        llm_pieces(Lossy(), "Hi!")


def test_a_token_inside_a_character_waits_for_the_next() -> None:
    class Bytes(CharTokenizer):
        def encode(self, text: str) -> list[int]:
            return list(text.encode())

        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode(errors="replace")

    assert llm_pieces(Bytes(), "né") == ["n", "", "é"]


def test_sentences_are_cut_as_a_text_stream_cuts_them() -> None:
    q = SentenceQueue()
    for piece in ["The valve is at 3", ".5 bar", ". Check", " it now", "! And then", " stop"]:
        q.feed(piece)
    q.close()
    got = []
    while (s := q.get()) is not None:
        got.append(s)
    assert got == ["The valve is at 3.5 bar.", " Check it now!", " And then stop"]


def _row(first: float, stalls: int = 0, mode: str = "interleaved", passages: int = 2) -> dict:
    return {"first_audio_s": first, "stream_rtf": 0.8, "audio_s": 9.0, "stalls": stalls, "stall_s": 0.1 * stalls,
            "stalls_while_writing": stalls, "mode": mode, "passages": passages}  # fmt: skip


def test_summary_takes_medians_and_the_worst_stalls_and_the_report_prints_it() -> None:
    rows = {
        "text_stream": [_row(0.5, 0), _row(0.7, 2), _row(0.6, 1)],
        "by_sentence": [_row(1.8, 0, "sentence", 3), _row(1.9, 1, "sentence", 3), _row(2.0, 0, "sentence", 3)],
    }
    ts = summarize(rows, family="CosyVoice2-0.5B", rate=20.0, speech_ratio=3.0, sentence_tokens=[25, 24, 25],
                   writing_s=3.7, voice_tokens=75)  # fmt: skip
    assert ts["text_stream"]["first_audio_s"] == 0.6 and ts["text_stream"]["stalls"] == 2
    assert ts["by_sentence"]["first_audio_s"] == 1.9 and ts["first_audio_ratio"] == pytest.approx(1.9 / 0.6)
    rows_ = {m: (a, b) for m, a, b in text_stream_rows(ts)}
    assert rows_["first audio after the first text piece"] == ("0.60 s", "1.90 s")
    assert rows_["first audio, sentence by sentence / text stream"][0] == "3.17×"
    assert rows_["stalls after the first chunk (worst run): count, seconds"][0].startswith("2, 0.20 s (2 while")
    assert rows_["how it is spoken"][0] == "interleaved LM (bistream)"
    assert rows_["LM requests (passages / sentences)"] == ("2", "3")
    machine = {"cpu": "AMD EPYC", "isa": "avx512", "usable_cores": 2, "memory_gb": 23, "threads": 2,
               "onnxruntime": "1.x", "load_avg_before": [0.5, 0.5, 0.5]}  # fmt: skip
    md = markdown({"model": "m", "machine": machine, "text_stream": ts}, [])
    assert "### Text that is still being written (CosyVoice2-0.5B)" in md
    assert "3 sentences (25, 24, 25 text tokens) at 20 text tokens/s" in md and "| 0.60 s | 1.90 s |" in md
    v1 = summarize({k: [_row(1.0, 0, "sentence", 3)] for k in rows}, family="CosyVoice-300M", rate=20.0,
                   speech_ratio=3.0, sentence_tokens=[25], writing_s=1.2)  # fmt: skip
    assert text_stream_rows(v1)[0][1] == "sentence mode (no interleaved LM)"
    with pytest.raises(ConfigError, match="no timed run"):
        summarize({"text_stream": [], "by_sentence": rows["by_sentence"]})


def test_forced_token_ratio_is_validated_and_sets_the_budget() -> None:
    assert SynthesisConfig(forced_token_ratio=3.0).validate().token_budget(25) == (75, 75)
    assert SynthesisConfig(forced_token_ratio=0.5).validate().token_budget(1) == (1, 1)
    assert SynthesisConfig(min_tokens=5, max_tokens=9).validate().token_budget(25) == (5, 9)
    with pytest.raises(ConfigError, match="forced_token_ratio"):
        SynthesisConfig(forced_token_ratio=30.0).validate()
    with pytest.raises(ConfigError, match="unset when min_tokens"):
        SynthesisConfig(forced_token_ratio=3.0, max_tokens=10).validate()
    with pytest.raises(ConfigError, match="must be a number"):
        SynthesisConfig(forced_token_ratio="3").validate()
