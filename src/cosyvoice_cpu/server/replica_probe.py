"""The processes of a ``serve --replicas`` run on this host: what each one is, its memory, and taking them down.

``cosyvoice-cpu serve --replicas N`` started in a new session (``start_new_session=True``) is the leader of
every process of its local Ray instance: the GCS, the raylet, Ray's agents, Serve's controller and proxy, and
the replicas. The tests and ``bench/replica_scale.py`` use this module to tell them apart (the replicas' memory
vs the control plane's), and to end the whole session should the server not exit on SIGTERM. Linux ``/proc``
only; standard library only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    """One process of the session: pid, role (``replica``, ``driver`` or ``control``), command, memory in MB."""

    pid: int
    role: str
    command: str
    rss_mb: float
    pss_mb: float


def _session_of(pid: int) -> int | None:
    """The session id of a live process (None for a zombie or a process that is gone)."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[3])
    except (OSError, ValueError, IndexError):
        return None


def session_pids(sid: int) -> list[int]:
    """The pids whose session id is ``sid`` (the leader included)."""
    return sorted(int(p.name) for p in PROC.iterdir() if p.name.isdigit() and _session_of(int(p.name)) == sid)


def _memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB; PSS splits pages shared between processes (Ray's shared libraries), so it adds up."""
    rss = pss = 0.0
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return round(rss, 1), round(pss, 1)


def session_processes(sid: int) -> list[Proc]:
    """Every live process of session ``sid`` with its role and memory."""
    out = []
    for pid in session_pids(sid):
        try:
            cmd = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not cmd:  # a kernel thread or a process on its way out
            continue
        role = "driver" if pid == sid else "replica" if "ServeReplica" in cmd else "control"
        rss, pss = _memory_mb(pid)
        out.append(Proc(pid, role, cmd[:120], rss, pss))
    return out


def memory_summary(sid: int) -> dict[str, float | int]:
    """PSS and RSS summed by role, in MB, and how many processes each role has."""
    summary: dict[str, float | int] = {}
    for p in session_processes(sid):
        for key, value in ((f"{p.role}_pss_mb", p.pss_mb), (f"{p.role}_rss_mb", p.rss_mb), (f"{p.role}_n", 1)):
            summary[key] = round(summary.get(key, 0) + value, 1)
    return summary


def session_cpu_s(sid: int) -> float:
    """User + system CPU seconds used so far by the live processes of session ``sid`` (all their threads)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in session_pids(sid):
        try:
            fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


def replica_pids(sid: int) -> list[int]:
    """The pids of the Serve replicas of session ``sid``."""
    return [p.pid for p in session_processes(sid) if p.role == "replica"]


def start_session(args: list[str], log: Path | None = None) -> subprocess.Popen:
    """``python -m cosyvoice_cpu *args`` as the leader of a new session (its Ray processes join that session)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "cosyvoice_cpu", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    finally:
        if log is not None:
            out.close()


def end_session(proc: subprocess.Popen, grace_s: float = 60.0) -> list[int]:
    """SIGTERM the leader and wait ``grace_s`` for it and its session to exit; SIGKILL whatever is left of the
    session then. Returns the pids that had to be killed (empty when everything exited on its own)."""
    sid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not session_pids(sid):
            return []
        time.sleep(0.5)
    left = [pid for pid in session_pids(sid) if pid != os.getpid()]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(10)
    if left:
        logger.warning("killed %d processes of session %d that did not exit in %.0f s", len(left), sid, grace_s)
    return left
