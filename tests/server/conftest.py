"""A real ``cosyvoice-cpu serve`` process on loopback, on the packaged demo model, with one saved voice."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.server.process import ServerProcess

VOICE = "demo"
PROMPT_TEXT = "Good morning everyone."


@dataclass
class Server(ServerProcess):
    """A running server (:class:`ServerProcess`) with its voices directory."""

    voices: Path = field(kw_only=True)

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


def start_server(voices: Path, log: Path, *extra: str, model: Path = DEMO_MODEL) -> Server:
    """Start ``cosyvoice-cpu serve`` (2 threads) and wait until /health answers (raises with the log if it dies)."""
    proc = ServerProcess.start(model, voices, "--threads", "2", *extra, log=log)
    return Server(proc.url, proc.proc, proc.log, voices=voices)


def add_voice(client: httpx.Client, name: str = VOICE, text: str = PROMPT_TEXT, **data: str) -> httpx.Response:
    return client.post("/v1/audio/voices", files={"file": ("prompt.wav", _tone_wav(), "audio/wav")},
                       data={"name": name, "prompt_text": text, **data})  # fmt: skip


def gauge(metrics: str, name: str) -> float:
    """The value of gauge ``name`` in a ``/metrics`` text (asserted to be there)."""
    found = re.search(rf"^{name} (\S+)$", metrics, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def prompt_cache_bytes(client: httpx.Client) -> float:
    """What the server's voice streaming caches hold now (``cosyvoice_prompt_cache_bytes``)."""
    return gauge(client.get("/metrics").text, "cosyvoice_prompt_cache_bytes")


def start_with_voice(root: Path, *extra: str) -> Server:
    """A server with ``extra`` flags and the voice ``demo`` saved."""
    srv = start_server(root / "voices", root / "server.log", *extra)
    with srv.client() as c:
        r = add_voice(c)
        assert r.status_code == 201, r.text
    return srv


@pytest.fixture(scope="session")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with the options of issue #28: OpenAI voice names speak ``demo``, a page of http://app.example may
    send writes (with CORS), and the Host name tts.example is served besides the bind address."""
    srv = start_with_voice(tmp_path_factory.mktemp("tuned"), "--default-voice", VOICE, "--allow-origin",
                           "http://app.example", "--allow-host", "tts.example")  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module-independent API tests (8 at once, queue 32), with voice ``demo``."""
    root = tmp_path_factory.mktemp("server")
    srv = start_server(root / "voices", root / "server.log", "--max-active", "8")
    try:
        with srv.client() as c:
            r = add_voice(c)
            assert r.status_code == 201, r.text
        yield srv
    finally:
        srv.stop()


@dataclass
class WyomingServer:
    """``serve --wyoming``: the HTTP server (with voice ``demo``) and its Wyoming port on loopback."""

    http: Server
    port: int


WYOMING_FLAGS = "--max-active 2 --max-queue 2 --max-input-chars 300 --samples-per-chunk 512 --idle-timeout 2".split()


@pytest.fixture(scope="session")
def wyoming_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WyomingServer]:
    """One ``serve --wyoming`` process for the Wyoming tests: 2 syntheses at once and 2 waiting (both protocols),
    at most 300 characters a request, 512-sample audio chunks, connections idle for 2 s closed."""
    pytest.importorskip("wyoming")
    from cosyvoice_cpu.server.process import free_port

    port = free_port()
    srv = start_with_voice(tmp_path_factory.mktemp("wyoming"), "--wyoming", f"tcp://127.0.0.1:{port}", *WYOMING_FLAGS)
    try:
        yield WyomingServer(srv, port)
    finally:
        srv.stop()
