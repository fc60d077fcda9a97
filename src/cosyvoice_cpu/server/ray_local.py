"""The local Ray instance that ``serve --replicas`` starts as this process's children: starting it while its
daemons are watched (a daemon that dies fails the start within a second, with what to do), and finding them.

Split from :mod:`cosyvoice_cpu.server.replicas`; ``ray`` itself is never imported here (``init`` is handed in).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from cosyvoice_cpu.errors import CosyVoiceCpuError

logger = logging.getLogger(__name__)

RAY_DAEMONS = ("gcs_server", "raylet")  # the processes of a local Ray instance that ray.init starts as our children
WATCH_S = 0.5  # how often they are looked at while ray.init runs


class RayStartError(CosyVoiceCpuError):
    """The local Ray instance did not come up, or one of its daemons died."""


def ray_children(names: tuple[str, ...] = RAY_DAEMONS, parent: int | None = None) -> dict[int, tuple[str, bool]]:
    """The child processes of ``parent`` (default: this process) whose command name is one of ``names``: pid ->
    (name, alive); a child that exited and was not reaped yet (a zombie) is there, not alive. Read from
    ``/proc``; empty where there is none."""
    parent = os.getpid() if parent is None else parent
    found: dict[int, tuple[str, bool]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return found
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        comm, rest = stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :].split()
        if len(rest) > 1 and int(rest[1]) == parent and comm in names:
            found[int(pid)] = (comm, rest[0] not in ("Z", "X"))
    return found


class RayWatch:
    """Which daemons of our local Ray instance were seen running, to tell when one died (``dead``).

    A raylet that dies while ``ray.init`` waits for it (another Ray session shutting down on the host, a port
    taken) left ``ray.init`` waiting 60 s before "Failed to connect to GCS within 60 seconds"; watched, the start
    fails within a second of the death, with what to do.
    """

    def __init__(self, list_children: Callable[[], dict[int, tuple[str, bool]]] = ray_children) -> None:
        self.list_children = list_children
        self.seen: dict[int, str] = {}
        self.release = threading.Event()  # ends the thread that started the instance (see start_local_ray)

    def dead(self) -> list[str]:
        """Descriptions of the daemons that exited: seen running before and gone now, or seen as zombies (a
        daemon that died before it was ever seen running)."""
        children = self.list_children()
        self.seen.update({pid: name for pid, (name, _) in children.items()})
        alive = {pid for pid, (_, running) in children.items() if running}
        return [f"{name} (pid {pid})" for pid, name in sorted(self.seen.items()) if pid not in alive]


def ray_logs() -> str:
    """Where the newest local Ray session keeps its logs."""
    root = os.environ.get("RAY_TMPDIR") or "/tmp/ray"  # noqa: S108 (Ray's own default, named in a message)
    return f"{root}/session_latest/logs (raylet.out, gcs_server.out)"


def what_to_do() -> str:
    return (
        "Another Ray instance on this host (one shutting down, or left over) is the usual cause: run `ray stop` "
        "and start again, or join a healthy cluster with --ray-address HOST:6379. Ray's logs: " + ray_logs()
    )


def start_local_ray(
    init: Callable[..., object],
    watch: RayWatch | None = None,
    poll_s: float = WATCH_S,
    then: Callable[[], object] | None = None,
    **kw: object,
) -> RayWatch:
    """``init(**kw)`` (``ray.init`` of a local instance), then ``then()`` (Serve's start and the app), in a thread
    while this one watches the daemons ``init`` starts; raises :class:`RayStartError` as soon as one of them
    died (a dead raylet left ``ray.init`` or ``serve.run`` waiting for a minute, or for good), or with what to do
    when ``init`` failed; an exception of ``then`` is raised as it is. Returns the watch (with the daemons seen)
    for the serving loop to keep an eye on; set its ``release`` once the instance is shut down.

    The starting thread stays alive until then: Ray starts its daemons with a parent-death signal
    (``PR_SET_PDEATHSIG``), which Linux sends when the *thread* that started them ends, not the process.
    """
    watch = watch or RayWatch()
    started, failure = threading.Event(), []

    def run() -> None:
        quiet = _Without("not the main thread")  # Ray's SIGTERM handler: serve_replicas sets its own
        logging.getLogger("ray._private.worker").addFilter(quiet)
        phase = "init"
        try:
            init(**kw)
            phase = "then"
            if then is not None:
                then()
        except BaseException as e:  # handed to the waiting thread
            failure.append((phase, e))
            return
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
            started.set()
        watch.release.wait()  # the daemons live as long as this thread (their parent-death signal)

    threading.Thread(target=run, name="ray-owner", daemon=True).start()
    while not started.wait(poll_s):
        dead = watch.dead()
        if dead and not started.is_set():  # the daemons left end with the starting thread, at exit
            raise RayStartError(
                f"the local Ray instance failed while starting: {', '.join(dead)} exited. " + what_to_do()
            )
    if failure:
        phase, e = failure[0]
        if phase == "then" or isinstance(e, KeyboardInterrupt):
            raise e
        raise RayStartError(f"the local Ray instance did not start ({type(e).__name__}: {e}). {what_to_do()}") from e
    watch.dead()  # the daemons running now
    return watch


class _Without(logging.Filter):
    """Drops log records whose message contains ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()
