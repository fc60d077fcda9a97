"""``cosyvoice-cpu serve --replicas N``: the same OpenAI-compatible app as N replicas on Ray Serve.

Each replica is a Ray actor that loads its own :class:`~cosyvoice_cpu.engine.Engine` once (with the ORT thread
count set explicitly: Ray reserves ``num_cpus`` per replica but pins no affinity) and serves the app of
:func:`~cosyvoice_cpu.server.app.create_app` around it through Serve's late-bound ingress
(``__serve_build_asgi_app__``), so routes, streaming, admission and metrics are those of the plain server. Serve's
proxy spreads requests over the replicas and restarts a replica whose process died. Voices live in one
:class:`~cosyvoice_cpu.voices.store.DirectoryVoiceStore` shared by every replica (a shared filesystem when the
replicas span hosts). Every response carries ``X-Replica``; ``/health`` adds the replica, its pid and the count.

``ray`` is imported only here, inside functions: it is the optional ``[ray]`` extra, and the runtime never needs it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyvoice_cpu.errors import ConfigError, MissingExtraError
from cosyvoice_cpu.hardware.malloc import arena_env
from cosyvoice_cpu.server.identity import ReplicaInfo
from cosyvoice_cpu.server.ray_local import (  # re-exported: the local Ray instance lives there
    RAY_DAEMONS,
    WATCH_S,
    RayStartError,
    RayWatch,
    ray_children,
    ray_logs,
    start_local_ray,
    what_to_do,
)

if TYPE_CHECKING:
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.server.state import ServerSettings

logger = logging.getLogger(__name__)

__all__ = [
    "RAY_DAEMONS",
    "WATCH_S",
    "RayStartError",
    "RayWatch",
    "ReplicaPlan",
    "join_auth_mode",
    "ray_children",
    "ray_logs",
    "serve_replicas",
    "start_local_ray",
    "what_to_do",
]

APP_NAME = "cosyvoice"
DEPLOYMENT_NAME = "CosyVoiceReplica"
COUNT_TTL_S = 2.0  # /health asks Serve's controller for the replica count at most this often
TEARDOWN_S = 30.0  # at most this long for Serve to take the replicas down at exit


@dataclass
class ReplicaPlan:
    """How many replicas, where, and how each is sized (``serve --replicas`` flags).

    Attributes:
        replicas: a fixed count, or None for Serve's autoscaling between ``min_replicas`` and ``max_replicas``
            on ongoing requests per replica (``target_ongoing``).
        threads: ORT threads per replica; also the CPUs Ray reserves for it.
        ray_address: join this Ray cluster (``ray://`` or ``HOST:PORT``); None starts a local instance.
        host, port: where Serve's HTTP proxy listens.
        max_ongoing: requests Serve sends one replica at once (its app queues and refuses beyond its limits).
        upscale_delay_s, downscale_delay_s: with autoscaling, how long the load must stay above (below) the target
            before Serve adds (removes) a replica (``serve --upscale-delay/--downscale-delay``).
    """

    replicas: int | None = 2
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing: float = 2.0
    threads: int = 1
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_ongoing: int = 40
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    health_period_s: float = 5.0

    def validate(self) -> ReplicaPlan:
        if self.replicas is not None and not 1 <= self.replicas <= 1024:
            raise ConfigError(f"--replicas must be 1 to 1024 or 'auto', not {self.replicas}")
        if not 1 <= self.min_replicas <= self.max_replicas <= 1024:
            raise ConfigError(
                f"need 1 <= --min-replicas ({self.min_replicas}) <= --max-replicas ({self.max_replicas}) <= 1024"
            )
        if self.threads < 1:
            raise ConfigError("replicas need an explicit --threads of at least 1 (Ray pins no affinity)")
        if self.target_ongoing <= 0:
            raise ConfigError(f"--target-ongoing must be above 0, not {self.target_ongoing}")
        if not (0 <= self.upscale_delay_s <= 86400 and 0 <= self.downscale_delay_s <= 86400):
            raise ConfigError(
                f"--upscale-delay and --downscale-delay must be 0 to 86400 s, not "
                f"{self.upscale_delay_s} and {self.downscale_delay_s}"
            )
        return self

    def deployment_options(self, env: dict[str, str] | None = None) -> dict[str, object]:
        """The ``serve.deployment`` options of this plan; ``env``: variables every replica's process starts with
        (Ray's ``runtime_env``)."""
        actor: dict[str, object] = {"num_cpus": self.threads}
        if env:
            actor["runtime_env"] = {"env_vars": dict(env)}
        opts: dict[str, object] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing,
            "health_check_period_s": self.health_period_s,
        }
        if self.replicas is None:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
        else:
            opts["num_replicas"] = self.replicas
        return opts


class _CachedCount:
    """The running replica count from Serve's controller, asked at most every ``COUNT_TTL_S`` seconds."""

    def __init__(self, fallback: int | None) -> None:
        self.value, self.at, self._lock = fallback, 0.0, threading.Lock()

    def __call__(self) -> int | None:
        if time.monotonic() - self.at < COUNT_TTL_S or not self._lock.acquire(blocking=False):
            return self.value
        try:
            from ray import serve

            dep = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
            self.value = int(sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING")))
        finally:
            self.at = time.monotonic()
            self._lock.release()
        return self.value


def _build_deployment(plan: ReplicaPlan, engine_config: EngineConfig) -> Any:
    """The Serve deployment class (made here: ``ray`` is imported only when replicas are asked for).

    A replica's actor process runs Ray's threads (each may have made a glibc heap) before the engine loads, where
    the engine's own heap limit can come too late: the replicas start with ``MALLOC_ARENA_MAX`` instead.
    """
    from ray import serve

    env = arena_env(engine_config.malloc_arenas)

    @serve.deployment(name=DEPLOYMENT_NAME, **plan.deployment_options(env))
    @serve.ingress()
    class CosyVoiceReplica:
        """One replica: its own engine, loaded once, and the app around it."""

        async def __init__(self, model_dir: str, settings: ServerSettings, engine_config: EngineConfig) -> None:
            import asyncio

            from cosyvoice_cpu.engine import Engine

            ctx = serve.get_replica_context()
            self.info = ReplicaInfo(id=ctx.replica_tag, count=_CachedCount(ctx.world_size))
            self.settings = settings
            self.engine = await asyncio.to_thread(Engine.load, model_dir, engine_config)
            logger.info(
                "replica %s (pid %d) loaded %s with %d threads",
                self.info.id,
                self.info.pid,
                model_dir,
                engine_config.threads,
            )

        def __serve_build_asgi_app__(self) -> Any:
            from cosyvoice_cpu.server.app import create_app

            return create_app(self.engine, self.settings, replica=self.info)

        def __del__(self) -> None:  # Serve calls it after the app's lifespan ended, when it stops the replica
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.close()

    return CosyVoiceReplica


def serve_replicas(
    model_dir: Path,
    settings: ServerSettings,
    engine_config: EngineConfig,
    plan: ReplicaPlan,
    stop: threading.Event | None = None,
) -> int:
    """Run the app as replicas on Ray Serve until SIGINT/SIGTERM (or ``stop``), then take them down.

    Starts a local Ray instance unless ``plan.ray_address`` names one to join.
    """
    plan.validate()
    local = plan.ray_address is None
    if not local and join_auth_mode(os.environ):  # before ray is imported: it reads the mode then
        logger.info("joining %s with Ray's token authentication (RAY_AUTH_MODE=token)", plan.ray_address)
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise MissingExtraError("--replicas needs the [ray] extra: pip install 'cosyvoice-cpu[ray]'") from e
    if local:  # our own instance: no usage reports (Ray leaves them off for ray.init() clusters; say so anyway)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    def deploy() -> None:  # Serve and the app on the instance
        cpus = ray.cluster_resources().get("CPU", 0)
        want = plan.threads * (plan.replicas or plan.min_replicas)
        if want > cpus:
            logger.warning(
                "%d replicas x %d threads need %d CPUs, the Ray cluster has %g: Serve keeps the rest pending",
                plan.replicas or plan.min_replicas,
                plan.threads,
                want,
                cpus,
            )
        serve.start(http_options={"host": plan.host, "port": plan.port})
        deployment = _build_deployment(plan, engine_config)
        serve.run(
            deployment.bind(str(model_dir), settings, engine_config), name=APP_NAME, route_prefix="/", blocking=False
        )

    if not local:
        try:
            ray.init(logging_level=logging.WARNING, address=plan.ray_address)
        except ConnectionError as e:
            raise ConfigError(
                f"could not join the Ray cluster at {plan.ray_address} ({e}). Check the address "
                "(HEAD:6379 or ray://HEAD:10001); a cluster with token authentication (Ray 2.60 "
                "clusters have it) needs RAY_AUTH_MODE=token and its token here (RAY_AUTH_TOKEN, or "
                "~/.ray/auth_token from `ray get-auth-token`)"
            ) from e
    watch, lost = None, False
    try:
        if local:  # Ray, Serve and the app come up in a thread while this one watches Ray's daemons
            watch = RayWatch()
            start_local_ray(ray.init, watch, then=deploy, logging_level=logging.WARNING, include_dashboard=False)
        else:
            deploy()
        count = "auto" if plan.replicas is None else plan.replicas
        print(
            f"serving {model_dir} on http://{plan.host}:{plan.port} as {count} replicas on Ray Serve "
            f"({plan.threads} threads each, voices in {settings.voices_dir})",
            flush=True,
        )
        code = _wait(stop, watch)
        lost = code != 0
        return code
    except RayStartError:
        lost = True
        raise
    finally:
        _teardown(local, lost=lost)
        if watch is not None:
            watch.release.set()


def join_auth_mode(environ: dict[str, str] | Any, home: Path | None = None) -> bool:
    """Turn on Ray's token mode for a client that joins a cluster (Ray 2.60 enforces tokens on the clusters it
    starts, but a joining client stays in the default mode and is refused): when ``RAY_AUTH_MODE`` is unset and a
    token is at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), set it to ``token``
    in ``environ``. Returns whether it did."""
    if environ.get("RAY_AUTH_MODE"):
        return False
    token_file = (home or Path.home()) / ".ray" / "auth_token"
    if environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH") or token_file.is_file():
        environ["RAY_AUTH_MODE"] = "token"
        return True
    return False


def _teardown(local: bool, timeout_s: float = TEARDOWN_S, lost: bool = False) -> None:
    """Delete the app (its replicas drain through their lifespans), stop Serve if the instance is ours, and
    disconnect; bounded, so a Ray whose processes already died (a Ctrl-C reaches the whole process group) cannot
    hold the exit. ``lost``: a daemon of our instance died, so there is nothing to drain: only disconnect."""
    import ray
    from ray import serve

    def down() -> None:
        if lost:  # a disconnect that talks to a dead raylet must not hold the exit either
            ray.shutdown()
            return
        serve.delete(APP_NAME)
        if local:
            serve.shutdown()

    logger.info("taking the replicas down")
    worker = threading.Thread(target=down, name="serve-teardown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("Serve did not stop in %.0f s; disconnecting anyway", timeout_s)
    if not lost:
        ray.shutdown()


def _wait(stop: threading.Event | None, watch: RayWatch | None = None) -> int:
    """Block until SIGINT/SIGTERM (main thread) or ``stop`` is set (0), or a daemon of our local Ray instance died
    (1: nothing can be served any more, so say so and exit instead of answering every request with an error)."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        dead = watch.dead() if watch is not None else []
        if dead and not stop.wait(0.5):  # not the same Ctrl-C/SIGTERM reaching the process group
            logger.error("the local Ray instance lost %s: stopping. %s", ", ".join(dead), what_to_do())
            return 1
    return 0
