"""The child-process server helper: ready only when /health answers, stops cleanly, reports a failed start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.server import process
from cosyvoice_cpu.server.process import ServerProcess, free_port


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match=r"(?s)the server exited with [1-9].*no-such-model"):
        ServerProcess.start(tmp_path / "no-such-model", tmp_path / "voices", log=log, timeout=60)


def test_start_waits_for_health_and_stop_ends_the_process(tmp_path: Path) -> None:
    server = ServerProcess.start(DEMO_MODEL, tmp_path / "voices", "--threads", "1")
    try:
        assert server.healthy() and server.proc.poll() is None
    finally:
        server.stop()
    assert server.proc.poll() is not None and not server.healthy()
    server.stop()  # a second stop is a no-op


def test_free_ports_are_free_and_outside_the_ephemeral_range() -> None:
    """A port from the kernel's ephemeral range can be taken by any outgoing connection before the child binds it
    (a Ray Serve proxy once failed to bind one in CI)."""
    low = _ephemeral_low_or_skip()
    ports = {free_port() for _ in range(20)}
    assert all(process._FIRST_PORT <= p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    low = _ephemeral_low_or_skip()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        free = next(p for p in range(process._FIRST_PORT, low) if process._bindable(p))
        monkeypatch.setattr(process.random.Random, "sample", lambda self, r, k: [taken, free])
        assert free_port() == free  # the taken one tried first and passed over


def _ephemeral_low_or_skip() -> int:
    """The ephemeral range's first port, or a skip where free_port falls back to port 0 (too few ports below it)."""
    low = process._ephemeral_low()
    if low - process._FIRST_PORT < process._MIN_PORTS:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: free_port falls back to port 0 here")
    return low
