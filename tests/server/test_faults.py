"""Faults: a synthesis that raises hurts no neighbour; ``kill -9`` during voice uploads loses no saved voice and
leaves no corrupt one; the voice store skips what it cannot serve."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.server.process import free_port
from cosyvoice_cpu.voices.voice import Voice

from .conftest import PROMPT_TEXT, VOICE, add_voice, start_server

TEXT = "Warning: line three is overheating. Check the pump."


class FaultyEngine:
    """The real engine, except that inputs containing EXPLODE-EARLY fail before any audio and EXPLODE-LATE after
    the first chunk (as a bug deep in a stage would)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def synthesize(self, text: str, voice: Voice, config: SynthesisConfig | None = None, instruct: str | None = None,
                   timings: Any = None, check: Any = None) -> Iterator[Any]:  # fmt: skip
        if "EXPLODE-EARLY" in text:
            raise RuntimeError("injected failure before audio")
        chunks = self.engine.synthesize(text, voice, config, instruct, timings, check)
        if "EXPLODE-LATE" not in text:
            return chunks

        def late() -> Iterator[Any]:
            yield next(chunks)
            raise RuntimeError("injected failure in the middle of the stream")

        return late()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine, Voice]]:
    """create_app on the faulty engine, served by uvicorn in a thread on loopback."""
    import uvicorn

    from cosyvoice_cpu.server.app import ServerSettings, create_app

    engine = Engine.load(DEMO_MODEL, EngineConfig(threads=2, lm_batch_rows=4))
    voices = tmp_path_factory.mktemp("faulty-voices")
    voice = engine.make_voice(_tone_wav(), PROMPT_TEXT, name=VOICE)
    voice.save(voices / f"{VOICE}.npz")
    app = create_app(FaultyEngine(engine), ServerSettings(voices_dir=voices, max_active=4))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield url, engine, voice
    server.should_exit = True
    thread.join(10)
    engine.close()


def test_a_failing_synthesis_does_not_hurt_its_neighbours(faulty: tuple[str, Engine, Voice]) -> None:
    url, engine, voice = faulty
    want = np.clip(engine.synthesize_wav(TEXT, voice, SynthesisConfig(seed=3, stream=True)), -1, 1) * 32767
    want16 = want.round().astype(np.int16)
    cases = {"good-1": TEXT, "early": "EXPLODE-EARLY " + TEXT, "good-2": TEXT, "late": "EXPLODE-LATE " + TEXT,
             "late-sse": "EXPLODE-LATE " + TEXT, "late-whole": "EXPLODE-LATE " + TEXT}  # fmt: skip
    out: dict[str, httpx.Response | Exception] = {}

    def send(key: str) -> None:
        body = {"model": "tts-1", "input": cases[key], "voice": VOICE, "response_format": "pcm", "seed": 3}
        if key == "late-sse":
            body["stream_format"] = "sse"
        if key == "late-whole":  # sent whole at the end: a late failure is still a proper 500
            body["stream"] = False
        with httpx.Client(base_url=url, timeout=120) as c:
            try:
                out[key] = c.post("/v1/audio/speech", json=body)
            except httpx.HTTPError as e:  # a stream cut after its status line
                out[key] = e

    threads = [threading.Thread(target=send, args=(k,)) for k in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for key in ("good-1", "good-2"):  # the neighbours got exactly their audio
        assert out[key].status_code == 200
        np.testing.assert_array_equal(np.frombuffer(out[key].content, "<i2"), want16)
    early = out["early"]
    assert early.status_code == 500 and "synthesis failed (RuntimeError)" in early.json()["error"]["message"]
    # after the status line, a failure cuts the connection: the client sees a truncated body, not a clean end
    assert isinstance(out["late"], httpx.RemoteProtocolError), out["late"]
    events = [json.loads(x[6:]) for x in out["late-sse"].text.splitlines() if x.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error"
    whole = out["late-whole"]
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "synthesis_failed"
    with httpx.Client(base_url=url, timeout=120) as c:
        again = c.post("/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": VOICE,
                                                 "response_format": "pcm", "seed": 3})  # fmt: skip
        np.testing.assert_array_equal(np.frombuffer(again.content, "<i2"), want16)
        metrics = c.get("/metrics").text
    counts = dict(re.findall(r'cosyvoice_requests_total\{endpoint="/v1/audio/speech",outcome="(\w+)"\} (\d+)', metrics))
    assert counts == {"error": "4", "ok": "3"}, counts


def test_kill_9_during_voice_uploads_loses_nothing(tmp_path: Path) -> None:
    voices, log = tmp_path / "voices", tmp_path / "log"
    srv = start_server(voices, log)
    with srv.client() as c:
        assert add_voice(c, "keeper").status_code == 201
    long_prompt = _tone_wav(10.0)  # a longer prompt: the upload, the voice and its write take longer
    for round_, delay in enumerate((0.05, 0.3, 0.6, 1.0)):
        name = f"victim {round_}"

        def upload(name: str = name, url: str = srv.url) -> None:
            try:
                with httpx.Client(base_url=url, timeout=30) as c:
                    c.post("/v1/audio/voices", files={"file": ("p.wav", long_prompt, "audio/wav")},
                           data={"name": name, "prompt_text": "A long prompt.", "overwrite": "true"})  # fmt: skip
            except httpx.HTTPError:
                pass  # the server died under it

        threads = [threading.Thread(target=upload), threading.Thread(target=upload, kwargs={"name": "keeper"})]
        for t in threads:
            t.start()
        time.sleep(delay)
        srv.stop(signal.SIGKILL)
        for t in threads:
            t.join(30)
        for path in voices.glob("*.npz"):  # every file there is whole (old or new), never half-written
            Voice.load(path)
        srv = start_server(voices, log)
        with srv.client() as c:
            names = [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]]
            assert "keeper" in names
            assert c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Still here.", "voice": "keeper",
                                                    "response_format": "pcm"}).status_code == 200  # fmt: skip
        assert not list(voices.glob(".*.tmp"))  # leftovers of the killed write are cleaned at start
    with srv.client() as c:  # and a prompt too long for the model's KV cache is refused at upload, not at use
        r = c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(25.0), "audio/wav")},
                   data={"name": "too long", "prompt_text": "A long prompt."})  # fmt: skip
    srv.stop()
    assert r.status_code == 400 and "shorter prompt" in r.json()["error"]["message"]


def test_voice_store_skips_what_it_cannot_serve(tmp_path: Path) -> None:
    from cosyvoice_cpu.server.voices import VoiceExistsError, VoiceNotFoundError, VoiceStore

    engine = Engine.load(DEMO_MODEL, EngineConfig(threads=2))
    voice = engine.make_voice(_tone_wav(), PROMPT_TEXT, name="good")
    voice.save(tmp_path / "good.npz")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 not really a zip")
    voice.save(tmp_path / "renamed.npz")  # holds voice 'good' under another file name
    (tmp_path / ".good.npz.abc123.tmp").write_bytes(b"half a write")
    store = VoiceStore(tmp_path, "cosyvoice2", 24000)
    assert store.names() == ["good"] and set(store.skipped) == {"corrupt.npz", "renamed.npz"}
    assert not (tmp_path / ".good.npz.abc123.tmp").exists() and (tmp_path / "corrupt.npz").exists()
    with pytest.raises(VoiceExistsError):
        store.add(voice)
    with pytest.raises(VoiceNotFoundError, match="saved voices: good"):
        store.get("nobody")
    other = VoiceStore(tmp_path, "cosyvoice", 22050)  # another model's server serves none of them
    assert other.names() == [] and "made for cosyvoice2" in other.skipped["good.npz"]
    store.remove("good")
    assert not (tmp_path / "good.npz").exists() and VoiceStore(tmp_path, "cosyvoice2", 24000).names() == []


def test_a_slow_reader_pauses_its_synthesis_and_a_cancel_ends_the_pause() -> None:
    """Job.chunks: the worker runs at most MAX_PENDING_CHUNKS encoded chunks ahead of the reader (no audio piles
    up for a client that does not read), encodes in the worker, and stops waiting once the job is cancelled."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from cosyvoice_cpu.server.speech import MAX_PENDING_CHUNKS, Job

    made: list[int] = []
    encoded_in: set[str] = set()

    def run(check: Any) -> Iterator[Any]:
        for i in range(200):
            check()
            made.append(i)
            yield SimpleNamespace(samples=np.full(10, i, np.float32))

    class Encoder:
        def push(self, samples: np.ndarray) -> bytes:
            encoded_in.add(threading.current_thread().name)
            return bytes([int(samples[0])])

        def finish(self) -> bytes:
            return b"end"

    async def read(pool: ThreadPoolExecutor) -> tuple[list[bytes], Job]:
        job = Job(run, timeout=60)
        chunks = job.chunks(pool, Encoder())
        got = [await chunks.__anext__(), await chunks.__anext__()]
        await asyncio.sleep(0.5)  # a client that stopped reading: unbounded, all 200 chunks would be made by now
        assert len(made) <= len(got) + MAX_PENDING_CHUNKS + 1, len(made)
        await chunks.aclose()  # the client went away: the worker, waiting for room, must see the cancel
        return got, job

    with ThreadPoolExecutor(1, thread_name_prefix="synth") as pool:
        got, job = asyncio.run(read(pool))
        assert got == [b"\x00", b"\x01"] and encoded_in == {"synth_0"}
        assert job.cancel.is_set() and job.future.done() and job.future.exception() is None
        stopped_at = len(made)
        time.sleep(0.3)
        assert len(made) == stopped_at < 200
