"""The child-process server helper: ready only when /health answers, stops cleanly, reports a failed start."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.server.process import ServerProcess


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
