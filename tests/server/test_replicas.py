"""``serve --replicas 2`` on a local Ray instance, on loopback: both replicas serve, a voice uploaded through one
is used through the other, a replica killed with SIGKILL comes back, and no voice is lost. Bounded: a few dozen
requests, under a minute on 2 cores. Skipped (with the reason) where the ``[ray]`` extra is not installed."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.hardware.malloc import arena_env
from cosyvoice_cpu.server.process import free_port
from cosyvoice_cpu.server.replica_probe import end_session, replica_pids, start_session
from cosyvoice_cpu.server.replicas import COUNT_TTL_S

pytest.importorskip("ray.serve", reason="the [ray] extra is not installed: pip install 'cosyvoice-cpu[ray]'")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the replicas")

SPEECH = {"model": "tts-1", "input": "Line three.", "voice": "shared", "response_format": "pcm"}
STARTUP_S = 120.0  # Ray's start (~10 s) and two engines loading on 2 cores


def _until(what: str, check: Callable[[], object], timeout: float, every: float = 0.5) -> object:
    """Poll ``check`` until it returns something truthy (its value is returned) or fail after ``timeout`` s."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except httpx.HTTPError as e:
            last = e
        time.sleep(every)
    pytest.fail(f"{what} not within {timeout:.0f} s (last: {last!r})")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    """``serve --replicas 2 --threads 1`` in its own session: (base URL, session id, voices directory)."""
    root = tmp_path_factory.mktemp("replicas")
    port, log = free_port(), root / "serve.log"
    with pytest.MonkeyPatch.context() as env:  # replicas must get the heap limit from serve, not inherit it
        env.delenv("MALLOC_ARENA_MAX", raising=False)
        proc = start_session(["serve", "-m", str(DEMO_MODEL), "--voices", str(root / "voices"), "--port", str(port),
                              "--replicas", "2", "--threads", "1", "--max-active", "4", "--log-level", "warning"],
                             log)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=5) as c:

            def ready() -> bool:
                if proc.poll() is not None:
                    pytest.fail(f"serve --replicas exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                r = c.get("/health")
                return r.status_code == 200 and r.json().get("replicas") == 2

            _until("two replicas serving", ready, STARTUP_S)
        yield url, proc.pid, root / "voices"
    finally:
        killed = end_session(proc)
    assert killed == [], f"processes left after SIGTERM: {killed}"


def _replica_serving(c: httpx.Client, want: Callable[[str], bool], tries: int = 40) -> httpx.Response:
    """GET /health until a replica for which ``want(id)`` holds answers (Serve picks replicas at random)."""
    for _ in range(tries):
        r = c.get("/health")
        if r.status_code == 200 and want(r.headers["x-replica"]):
            return r
    pytest.fail(f"no wanted replica answered in {tries} requests")


def test_both_replicas_serve_and_share_voices(cluster: tuple[str, int, Path]) -> None:
    url, sid, _ = cluster
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")},
                   data={"name": "shared", "prompt_text": "Good morning everyone."})  # fmt: skip
        assert r.status_code == 201, r.text
        writer = r.headers["x-replica"]

        def other_counts_both() -> httpx.Response | None:
            other = _replica_serving(c, lambda rid: rid != writer)
            return other if other.json()["replicas"] == 2 else None

        # each replica caches Serve's count for COUNT_TTL_S: one asked while the other was starting says 1 until then
        other = _until("the other replica counting both", other_counts_both, 10 * COUNT_TTL_S)
        assert other.json()["pid"] in replica_pids(sid)
        # each replica's process started with the engine's heap limit (glibc reads it only at start-up)
        want = arena_env(EngineConfig().malloc_arenas, {})  # serve started without MALLOC_ARENA_MAX
        for pid in replica_pids(sid):
            environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
            assert {k: environ.get(k) for k in want} == want, pid
        # the other replica lists the voice and speaks with it (speech requests also land on either replica)
        served: dict[str, int] = {}
        for seed in range(12):
            r = c.post("/v1/audio/speech", json={**SPEECH, "seed": seed})
            assert r.status_code == 200 and len(r.content) > 0, r.text
            served[r.headers["x-replica"]] = served.get(r.headers["x-replica"], 0) + 1
            listing = c.get("/v1/audio/voices")
            assert [v["name"] for v in listing.json()["voices"]] == ["shared"], listing.headers["x-replica"]
            if len(served) == 2:
                break
        assert set(served) >= {writer, other.headers["x-replica"]}, served


def test_a_killed_replica_comes_back_and_no_voice_is_lost(cluster: tuple[str, int, Path]) -> None:
    url, sid, voices = cluster
    with httpx.Client(base_url=url, timeout=60) as c:
        if c.get("/v1/audio/voices").json()["voices"] == []:
            c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")},
                   data={"name": "shared", "prompt_text": "Good morning everyone."})  # fmt: skip
        before = replica_pids(sid)
        assert len(before) == 2

        def speak(seed: int) -> str:
            try:
                with httpx.Client(base_url=url, timeout=60) as own:
                    r = own.post("/v1/audio/speech", json={**SPEECH, "seed": seed})
                return "ok" if r.status_code == 200 else f"http {r.status_code}"
            except httpx.HTTPError as e:  # a stream cut by the replica's death: a clean, bounded error
                return type(e).__name__

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(speak, seed) for seed in range(8)]
            time.sleep(0.5)  # requests in flight on both replicas
            victim = before[0]
            os.kill(victim, signal.SIGKILL)
            outcomes = [f.result(timeout=90) for f in futures]
        assert outcomes.count("ok") >= 1, outcomes  # the other replica kept serving

        def back() -> bool:
            pids = replica_pids(sid)
            return len(pids) == 2 and victim not in pids and c.get("/health").json()["replicas"] == 2

        _until("the killed replica replaced", back, 60)
        after = [c.post("/v1/audio/speech", json={**SPEECH, "seed": 100 + i}).status_code for i in range(6)]
        assert after == [200] * 6, (outcomes, after)
        assert [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]] == ["shared"]
        assert (voices / "shared.npz").exists()
        # deleted through one replica, gone through every one
        assert c.delete("/v1/audio/voices/shared").status_code == 204
        for _ in range(6):
            r = c.get("/v1/audio/voices")
            assert r.json()["voices"] == [], r.headers["x-replica"]
