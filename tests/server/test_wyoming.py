"""The Wyoming server as Home Assistant uses it, through the ``wyoming`` package's own ``AsyncTcpClient``: describe
-> info, one-shot and streamed synthesis, describe within Home Assistant's 1 s while every slot is busy; the HTTP
API on the same engine and voices (``serve --wyoming``); ``cosyvoice-cpu wyoming`` alone on stdio and unix."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wyoming")
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient, AsyncUnixClient
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.facts import facts

from .conftest import PROMPT_TEXT, VOICE, WyomingServer, add_voice, prompt_cache_bytes

RATE = 24000  # the demo model's (CosyVoice2)
TEXT = "Warning: line three is overheating. Check the pump."
LONG = "The pump on line three is running hot, and the cooling water is low. " * 4  # 280 characters: seconds of work


def client(srv: WyomingServer, read_timeout: float = 60.0) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", srv.port, connect_timeout=5, read_timeout=read_timeout)


async def collect(c: Any, until: str) -> list[Event]:
    """Events until one of type ``until`` (included), an ``error`` or the end of the connection."""
    events = []
    while (event := await c.read_event()) is not None:
        events.append(event)
        if event.type in (until, "error"):
            break
    return events


async def describe(srv: WyomingServer) -> tuple[Info, float]:
    async with client(srv) as c:
        t0 = time.perf_counter()
        await c.write_event(Describe().event())
        event = await c.read_event()
        return Info.from_event(event), time.perf_counter() - t0


def test_describe_tells_the_truth(wyoming_server: WyomingServer) -> None:
    info, _ = asyncio.run(describe(wyoming_server))
    (program,) = info.tts
    assert program.name == "cosyvoice-cpu" and program.installed and program.supports_synthesize_streaming
    from cosyvoice_cpu import __version__

    assert program.version == __version__ and "CosyVoice2-0.5B" in program.description
    assert "CosyVoice" in program.attribution.name and program.attribution.url.startswith("https://")
    assert [v.name for v in program.voices] == [VOICE]
    assert program.voices[0].languages == list(facts("cosyvoice2").languages)
    # a voice saved over HTTP is in the next describe: one voice store for both protocols
    with wyoming_server.http.client() as c:
        assert add_voice(c, "second").status_code == 201
    try:
        info, _ = asyncio.run(describe(wyoming_server))
        assert [v.name for v in info.tts[0].voices] == [VOICE, "second"]
    finally:
        with wyoming_server.http.client() as c:
            c.delete("/v1/audio/voices/second")


def test_one_shot_gives_pcm_of_the_model_rate(wyoming_server: WyomingServer) -> None:
    async def run() -> list[Event]:
        async with client(wyoming_server) as c:
            await c.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name=VOICE)).event())
            return await collect(c, "audio-stop")

    events = asyncio.run(run())
    assert events[0].type == "audio-start" and events[-1].type == "audio-stop", [e.type for e in events]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (RATE, 2, 1)
    chunks = [AudioChunk.from_event(e) for e in events[1:-1]]
    assert chunks and all(e.type == "audio-chunk" for e in events[1:-1])
    assert all((c.rate, c.width, c.channels) == (RATE, 2, 1) for c in chunks)
    assert all(0 < c.samples <= 512 for c in chunks)  # --samples-per-chunk 512
    samples = sum(c.samples for c in chunks)
    assert samples > RATE // 2  # some speech
    assert AudioStop.from_event(events[-1]).timestamp == samples * 1000 // RATE
    assert [c.timestamp for c in chunks] == sorted(c.timestamp for c in chunks)


def test_streaming_gives_audio_before_synthesize_stop(wyoming_server: WyomingServer) -> None:
    async def run() -> tuple[list[Event], list[Event]]:
        async with client(wyoming_server) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name=VOICE)).event())
            for piece in ("Warning: line ", "three is hot. ", "Check the"):
                await c.write_event(SynthesizeChunk(text=piece).event())
            before = []  # the first sentence is finished: its audio comes while the text is still open
            while not any(e.type == "audio-chunk" for e in before):
                before.append(await c.read_event())
            await c.write_event(SynthesizeChunk(text=" pump.").event())
            # Home Assistant also sends the whole text as a plain synthesize: ignored while streaming
            await c.write_event(Synthesize(text="Warning: line three is hot. Check the pump.").event())
            await c.write_event(SynthesizeStop().event())
            return before, await collect(c, "synthesize-stopped")

    before, after = asyncio.run(run())
    events = before + after
    kinds = [e.type for e in events]
    assert kinds[0] == "audio-start" and kinds[-1] == "synthesize-stopped", kinds
    assert kinds.count("audio-start") == kinds.count("audio-stop") == 2  # one per sentence, none from `synthesize`
    assert "error" not in kinds
    assert all(AudioChunk.from_event(e).rate == RATE for e in events if e.type == "audio-chunk")


def test_describe_answers_within_a_second_while_every_slot_is_busy(wyoming_server: WyomingServer) -> None:
    async def run() -> tuple[list[float], list[str]]:
        busy = [client(wyoming_server) for _ in range(2)]  # --max-active 2
        for c in busy:
            await c.connect()
            await c.write_event(Synthesize(text=LONG, voice=SynthesizeVoice(name=VOICE)).event())
        for c in busy:  # both running
            assert (await c.read_event()).type == "audio-start"
            assert (await c.read_event()).type == "audio-chunk"
        times = []
        for _ in range(5):
            info, took = await describe(wyoming_server)
            assert info.tts[0].voices
            times.append(took)
        health = await asyncio.to_thread(lambda: wyoming_server.http.client().get("/health").json())
        for c in busy:  # hang up: their work is cancelled
            await c.disconnect()
        return times, [health["active"]]

    times, active = asyncio.run(run())
    assert active == [2]  # the Wyoming syntheses hold the HTTP server's slots: one admission
    assert max(times) < 1.0, times
    _wait_idle(wyoming_server)


def _wait_idle(srv: WyomingServer, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    with srv.http.client() as c:
        while (health := c.get("/health").json())["active"] or health["queued"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.1)


def test_http_and_wyoming_share_the_engine(wyoming_server: WyomingServer) -> None:
    """Speech over HTTP while a Wyoming synthesis runs: both finish, and the LM scheduler (one per engine)
    counted the tokens of both."""
    with wyoming_server.http.client() as c:
        before = _lm_tokens(c.get("/metrics").text)

    async def run() -> tuple[list[Event], int]:
        async with client(wyoming_server) as w:
            await w.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name=VOICE)).event())
            body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm"}
            http = asyncio.to_thread(lambda: wyoming_server.http.client().post("/v1/audio/speech", json=body))
            events, response = await asyncio.gather(collect(w, "audio-stop"), http)
            return events, response.status_code

    events, status = asyncio.run(run())
    assert status == 200 and events[-1].type == "audio-stop"
    with wyoming_server.http.client() as c:
        metrics = c.get("/metrics").text
    assert _lm_tokens(metrics) > before
    assert 'cosyvoice_requests_total{endpoint="wyoming",outcome="ok"}' in metrics


def _lm_tokens(metrics: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("cosyvoice_lm_tokens_total"))
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cosyvoice_cpu.engine import Engine

    path = tmp_path_factory.mktemp("alone-voices")
    with Engine.load(DEMO_MODEL) as engine:
        engine.make_voice(_tone_wav(), PROMPT_TEXT, name=VOICE).save(path / f"{VOICE}.npz")
    return path


def _command(voices: Path, uri: str) -> list[str]:
    args = ["wyoming", "-m", str(DEMO_MODEL), "--voices", str(voices), "--uri", uri, "--threads", "2"]
    return [sys.executable, "-m", "cosyvoice_cpu", *args]


def test_wyoming_alone_on_stdio(voices_dir: Path) -> None:
    """stdin/stdout carry the events (logs go to stderr): describe, then a synthesis; the end of stdin ends it
    after the audio."""
    lines = [
        json.dumps({"type": "describe"}),
        json.dumps({"type": "synthesize", "data": {"text": "Good morning.", "voice": {"name": VOICE}}}),
    ]
    stdin = ("\n".join(lines) + "\n").encode()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(_command(voices_dir, "stdio://"), input=stdin, capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    kinds = _event_types(proc.stdout)
    assert kinds[0] == "info" and kinds[1] == "audio-start" and kinds[-1] == "audio-stop", kinds[:3]


def _event_types(stream: bytes) -> list[str]:
    """The event types of a Wyoming byte stream (header lines; data and payload skipped by their lengths)."""
    kinds, at = [], 0
    while at < len(stream):
        end = stream.index(b"\n", at)
        header = json.loads(stream[at:end])
        kinds.append(header["type"])
        at = end + 1 + header.get("data_length", 0) + header.get("payload_length", 0)
    return kinds


def test_wyoming_alone_on_a_unix_socket(voices_dir: Path, tmp_path: Path) -> None:
    sock = tmp_path / "tts.sock"
    proc = subprocess.Popen(_command(voices_dir, f"unix://{sock}"), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)

        async def run() -> Info:
            async with AsyncUnixClient(sock, connect_timeout=5, read_timeout=30) as c:
                await c.write_event(Describe().event())
                return Info.from_event(await c.read_event())

        assert [v.name for v in asyncio.run(run()).tts[0].voices] == [VOICE]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert not sock.exists()  # removed at the exit


def test_zeroconf_advertises_the_wyoming_service(voices_dir: Path) -> None:
    """``--zeroconf NAME`` registers NAME._wyoming._tcp.local. with the server's address and port: asked over mDNS
    from another zeroconf instance, as Home Assistant's discovery would (skipped where mDNS cannot bind)."""
    pytest.importorskip("zeroconf")
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    from cosyvoice_cpu.server.process import free_port
    from cosyvoice_cpu.server.wyoming import SERVICE_TYPE

    async def lookup(name: str, wait_s: float) -> AsyncServiceInfo | None:
        try:
            zc = AsyncZeroconf()
        except OSError as e:
            pytest.skip(f"mDNS cannot bind here: {e}")
        try:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                info = AsyncServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}")
                if await info.async_request(zc.zeroconf, 1000):
                    return info
            return None
        finally:
            await zc.async_close()

    port, name = free_port(), f"cosyvoice-test-{os.getpid()}"
    command = [*_command(voices_dir, f"tcp://127.0.0.1:{port}"), "--zeroconf", name]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        info = asyncio.run(lookup(name, 60))
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert info is not None, "the service was not advertised"
        assert info.type == SERVICE_TYPE and info.port == port and info.parsed_addresses() == ["127.0.0.1"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_zeroconf_needs_tcp() -> None:
    from cosyvoice_cpu.errors import ConfigError
    from cosyvoice_cpu.server.wyoming import WyomingOptions

    with pytest.raises(ConfigError, match="tcp://"):
        WyomingOptions(uri="unix:///tmp/x.sock", zeroconf="hall").validate()
    with pytest.raises(ConfigError, match="Wyoming URI"):
        WyomingOptions(uri="http://127.0.0.1:10200").validate()


def test_unload_after_releases_the_engine_and_loads_it_on_use(tmp_path: Path) -> None:
    """``serve --wyoming --unload-after 1``: idle, the engine is released (/health says so); a Wyoming request loads
    it again and gets its audio, and so does an HTTP one."""
    from cosyvoice_cpu.server.process import free_port

    from .conftest import start_with_voice

    port = free_port()
    srv = start_with_voice(tmp_path, "--wyoming", f"tcp://127.0.0.1:{port}", "--unload-after", "1")
    try:
        with srv.client() as c:
            deadline = time.monotonic() + 15
            while c.get("/health").json()["engine_loaded"]:
                assert time.monotonic() < deadline, "the idle engine was not released"
                time.sleep(0.1)
            released = c.get("/metrics").text.splitlines()  # the engine's gauges read 0, not missing, while released
            assert {"cosyvoice_prompt_cache_bytes 0", "cosyvoice_lm_rows_active 0"} <= set(released)

            async def speak() -> list[str]:
                async with AsyncTcpClient("127.0.0.1", port, read_timeout=60) as w:
                    await w.write_event(Synthesize(text=TEXT, voice=SynthesizeVoice(name=VOICE)).event())
                    return [e.type for e in await collect(w, "audio-stop")]

            kinds = asyncio.run(speak())
            assert kinds[0] == "audio-start" and kinds[-1] == "audio-stop" and "audio-chunk" in kinds
            assert c.get("/health").json()["engine_loaded"]
            while c.get("/health").json()["engine_loaded"]:  # released again
                assert time.monotonic() < deadline + 30
                time.sleep(0.1)
            body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm"}
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == 200 and len(r.content) > 1000
    finally:
        srv.stop()


def _cache_bytes(srv: WyomingServer) -> float:
    with srv.http.client() as c:
        return prompt_cache_bytes(c)


def test_the_servers_step_count_reaches_wyoming(tmp_path: Path) -> None:
    """``serve --flow-steps 3 --wyoming``: Home Assistant names no step count, so a Wyoming synthesis runs at the
    server's 3. Seen from outside through the voices' streaming caches, kept per solver setting: the Wyoming
    request builds the voice's cache for 3 steps, an HTTP request at 3 steps finds it (no new bytes), one at 10
    builds another."""
    from cosyvoice_cpu.server.process import free_port

    from .conftest import start_with_voice

    port = free_port()
    srv = WyomingServer(start_with_voice(tmp_path, "--flow-steps", "3", "--wyoming", f"tcp://127.0.0.1:{port}"), port)
    try:

        async def speak() -> list[Event]:
            async with client(srv) as w:
                await w.write_event(Synthesize(text="Good morning.", voice=SynthesizeVoice(name=VOICE)).event())
                return await collect(w, "audio-stop")

        assert asyncio.run(speak())[-1].type == "audio-stop"
        built = _cache_bytes(srv)
        assert built > 0
        body = {"model": "tts-1", "input": "Hello.", "voice": VOICE, "response_format": "pcm", "stream": True}
        with srv.http.client() as c:
            assert c.post("/v1/audio/speech", json={**body, "flow_steps": 3}).status_code == 200
            assert _cache_bytes(srv) == built  # the Wyoming request's cache: it ran at 3 steps
            assert c.post("/v1/audio/speech", json={**body, "flow_steps": 10}).status_code == 200
        assert _cache_bytes(srv) > built
    finally:
        srv.http.stop()
