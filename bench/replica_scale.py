"""Replicas on Ray Serve against one server, on this machine, over loopback (docs/deploy.md).

    python bench/replica_scale.py scale [-m MODEL_DIR] [--requests 24] [--concurrency 4] [--json OUT]
    python bench/replica_scale.py faults [-m MODEL_DIR] [--requests 40] [--concurrency 4] [--json OUT]
    python bench/replica_scale.py autoscale [-m MODEL_DIR] [--concurrency 4] [--load-s 60] [--json OUT]
    python bench/replica_scale.py join [-m MODEL_DIR] [--requests 8] [--json OUT]

``scale``: the same streamed requests (one sentence, distinct seeds, ``--concurrency`` in flight) against one
1-thread server, one 2-thread server, 1 replica of 1 thread on Ray Serve and 2 replicas of 1 thread each.
Reports sentences/s, first audio, and the memory (PSS, which splits shared pages so it adds up) of the replicas
and of everything else in the run's session (the control plane: GCS, raylet, Ray's agents, Serve's controller
and proxy, the CLI driver).

``faults``: 2 replicas; ``--requests`` requests with ``--concurrency`` in flight; after ``--kill-after``
requests finished, one replica's process gets SIGKILL. Every request's outcome is recorded (a response that ended
with status 200 counts as whole only if its audio has as many bytes as the same seed gives after the recovery),
and the times until Serve had started a new replica process and until ``/health`` counted 2 again. Voices saved
before the kill must all be listed after it. The default model is the packaged tiny demo model.

``autoscale``: ``serve --replicas auto`` from 1 to 2 replicas of 1 thread (target 1 request in flight per
replica, upscale delay 2 s, downscale delay 10 s). ``--concurrency`` streams for ``--load-s`` seconds, then
none. ``/health``'s replica count is read every half second throughout: when the second replica served, when the
count went back to 1, and every request's outcome.

``join``: a Ray cluster started on its own (``ray start --head`` on a free port, 2 CPUs), then ``serve
--ray-address 127.0.0.1:PORT --replicas 2``: both replicas must serve, and the cluster must outlive the server
(``serve`` deletes its app but leaves a cluster it joined running); ``ray stop`` ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from server_load import TEXT, ensure_voice

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.server.process import free_port
from cosyvoice_cpu.server.replica_probe import (
    end_session,
    memory_summary,
    replica_pids,
    session_cpu_s,
    start_session,
)

CONFIGS = {
    "plain, 1 thread": ["--threads", "1"],
    "plain, 2 threads": ["--threads", "2"],
    "ray, 1 replica x 1 thread": ["--replicas", "auto", "--min-replicas", "1", "--max-replicas", "1", "--threads", "1"],
    "ray, 2 replicas x 1 thread": ["--replicas", "2", "--threads", "1"],
}
STARTUP_S = 300.0


def start(model: Path, voices: Path, extra: list[str], log: Path) -> tuple[str, object]:
    """``serve`` in its own session; returns (URL, process) once /health answers for every replica."""
    port = free_port()
    proc = start_session(["serve", "-m", str(model), "--voices", str(voices), "--port", str(port),
                          "--log-level", "warning", *extra], log)  # fmt: skip
    n = extra[extra.index("--replicas") + 1] if "--replicas" in extra else "1"
    url, want = f"http://127.0.0.1:{port}", int(n) if n.isdigit() else 1
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            health = httpx.get(url + "/health", timeout=2).json()
            if health.get("replicas", 1) == want:
                return url, proc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    end_session(proc)
    raise RuntimeError(f"serve did not come up in {STARTUP_S:.0f} s")


def speak(url: str, seed: int) -> dict:
    """One streamed pcm request: outcome (``ok``, ``http N`` or the exception's name), bytes, times, replica."""
    body = {"model": "tts-1", "input": TEXT, "voice": "demo", "response_format": "pcm", "seed": seed}
    t0, first, n, replica, outcome = time.perf_counter(), None, 0, None, "ok"
    try:
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/audio/speech", json=body) as r:
            replica = r.headers.get("x-replica")
            if r.status_code != 200:
                outcome = f"http {r.status_code}"
            for part in r.iter_bytes():
                first = first if first is not None else time.perf_counter() - t0
                n += len(part)
    except httpx.HTTPError as e:
        outcome = type(e).__name__
    return {"seed": seed, "outcome": outcome, "bytes": n, "replica": replica, "start": t0,
            "end": time.perf_counter(), "first": first}  # fmt: skip


def scale(args: argparse.Namespace) -> dict:
    out: dict = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "runs": {},
                 "model": str(args.model), "requests": args.requests, "concurrency": args.concurrency}  # fmt: skip
    for label, extra in [(label, extra) for _ in range(args.repeat) for label, extra in CONFIGS.items()]:
        with tempfile.TemporaryDirectory() as tmp:
            url, proc = start(args.model, Path(tmp) / "voices", extra, Path(tmp) / "serve.log")
            try:
                ensure_voice(url)
                with ThreadPoolExecutor(args.concurrency) as pool:
                    list(pool.map(speak, [url] * args.concurrency, range(900, 900 + args.concurrency)))  # warm-up
                    steal0, cpu0, t0 = _steal_s(), session_cpu_s(proc.pid), time.perf_counter()
                    rows = list(pool.map(speak, [url] * args.requests, range(args.requests)))
                    wall, steal = time.perf_counter() - t0, _steal_s() - steal0
                    cpu = session_cpu_s(proc.pid) - cpu0
                memory = memory_summary(proc.pid)
            finally:
                end_session(proc)
        bad = [r["outcome"] for r in rows if r["outcome"] != "ok"]
        firsts = sorted(r["first"] or 0.0 for r in rows)
        run = {"wall_s": round(wall, 2), "sentences_per_s": round(args.requests / wall, 3), "failed": len(bad),
               "cpu_steal_s": round(steal, 2),  # time the hypervisor gave this VM's cores to others
               "cores_used": round(cpu / wall, 2), "cpu_s_per_sentence": round(cpu / args.requests, 3),
               "audio_s": round(sum(r["bytes"] for r in rows) / 2 / 24000, 1),  # 16-bit pcm at the demo's 24 kHz
               "median_first_audio_s": round(firsts[len(firsts) // 2], 3), "memory": memory,
               "by_replica": _count(r["replica"] for r in rows)}  # fmt: skip
        out["runs"].setdefault(label, []).append(run)
        print(f"{label:28s} {run['sentences_per_s']:6.2f} sentences/s ({run['cores_used']:.2f} cores, "
              f"{run['cpu_s_per_sentence']:.3f} CPU s each), first audio {run['median_first_audio_s']:.2f}"
              f" s, replicas PSS {memory.get('replica_pss_mb', 0):.0f} MB, control plane + driver PSS "
              f"{memory.get('control_pss_mb', 0) + memory.get('driver_pss_mb', 0):.0f} MB "
              f"({memory.get('control_n', 0)} processes), failed {len(bad)}", flush=True)  # fmt: skip
    return out


def faults(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        url, proc = start(args.model, Path(tmp) / "voices", CONFIGS["ray, 2 replicas x 1 thread"],
                          Path(tmp) / "serve.log")  # fmt: skip
        try:
            ensure_voice(url)
            with httpx.Client(base_url=url, timeout=60) as c:
                for i in range(3):
                    r = c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")},
                               data={"name": f"kept {i}", "prompt_text": "Good morning everyone."})  # fmt: skip
                    r.raise_for_status()
            watch = Recovery(url, proc.pid)
            with ThreadPoolExecutor(args.concurrency) as pool:
                futures = [pool.submit(speak, url, s) for s in range(args.requests)]
                for done, f in enumerate(futures, 1):
                    f.result()
                    if done == args.kill_after:
                        time.sleep(args.kill_delay)  # new requests are streaming on both replicas by now
                        watch.kill_a_busy_replica()
                rows = [f.result() for f in futures]
            watch.join()
            killed_at = watch.killed_at
            for r in rows:  # a 200 is whole only if it carries all the audio of its seed
                if r["outcome"] == "ok" and r["start"] < killed_at + 1.0 and r["end"] > killed_at - 1.0:
                    again = speak(url, r["seed"])
                    r["outcome"] = "ok" if again["bytes"] == r["bytes"] else "truncated 200"
            names = [v["name"] for v in httpx.get(url + "/v1/audio/voices", timeout=30).json()["voices"]]
            memory = memory_summary(proc.pid)
        finally:
            end_session(proc)
    in_flight = [r for r in rows if r["start"] <= killed_at < r["end"]]
    later = [r for r in rows if r["start"] > killed_at]
    result = {"model": str(args.model), "requests": args.requests, "concurrency": args.concurrency,
              "killed_pid": watch.victim, "victim_active_at_kill": watch.victim_active,
              "outcomes": _count(r["outcome"] for r in rows),
              "in_flight_at_kill": _count(r["outcome"] for r in in_flight),
              "started_after_kill": _count(r["outcome"] for r in later),
              "new_replica_process_s": watch.new_process_s, "new_replica_answers_s": watch.new_replica_answers_s,
              "health_of_new_replica": watch.health_after,
              "voices_after": names, "memory_after": memory,
              "timeline": [{k: (round(v - killed_at, 3) if k in ("start", "end") else v) for k, v in r.items()}
                           for r in rows]}  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1))
    return result


class Recovery:
    """Kills a replica that is running syntheses, then watches (in a thread) for Serve's replacement: the time
    until a new replica process exists, and until a ``/health`` answer comes from it (it serves)."""

    def __init__(self, url: str, sid: int) -> None:
        self.url, self.sid = url, sid
        self.victim = self.victim_active = self.killed_at = None
        self.new_process_s = self.new_replica_answers_s = None
        self.health_after: dict | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def kill_a_busy_replica(self) -> None:
        self.before = set(replica_pids(self.sid))
        for _ in range(50):  # Serve routes /health to either replica: ask until a busy one answers
            h = httpx.get(self.url + "/health", timeout=5).json()
            if h["active"] > 0:
                break
        self.victim, self.victim_active = h["pid"], h["active"]
        self.killed_at = time.perf_counter()
        os.kill(self.victim, signal.SIGKILL)
        self._thread.start()

    def _watch(self) -> None:
        while time.perf_counter() - self.killed_at < 120 and self.new_replica_answers_s is None:
            if self.new_process_s is None and set(replica_pids(self.sid)) - self.before:
                self.new_process_s = round(time.perf_counter() - self.killed_at, 2)
            try:
                h = httpx.get(self.url + "/health", timeout=5).json()
                if h["pid"] not in self.before:
                    self.new_replica_answers_s = round(time.perf_counter() - self.killed_at, 2)
                    self.health_after = h
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)

    def join(self) -> None:
        self._thread.join(130)


def _steal_s() -> float:
    """CPU seconds stolen by the hypervisor so far, all cores (``/proc/stat``; 0 where it cannot be read)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _count(values: object) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:  # type: ignore[attr-defined]
        out[str(v)] = out.get(str(v), 0) + 1
    return out


AUTOSCALE = ["--replicas", "auto", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing", "1",
             "--upscale-delay", "2", "--downscale-delay", "10", "--threads", "1"]  # fmt: skip


def autoscale(args: argparse.Namespace) -> dict:
    """Load, then idle, against ``serve --replicas auto`` (:data:`AUTOSCALE`), with the replica count sampled."""
    with tempfile.TemporaryDirectory() as tmp:
        url, proc = start(args.model, Path(tmp) / "voices", AUTOSCALE, Path(tmp) / "serve.log")
        samples: list[tuple[float, int]] = []
        stop = threading.Event()
        t0 = time.perf_counter()

        def watch() -> None:
            while not stop.is_set():
                try:
                    samples.append((time.perf_counter() - t0, int(httpx.get(url + "/health", timeout=5).json()
                                                                  .get("replicas", 0))))  # fmt: skip
                except (httpx.HTTPError, ValueError):
                    samples.append((time.perf_counter() - t0, -1))
                stop.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        rows: list[dict] = []
        try:
            ensure_voice(url)
            load_end = time.perf_counter() + args.load_s

            def stream(sid: int) -> None:
                seed = sid * 1000
                while time.perf_counter() < load_end:
                    rows.append(speak(url, seed))
                    seed += 1

            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(stream, range(args.concurrency)))
            idle_from = time.perf_counter() - t0
            deadline = time.perf_counter() + args.idle_s
            while time.perf_counter() < deadline and not (samples and samples[-1][1] == 1 and
                                                          samples[-1][0] > idle_from + 1):  # fmt: skip
                time.sleep(0.5)
        finally:
            stop.set()
            watcher.join()
            end_session(proc)
    first_two = next((t for t, n in samples if n == 2), None)
    back_to_one = next((t for t, n in samples if n == 1 and t > idle_from), None)
    served_by = _count(r["replica"] for r in rows)
    out = {"config": AUTOSCALE, "concurrency": args.concurrency, "load_s": args.load_s, "requests": len(rows),
           "failed": sum(r["outcome"] != "ok" for r in rows), "by_replica": served_by,
           "second_replica_at_s": first_two, "load_ended_at_s": round(idle_from, 1),
           "back_to_one_at_s": back_to_one, "samples": samples}  # fmt: skip
    print(
        f"{len(rows)} requests ({out['failed']} failed) over {len(served_by)} replicas {served_by}; 2 replicas "
        f"at {first_two} s; load ended at {idle_from:.1f} s; back to 1 replica at {back_to_one} s",
        flush=True,
    )
    return out


def join(args: argparse.Namespace) -> dict:
    """``serve --ray-address`` against a cluster started by ``ray start --head`` (see the module docstring)."""
    import subprocess
    import sys

    ray_cli = str(Path(sys.executable).parent / "ray")
    port = free_port()
    # Ray 2.60's clusters ask for its token (~/.ray/auth_token, made here if missing); serve finds it and joins
    # in token mode (server.replicas.join_auth_mode)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_cli, "get-auth-token", "--generate"], check=True, env=env, capture_output=True)
    t0 = time.perf_counter()
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True)  # fmt: skip
    head_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t1 = time.perf_counter()
            extra = ["--ray-address", f"127.0.0.1:{port}", "--replicas", "2", "--threads", "1"]
            url, proc = start(args.model, Path(tmp) / "voices", extra, Path(tmp) / "serve.log")
            up_s = time.perf_counter() - t1
            try:
                ensure_voice(url)
                with ThreadPoolExecutor(args.concurrency) as pool:
                    rows = list(pool.map(speak, [url] * args.requests, range(args.requests)))
            finally:
                left = end_session(proc)
        status = subprocess.run([ray_cli, "status", "--address", f"127.0.0.1:{port}"],
                                env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True)  # fmt: skip
    finally:
        subprocess.run([ray_cli, "stop"], env=env, capture_output=True)
    out = {"head_start_s": round(head_s, 1), "serve_up_s": round(up_s, 1), "requests": len(rows),
           "failed": sum(r["outcome"] != "ok" for r in rows), "by_replica": _count(r["replica"] for r in rows),
           "killed_at_exit": left, "cluster_outlived_serve": status.returncode == 0}  # fmt: skip
    print(f"head up in {head_s:.1f} s, serve joined with 2 replicas in {up_s:.1f} s; {len(rows)} requests "
          f"({out['failed']} failed) by replica {out['by_replica']}; cluster still up after serve exited: "
          f"{out['cluster_outlived_serve']}", flush=True)  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["scale", "faults", "autoscale", "join"])
    p.add_argument("-m", "--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--requests", type=int, default=None, help="scale: per configuration (24); faults: total (40)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1, help="scale: rounds over the configurations (interleaved)")
    p.add_argument("--kill-after", type=int, default=8, help="faults: requests finished before the kill")
    p.add_argument("--kill-delay", type=float, default=1.0, help="faults: seconds after that before the kill")
    p.add_argument("--load-s", type=float, default=60.0, help="autoscale: seconds of load")
    p.add_argument("--idle-s", type=float, default=120.0, help="autoscale: most seconds to wait for the scale-down")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    args.requests = args.requests or {"scale": 24, "join": 8}.get(args.mode, 40)
    result = {"scale": scale, "faults": faults, "autoscale": autoscale, "join": join}[args.mode](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
