"""The audio one request may produce (issue #35): a 4,096-character input ran to 1,615 s of audio (a 77.5 MB WAV
held in memory) because a model that does not stop ran on to the engine's per-sentence cap. Now each request is
stopped at ``10 s + --max-audio-per-char`` per input character (divided by the speed), at most
``--max-audio-seconds``: a whole file gets a 422 ``audio_too_long`` that says so, a stream ends without its last
chunk (SSE: an error event), and the request's slot is free again. The packaged demo model has random weights:
it speaks ~15 s for the sentence below, so a 3 s bound always cuts it."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from cosyvoice_cpu.server.speech import AudioBound

from .conftest import VOICE, Server, start_with_voice

MAX_S = 3.0
SENTENCE = "Warning: line three is overheating. Check the pump."


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_with_voice(tmp_path_factory.mktemp("bound"), "--max-audio-seconds", str(MAX_S))
    try:
        yield srv
    finally:
        srv.stop()


def speech(**extra: object) -> dict[str, object]:
    return {"model": "tts-1", "voice": VOICE, "input": SENTENCE, "response_format": "pcm", "seed": 3, **extra}


def test_a_whole_file_past_the_bound_is_a_422_that_says_why(bounded: Server) -> None:
    with bounded.client() as c:
        t0 = time.monotonic()
        r = c.post("/v1/audio/speech", json=speech(stream=False))
        took = time.monotonic() - t0
        assert r.status_code == 422, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["code"] == "audio_too_long", error
        for words in (f"limit of {MAX_S:g} s of audio for {len(SENTENCE)} characters", "--max-audio-seconds",
                      "--max-audio-per-char", "split it into shorter requests"):  # fmt: skip
            assert words in error["message"], error["message"]
        assert took < 30, took  # stopped at the bound, not at the engine's own cap
        short = c.post("/v1/audio/speech", json=speech(input="Hi.", stream=False))
        assert short.status_code == 200 and len(short.content) <= MAX_S * 24000 * 2
        health = c.get("/health").json()
        assert health["active"] == 0 and health["status"] == "ok"
        assert 'outcome="error"' not in c.get("/metrics").text


def test_a_stream_past_the_bound_ends_without_its_last_chunk(bounded: Server) -> None:
    with bounded.client() as c:
        got = b""
        with pytest.raises(httpx.RemoteProtocolError):  # cut: truncated audio never passes for complete audio
            with c.stream("POST", "/v1/audio/speech", json=speech()) as r:
                assert r.status_code == 200
                for chunk in r.iter_bytes():
                    got += chunk
        assert 0 < len(got) <= MAX_S * 24000 * 2, len(got)
        events = []
        with c.stream("POST", "/v1/audio/speech", json=speech(stream_format="sse")) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        audio = sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta")
        assert 0 < audio <= MAX_S * 24000 * 2
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "audio_too_long", events[-1]
        assert "--max-audio-seconds" in events[-1]["error"]["message"]


def test_the_bound_per_character_and_speed() -> None:
    bound = AudioBound(per_char_s=0.6, max_s=1200.0)
    assert bound.seconds(100) == pytest.approx(70.0)  # 10 s + 0.6 s x 100
    assert bound.seconds(100, speed=0.5) == pytest.approx(130.0)  # slower speech is longer
    assert bound.seconds(4096) == 1200.0  # at most --max-audio-seconds
    assert "at speed 0.5" in bound.problem(100, 0.5) and "130 s of audio for 100 characters" in bound.problem(100, 0.5)
