"""The speech API through a real server process on loopback: parity with the library, formats, voices,
concurrency, bad input (4xx with a JSON message, the server keeps serving), limits, auth, cancellation."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.voices.voice import Voice

from .conftest import VOICE, Server, add_voice, gauge, prompt_cache_bytes, start_server

TEXT = "Warning: line three is overheating. Check the pump."


def speak(c: httpx.Client, **fields: object) -> httpx.Response:
    body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm", "seed": 7, **fields}
    return c.post("/v1/audio/speech", json=body)


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


@pytest.fixture(scope="module")
def library(server: Server) -> tuple[Engine, Voice]:
    """Our library on the same model and the voice the server saved (the file it wrote)."""
    return Engine.load(DEMO_MODEL, EngineConfig(threads=2)), Voice.load(server.voices / f"{VOICE}.npz")


@pytest.mark.parametrize("stream", [True, False])
def test_api_audio_equals_library_audio_for_the_same_seed(server: Server, library, stream: bool) -> None:
    engine, voice = library
    want = engine.synthesize_wav(TEXT, voice, SynthesisConfig(seed=7, stream=stream))
    want16 = (np.clip(want, -1, 1) * 32767).round().astype(np.int16)
    with server.client() as c:
        r = speak(c, stream=stream)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
        assert r.headers["x-sample-rate"] == "24000"
        got = pcm(r.content)
        assert len(got) == len(want16) > 24000
        np.testing.assert_array_equal(got, want16)
        wav = speak(c, stream=stream, response_format="wav")  # the same audio in a wav container
        data, rate = sf.read(io.BytesIO(wav.content), dtype="int16")
        assert rate == 24000
        np.testing.assert_array_equal(data, want16)


def test_sse_carries_the_same_audio(server: Server) -> None:
    with server.client() as c:
        plain = pcm(speak(c).content)
        r = speak(c, stream_format="sse")
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"] and len(events) > 2
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    np.testing.assert_array_equal(pcm(audio), plain)
    assert events[-1]["usage"]["output_audio_seconds"] == pytest.approx(len(plain) / 24000, abs=1e-3)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "wav"])
def test_compressed_formats_decode_to_the_speech(server: Server, fmt: str) -> None:
    with server.client() as c:
        n = len(pcm(speak(c).content))
        r = speak(c, response_format=fmt)
    assert r.status_code == 200
    magic = {"mp3": (b"\xff", b"ID3"), "opus": (b"OggS",), "flac": (b"fLaC",), "wav": (b"RIFF",)}[fmt]
    assert r.content.startswith(magic)
    if fmt == "flac":  # streamed FLAC has an unknown total length, which sf.read refuses; read in blocks
        with sf.SoundFile(io.BytesIO(r.content)) as f:
            blocks = []
            try:
                for block in f.blocks(4096, dtype="int16"):
                    blocks.append(block)
            except RuntimeError:
                pass  # libsndfile's seek past the end of an unknown-length stream, after the last block
        data = np.concatenate(blocks)
    else:
        data, rate = sf.read(io.BytesIO(r.content), dtype="int16")
        assert rate == 24000
    # lossy codecs add encoder delay and frame padding (mp3 up to ~2300 samples); opus/flac/wav are exact
    assert abs(len(data) - n) <= (2400 if fmt == "mp3" else 4096 if fmt == "flac" else 2)


def test_models_health_and_metrics(server: Server) -> None:
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "demo_model" and models["data"][0]["family"] == "cosyvoice2"
        health = c.get("/health").json()
        assert health["status"] == "ok" and health["voices"] >= 1 and health["rss_mb"] > 50
        assert speak(c, input="Hello.").status_code == 200
        text = c.get("/metrics").text
    for name in ("cosyvoice_requests_total", "cosyvoice_time_to_first_audio_seconds_bucket", "cosyvoice_rtf_count",
                 "cosyvoice_queue_wait_seconds_sum", "cosyvoice_lm_tokens_per_second",
                 "cosyvoice_lm_batch_steps_total", "cosyvoice_process_resident_memory_bytes"):  # fmt: skip
        assert name in text, name
    assert gauge(text, "cosyvoice_process_malloc_free_bytes") > 0  # glibc's heaps hold some free memory
    with server.client() as c:  # idle now: the server trims its heaps a second later
        deadline = time.monotonic() + 20
        while gauge(c.get("/metrics").text, "cosyvoice_heap_trims_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gauge(c.get("/metrics").text, "cosyvoice_heap_trims_total") >= 1
    ok = re.search(r'cosyvoice_requests_total\{endpoint="/v1/audio/speech",outcome="ok"\} (\d+)', text)
    assert ok and int(ok.group(1)) >= 1
    assert gauge(text, "cosyvoice_prompt_cache_bytes") > 0  # the streamed request kept its voice's cache


def test_a_server_that_keeps_no_voice_cache_says_the_same(server: Server, tmp_path: Path) -> None:
    """``--prompt-cache-mb 0`` (an edge box short of memory): each streamed request builds its voice's flow cache
    again and keeps none, and speaks the samples a server with the cache speaks (same voice file, same seed)."""
    lean = start_server(server.voices, tmp_path / "log", "--prompt-cache-mb", "0")
    try:
        with lean.client() as c, server.client() as kept:
            for _ in range(2):  # the second request would hit a kept cache
                r = speak(c, input="Hello there.")
                assert r.status_code == 200, r.text
            assert prompt_cache_bytes(c) == 0
            assert pcm(r.content).size > 0 and r.content == speak(kept, input="Hello there.").content
    finally:
        lean.stop()


def test_the_servers_step_count_is_what_a_request_without_one_gets(server: Server, tmp_path: Path) -> None:
    """``serve --flow-steps 3``: a request that names no ``flow_steps`` speaks what ``flow_steps: 3`` speaks on the
    default server (same voice file, same seed), not its 10-step audio; a request's own count still wins."""
    fast = start_server(server.voices, tmp_path / "log", "--flow-steps", "3")
    try:
        with fast.client() as c, server.client() as default:
            got = speak(c, stream=False)
            assert got.status_code == 200, got.text
            assert got.content == speak(default, stream=False, flow_steps=3).content
            assert got.content != speak(default, stream=False).content
            assert speak(c, stream=False, flow_steps=10).content == speak(default, stream=False).content
            assert c.get("/health").json()["flow_steps"] == 3 and default.get("/health").json()["flow_steps"] == 10
    finally:
        fast.stop()


def _expect_error(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    message = r.json()["error"]["message"]
    assert re.search(words, message, re.IGNORECASE), message


def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server: Server) -> None:
    with server.client() as c:
        _expect_error(speak(c, input=""), 400, "empty")
        _expect_error(speak(c, input="   "), 400, "empty")
        _expect_error(speak(c, input="a" * (1 << 20)), 400, "1048576 characters.*at most 4096")
        _expect_error(c.post("/v1/audio/speech", content=b'{"input": "hi",', headers={"content-type":
                      "application/json"}), 400, "not valid JSON")  # fmt: skip
        _expect_error(speak(c, voice="nobody"), 400, "no voice named 'nobody'.*demo")
        _expect_error(speak(c, response_format="aac"), 400, "unsupported.*mp3")
        _expect_error(speak(c, response_format="ogg-vorbis"), 400, "unsupported")
        _expect_error(speak(c, speed=-1), 400, "speed.*0.5 to 2.0")
        _expect_error(speak(c, speed=1e9), 400, "speed.*0.5 to 2.0")
        _expect_error(speak(c, flow_steps=0), 400, "flow_steps")
        _expect_error(speak(c, seed=-3), 400, "seed")
        _expect_error(speak(c, model="whisper-1"), 400, "unknown model")
        _expect_error(speak(c, colour="red"), 400, "colour.*not permitted")
        _expect_error(speak(c, input=12), 400, "input")
        _expect_error(speak(c, voice="../../etc/passwd"), 400, "no voice named")
        _expect_error(add_voice(c, name="../evil"), 400, "not allowed")
        _expect_error(add_voice(c, name="a/b"), 400, "not allowed")
        _expect_error(c.delete("/v1/audio/voices/..%2F..%2Fdemo"), 404, "no voice|no endpoint")
        _expect_error(c.post("/v1/audio/voices", files={"file": ("x.wav", b"this is not audio", "audio/wav")},
                             data={"name": "junk"}), 400, "cannot decode")  # fmt: skip
        _expect_error(c.post("/v1/audio/voices", files={"file": ("x.wav", _tone_wav(0.2), "audio/wav")},
                             data={"name": "short"}), 400, "short|at least")  # fmt: skip
        _expect_error(c.post("/v1/audio/voices", data={"name": "nofile"}), 400, "file")
        assert [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]] == [VOICE]  # no junk saved
        assert speak(c, input="Still here.").status_code == 200


def test_a_100_mb_upload_is_refused_before_it_is_read(server: Server) -> None:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    body_size = 100 * 2**20
    head = (f"POST /v1/audio/voices HTTP/1.1\r\nHost: {host}\r\nContent-Length: {body_size}\r\n"
            "Content-Type: multipart/form-data; boundary=xyz\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + b"\0" * 65536)  # a little of the body; the answer must not wait for the rest
        reply = ""
        while "over the limit" not in reply and (part := s.recv(65536)):
            reply += part.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413") and "over the limit of 20 MB" in reply
    with server.client() as c:
        assert c.get("/health").json()["status"] == "ok"


def test_voice_lifecycle(server: Server) -> None:
    with server.client() as c:
        assert add_voice(c, name="Temp voice 1", text="").status_code == 201  # cross-lingual: no transcript
        _expect_error(add_voice(c, name="Temp voice 1"), 409, "exists")
        assert add_voice(c, name="Temp voice 1", overwrite="true").status_code == 201
        voices = {v["name"]: v for v in c.get("/v1/audio/voices").json()["voices"]}
        assert voices["Temp voice 1"]["mode"] == "zero-shot" and voices[VOICE]["duration_s"] == 3.0
        assert speak(c, voice="Temp voice 1", input="Hi.").status_code == 200
        assert c.delete("/v1/audio/voices/Temp voice 1").status_code == 204
        _expect_error(c.delete("/v1/audio/voices/Temp voice 1"), 404, "no voice")
        _expect_error(speak(c, voice="Temp voice 1"), 400, "no voice")
    assert not (server.voices / "Temp voice 1.npz").exists()


def test_16_concurrent_streams_all_complete_with_early_first_chunks(server: Server) -> None:
    results: dict[int, tuple[int, float, float, int]] = {}
    start = time.perf_counter()

    def one(i: int) -> None:
        with server.client() as c:
            body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm", "seed": i}
            with c.stream("POST", "/v1/audio/speech", json=body) as r:
                first, n = None, 0
                for part in r.iter_bytes():
                    first = first or time.perf_counter() - start
                    n += len(part)
                results[i] = (r.status_code, first or 0.0, time.perf_counter() - start, n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(16))
    assert all(status == 200 and n > 48000 for status, _, _, n in results.values()), results
    last_finish = max(done for _, _, done, _ in results.values())
    assert all(first < last_finish for _, first, _, _ in results.values())
    with server.client() as c:
        steps = re.findall(r'cosyvoice_lm_batch_steps_total\{rows="(\d+)"\} (\d+)', c.get("/metrics").text)
    assert max(int(rows) for rows, _ in steps) >= 4  # streams really shared LM steps


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory):
    """A server with an API key, one worker, a queue of one and a 2 s timeout."""
    root = tmp_path_factory.mktemp("strict")
    srv = start_server(root / "voices", root / "log", "--api-key", "s3cret", "--max-active", "1",
                       "--max-queue", "1", "--timeout", "2")  # fmt: skip
    with srv.client(headers={"Authorization": "Bearer s3cret"}) as c:
        assert add_voice(c).status_code == 201
    yield srv
    srv.stop()


def test_api_key_is_required(strict: Server) -> None:
    host, port = strict.url.rsplit("//", 1)[1].split(":")
    for forged in ("x?", "x#", "x/.."):  # a Host header must not change the path the key check sees
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {forged}\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while part := s.recv(65536):
                reply += part
        assert reply.split(b" ")[1] in (b"400", b"401", b"403"), reply[:80]  # 403: a host name not served
    with strict.client() as c:
        _expect_error(speak(c), 401, "API key")
        _expect_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "API key")
        _expect_error(c.get("/metrics"), 401, "API key")
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for junk in ("/v1/%22oops", "/v1/a/b/c/d", "/v1/\u00e9t\u00e9"):  # unbounded paths, one bounded label
            assert c.get(junk).status_code == 401
        metrics = c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
    labels = set(re.findall(r'endpoint="([^"]*)"', metrics))
    assert labels <= {"/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/health", "/metrics", "/", "other"}
    assert "other" in labels


def test_options_needs_the_key_like_every_method(strict: Server) -> None:
    """docs/server.md said OPTIONS answers 204 with Allow on any path; with --api-key, /v1/* and /metrics answer
    it only with the key (nothing under the key is reached by a method without it)."""
    with strict.client() as c:
        r = c.options("/v1/audio/speech")
        _expect_error(r, 401, "API key")
        assert "allow" not in r.headers
        r = c.options("/v1/audio/speech", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 204 and r.headers["allow"] == "OPTIONS, POST"
        r = c.options("/health")  # open paths stay open
        assert r.status_code == 204 and r.headers["allow"] == "GET, OPTIONS"


def test_a_full_queue_answers_429_with_retry_after(strict: Server) -> None:
    codes: list[httpx.Response] = []
    long = " ".join(["The pump on line three is overheating."] * 3)

    def one() -> None:
        with strict.client(headers={"Authorization": "Bearer s3cret"}) as c:
            try:
                codes.append(speak(c, input=long))
            except httpx.RemoteProtocolError:  # admitted, then cut by the 2 s timeout on a slow machine
                codes.append(httpx.Response(200))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    rejected = [r for r in codes if r.status_code == 429]
    assert len(codes) == 5 and rejected and all(int(r.headers["retry-after"]) > 0 for r in rejected)
    assert "busy" in rejected[0].json()["error"]["message"]
    assert any(r.status_code == 200 for r in codes)


def test_timeout_stops_a_long_synthesis(strict: Server) -> None:
    text = " ".join(f"Sentence number {i} tells the operator about the state of pump {i}." for i in range(40))
    with strict.client(headers={"Authorization": "Bearer s3cret"}) as c:
        t0 = time.perf_counter()
        r = speak(c, input=text, stream_format="sse")
        elapsed = time.perf_counter() - t0
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1]["type"] == "error" and events[-1]["error"]["type"] == "timeout"
        assert elapsed < 10  # 40 sentences take far longer than the 2 s timeout
        metrics = c.get("/metrics").text
    assert 'outcome="timeout"' in metrics


def test_a_client_that_disconnects_cancels_its_work(server: Server) -> None:
    text = " ".join(f"Sentence number {i} tells the operator about the state of pump {i}." for i in range(60))
    with server.client() as c:
        body = {"model": "tts-1", "input": text, "voice": VOICE, "response_format": "pcm"}
        with c.stream("POST", "/v1/audio/speech", json=body) as r:
            next(r.iter_bytes())  # audio is flowing; now hang up
        t0 = time.perf_counter()
        while c.get("/health").json()["active"] and time.perf_counter() - t0 < 10:
            time.sleep(0.05)
        assert c.get("/health").json()["active"] == 0 and time.perf_counter() - t0 < 5
        assert 'outcome="cancelled"' in c.get("/metrics").text


def test_web_page_is_served(server: Server) -> None:
    with server.client() as c:
        r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and "<title>" in r.text


def test_saved_voices_survive_a_restart(server: Server, tmp_path: Path) -> None:
    again = start_server(server.voices, tmp_path / "log")
    try:
        with again.client() as c:
            assert VOICE in [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]]
            assert speak(c, input="Back again.").status_code == 200
    finally:
        again.stop()


def test_clients_that_hang_up_at_once_leave_no_work_behind(server: Server) -> None:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    body = json.dumps({"model": "tts-1", "input": TEXT * 4, "voice": VOICE, "response_format": "wav"}).encode()
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    for _ in range(6):  # gone before the status line: the response body is never read
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head + body)
    with server.client() as c:
        t0 = time.perf_counter()
        while (h := c.get("/health").json())["active"] + h["queued"] and time.perf_counter() - t0 < 30:
            time.sleep(0.1)
        assert h["active"] == 0 and h["queued"] == 0
        assert speak(c, input="Still serving.").status_code == 200
