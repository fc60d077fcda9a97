"""A real ``cosyvoice-cpu serve`` process on loopback, on the packaged demo model, with one saved voice."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cosyvoice_cpu.cli_speech import DEMO_MODEL, _tone_wav

VOICE = "demo"
PROMPT_TEXT = "Good morning everyone."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running server: its URL, process, voices directory and log file."""

    url: str
    proc: subprocess.Popen
    voices: Path
    log: Path

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(voices: Path, log: Path, *extra: str, model: Path = DEMO_MODEL) -> Server:
    """Start ``cosyvoice-cpu serve`` and wait until /health answers (raises with the log if it dies)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cosyvoice_cpu", "serve", "-m", str(model), "--voices", str(voices),
           "--port", str(port), "--threads", "2", "--log-level", "warning", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, voices, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"the server did not come up in 60 s:\n{log.read_text()[-3000:]}")


def add_voice(client: httpx.Client, name: str = VOICE, text: str = PROMPT_TEXT, **data: str) -> httpx.Response:
    return client.post("/v1/audio/voices", files={"file": ("prompt.wav", _tone_wav(), "audio/wav")},
                       data={"name": name, "prompt_text": text, **data})  # fmt: skip


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
