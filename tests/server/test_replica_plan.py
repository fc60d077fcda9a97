"""``serve --replicas`` without Ray: the flags, the Serve options they become, the ``X-Replica`` header and
``/health``'s replica fields, and that nothing imports ``ray`` unless replicas are asked for."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice_cpu.cli.main import build_parser
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.server.identity import ReplicaHeaderMiddleware, ReplicaInfo
from cosyvoice_cpu.server.replicas import ReplicaPlan


def test_replica_flags_parse_and_become_serve_options() -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "-m", "m"]).replicas == 1  # the plain server, no Ray
    args = parse(["serve", "-m", "m", "--replicas", "auto", "--min-replicas", "2", "--max-replicas", "6"])
    assert (args.replicas, args.min_replicas, args.max_replicas) == (None, 2, 6)
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parse(["serve", "-m", "m", "--replicas", bad])
    fixed = ReplicaPlan(replicas=3, threads=2, max_ongoing=40).validate().deployment_options()
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 2}
    with_env = ReplicaPlan(threads=2).deployment_options({"MALLOC_ARENA_MAX": "2"})
    assert with_env["ray_actor_options"] == {"num_cpus": 2, "runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "2"}}}
    assert fixed["max_ongoing_requests"] == 40 and "autoscaling_config" not in fixed
    auto = ReplicaPlan(replicas=None, min_replicas=2, max_replicas=6, target_ongoing=3).deployment_options()
    assert auto["autoscaling_config"]["min_replicas"] == 2 and auto["autoscaling_config"]["max_replicas"] == 6
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 3 and "num_replicas" not in auto
    delays = parse(["serve", "-m", "m", "--replicas", "auto", "--upscale-delay", "2", "--downscale-delay", "10"])
    assert (delays.upscale_delay, delays.downscale_delay) == (2.0, 10.0)
    quick = ReplicaPlan(replicas=None, upscale_delay_s=2, downscale_delay_s=10).validate().deployment_options()
    assert (
        quick["autoscaling_config"]["upscale_delay_s"] == 2 and quick["autoscaling_config"]["downscale_delay_s"] == 10
    )
    for bad_plan in (
        ReplicaPlan(threads=0),
        ReplicaPlan(min_replicas=5, max_replicas=2),
        ReplicaPlan(replicas=0),
        ReplicaPlan(replicas=None, downscale_delay_s=-1),
    ):
        with pytest.raises(ConfigError):
            bad_plan.validate()


def test_every_response_names_its_replica_and_health_counts_them() -> None:
    sent: list[dict] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"no"})

    async def send(message: dict) -> None:
        sent.append(message)

    tagged = ReplicaHeaderMiddleware(app, ReplicaInfo(id="r1", pid=42, count=lambda: 3))
    asyncio.run(tagged({"type": "http", "path": "/"}, None, send))
    assert (b"x-replica", b"r1") in sent[0]["headers"] and sent[1]["body"] == b"no"

    def broken() -> int:
        raise RuntimeError("Serve's controller is gone")

    assert ReplicaInfo(id="r1", pid=42, count=lambda: 3).health() == {"replica": "r1", "pid": 42, "replicas": 3}
    assert ReplicaInfo(id="r1", pid=42, count=broken).health()["replicas"] is None  # /health still answers
    assert ReplicaInfo().health()["replicas"] == 1  # a plain server is one replica


def test_the_server_modules_do_not_import_ray() -> None:
    code = ("import sys, cosyvoice_cpu.server.replicas, cosyvoice_cpu.server.app, cosyvoice_cpu.cli.serve\n"
            "assert 'ray' not in sys.modules, 'ray imported'")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_joining_client_uses_the_clusters_token_when_one_is_at_hand(tmp_path: Path) -> None:
    from cosyvoice_cpu.server.replicas import join_auth_mode

    env: dict[str, str] = {}
    assert not join_auth_mode(env, home=tmp_path) and "RAY_AUTH_MODE" not in env  # no token anywhere
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    assert join_auth_mode(env, home=tmp_path) and env["RAY_AUTH_MODE"] == "token"
    env = {"RAY_AUTH_TOKEN": "secret"}
    assert join_auth_mode(env, home=tmp_path / "nowhere") and env["RAY_AUTH_MODE"] == "token"
    env = {"RAY_AUTH_MODE": "disabled"}  # the user's explicit choice stands
    assert not join_auth_mode(env, home=tmp_path) and env["RAY_AUTH_MODE"] == "disabled"


def _fake_raylet(tmp_path: Path, seconds: str) -> subprocess.Popen:
    """A child process whose command name is ``raylet`` (a copy of ``sleep``), as ray.init starts one."""
    import shutil

    exe = tmp_path / "raylet"
    shutil.copy(shutil.which("sleep"), exe)
    return subprocess.Popen([str(exe), seconds])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_raylet_that_dies_while_ray_starts_fails_the_start_at_once(tmp_path: Path, monkeypatch) -> None:
    """``serve --replicas 2`` waited 76 s for "Failed to connect to GCS within 60 seconds" after its raylet died 7 s
    in (issue #35); now the start fails within a second of the death and says what to do."""
    import threading
    import time

    ray = pytest.importorskip("ray")
    from cosyvoice_cpu.server.app import ServerSettings
    from cosyvoice_cpu.server.replicas import RayStartError, ray_children, serve_replicas

    released, children = threading.Event(), []

    def init(**kw: object) -> None:  # Ray's start: the raylet comes up, dies after a second, init waits on
        children.append(_fake_raylet(tmp_path, "1"))
        released.wait(60)
        raise RuntimeError("the test is over")  # never on to Serve's start: no real Ray in this test

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))
    t0 = time.monotonic()
    try:
        with pytest.raises(RayStartError) as e:
            serve_replicas(tmp_path, ServerSettings(voices_dir=tmp_path), object(), ReplicaPlan(replicas=2))
    finally:
        released.set()
    took = time.monotonic() - t0
    message = str(e.value)
    assert f"raylet (pid {children[0].pid}) exited" in message, message
    assert "`ray stop`" in message and "--ray-address" in message and f"{tmp_path}/ray/session_latest" in message
    assert took < 5, took
    children[0].wait(5)  # reaped: no child of that name is left
    assert ray_children() == {}


def test_a_failed_ray_start_and_a_daemon_lost_while_serving_say_what_to_do(tmp_path: Path) -> None:
    import threading

    from cosyvoice_cpu.server.replicas import RayStartError, RayWatch, _wait, start_local_ray

    def init(**kw: object) -> None:
        raise RuntimeError("Failed to connect to GCS within 60 seconds")

    with pytest.raises(RayStartError, match=r"did not start \(RuntimeError: Failed to connect to GCS.*`ray stop`"):
        start_local_ray(init)
    running = {41: ("raylet", True), 42: ("gcs_server", True)}
    watch = RayWatch(lambda: dict(running))
    assert watch.dead() == []
    stop = threading.Event()
    threading.Timer(1.5, lambda: running.pop(41)).start()
    assert _wait(stop, watch) == 1  # the raylet is gone: exit instead of serving errors
    assert watch.dead() == ["raylet (pid 41)"]
    running[43] = ("raylet", False)  # a zombie never seen running: it died too
    assert watch.dead() == ["raylet (pid 41)", "raylet (pid 43)"]
    stop.set()
    assert _wait(stop, RayWatch(lambda: {})) == 0
