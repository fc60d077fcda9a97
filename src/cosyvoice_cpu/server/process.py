"""``cosyvoice-cpu serve`` in a child process on a free loopback port, ready when ``/health`` answers.

What the load scripts (``bench/server_load.py``) and the server tests use to run a real server; standard library
only, so it works wherever the ``[server]`` extra does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


# Below the kernel's ephemeral range, and above the worker ports `ray start` gives by default (10002-19999); a local
# `ray.init()` lets its workers and its other services listen on ephemeral or higher ports.
_FIRST_PORT = 20000
_MIN_PORTS = 1000  # fewer ports than this between _FIRST_PORT and the ephemeral range: port 0 instead
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (32768 when it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's ephemeral range.

    Port 0 would give an ephemeral port: the range every outgoing connection's local end is drawn from, so a child that
    opens many connections before it listens (``serve --replicas`` starts Ray's processes, all talking gRPC) can be
    handed the same port first and then fail to bind it. A random free port between 20000 and the ephemeral range
    avoids that; port 0 (an ephemeral port) only when that range is under 1000 ports or 50 tries found none free.
    """
    low = _ephemeral_low()
    rng = random.Random()  # noqa: S311 - a port number, not a secret
    if low - _FIRST_PORT >= _MIN_PORTS:
        for port in rng.sample(range(_FIRST_PORT, low), 50):
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running ``serve`` child: its base URL, process and log file (None: output discarded)."""

    url: str
    proc: subprocess.Popen
    log: Path | None

    @classmethod
    def start(
        cls, model: Path, voices: Path, *extra: str, log: Path | None = None, timeout: float = 60.0
    ) -> ServerProcess:
        """Start ``python -m cosyvoice_cpu serve -m model --voices voices --port P *extra`` and wait for it.

        Raises:
            RuntimeError: the server exited, or did not answer ``/health`` within ``timeout`` seconds (the
                message ends with the log's last 3000 characters when there is a log).
        """
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "cosyvoice_cpu",
            "serve",
            "-m",
            str(model),
            "--voices",
            str(voices),
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with contextlib.ExitStack() as files:  # the child keeps its own copy of the log's descriptor
            out = files.enter_context(log.open("ab")) if log is not None else subprocess.DEVNULL
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        server = cls(f"http://127.0.0.1:{port}", proc, log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}{server._tail()}")
            if server.healthy():
                return server
            time.sleep(0.2)
        server.stop(signal.SIGKILL)
        raise RuntimeError(f"the server did not come up in {timeout:.0f} s{server._tail()}")

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 within 2 s."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # noqa: S310 (our http://127.0.0.1)
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` and wait (30 s, then SIGKILL); nothing if the process already ended."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                logger.warning("server %s ignored signal %d for 30 s; killing it", self.url, sig)
                self.proc.kill()
                self.proc.wait(10)

    def _tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return ":\n" + self.log.read_text(errors="replace")[-3000:]
