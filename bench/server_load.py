"""Load and soak runs against a real ``cosyvoice-cpu serve`` process on loopback.

    python bench/server_load.py batching [-m MODEL_DIR] [--concurrency 1,4,8] [--requests 16] [--json OUT]
    python bench/server_load.py soak [-m MODEL_DIR] [--requests 2000] [--concurrency 4] [--json OUT]
    python bench/server_load.py latency [-m MODEL_DIR] [--requests 20] [--idle 0,10] [--json OUT]

``batching``: the same requests (streamed pcm, one sentence, distinct seeds) sent serially and with N in flight,
to a server with the LM scheduler and, in the same run, to one without it (``--lm-batch-rows 0``: concurrent
requests then decode their LM steps separately). Reports sentences/s and ratios against serial.

``soak``: many requests at a fixed concurrency; the server's RSS (``/health``) is sampled every ``--every``
requests. Growth is measured from the end of the warm-up (the first 10 %) to the end; the curve is written to
the JSON.

``latency``: what a voice assistant's user waits for: one short sentence (the guide's 8 characters) streamed at a
time, each after ``--idle`` seconds with nothing to do (a list: the gaps take turns, request by request, so the
machine's drift falls on each alike). Reports the first audio's median, 90th percentile and worst per gap, and
every value in the JSON: the tail, not only the median, is what a user hears as "sometimes it hesitates".

The default model is the packaged tiny demo model; pass ``-m`` for a full-size export.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from cosyvoice_cpu.benchmark.tasks import SHORT_TEXT
from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.server.process import ServerProcess

TEXT = "Warning: line three is overheating. Check the pump."
STARTUP_S = 300  # a full-size model directory loads in well under a minute; a busy machine gets slack


def ensure_voice(url: str) -> None:
    with httpx.Client(base_url=url, timeout=600) as c:
        if "demo" not in [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]]:
            r = c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")},
                       data={"name": "demo", "prompt_text": "Good morning everyone."})  # fmt: skip
            r.raise_for_status()


def one(url: str, seed: int, text: str = TEXT) -> dict[str, float]:
    """One streamed request: wall time, time to first byte, audio seconds."""
    body = {"model": "tts-1", "input": text, "voice": "demo", "response_format": "pcm", "seed": seed}
    t0 = time.perf_counter()
    first, n = None, 0
    with httpx.Client(base_url=url, timeout=600) as c, c.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for part in r.iter_bytes():
            first = first if first is not None else time.perf_counter() - t0
            n += len(part)
        rate = int(r.headers["x-sample-rate"])
    return {"seconds": time.perf_counter() - t0, "first": first or 0.0, "audio": n / 2 / rate}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads) so far; None where /proc is not readable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_batch(url: str, concurrency: int, requests: int, pid: int | None = None) -> dict[str, float]:
    """``requests`` streamed requests, ``concurrency`` in flight; with the server's ``pid``, also the cores it
    used and its CPU seconds per sentence (what bounds the ratio to serial on a 2-core machine)."""
    c0 = None if pid is None else cpu_seconds(pid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda s: one(url, s), range(requests)))
    wall = time.perf_counter() - t0
    firsts = [r["first"] for r in results]
    row = {"concurrency": concurrency, "requests": requests, "wall_s": round(wall, 3),
           "sentences_per_s": round(requests / wall, 3), "audio_s": round(sum(r["audio"] for r in results), 2),
           "median_first_audio_s": round(quantile(firsts, 0.5), 3)}  # fmt: skip
    c1 = None if pid is None else cpu_seconds(pid)
    if c0 is not None and c1 is not None:
        row["server_cores"] = round((c1 - c0) / wall, 2)
        row["server_cpu_s_per_sentence"] = round((c1 - c0) / requests, 3)
    return row


def batching(args: argparse.Namespace) -> dict:
    out: dict = {"machine": platform.processor() or platform.machine(), "model": str(args.model), "runs": {}}
    for label, extra in (("scheduler", []), ("no-scheduler", ["--lm-batch-rows", "0"])):
        with tempfile.TemporaryDirectory() as voices:
            server = ServerProcess.start(args.model, Path(voices), "--threads", str(args.threads), "--max-active",
                                         str(max(args.concurrency)), *extra, timeout=STARTUP_S)  # fmt: skip
            url = server.url
            try:
                ensure_voice(url)
                one(url, 999)  # warm-up
                rows = [run_batch(url, n, args.requests, server.proc.pid) for n in args.concurrency]
            finally:
                server.stop()
        base = rows[0]["sentences_per_s"]
        for row in rows:
            row["vs_serial"] = round(row["sentences_per_s"] / base, 2)
        out["runs"][label] = rows
        for row in rows:
            cores = f", server {row['server_cores']:.2f} cores" if "server_cores" in row else ""
            print(
                f"{label:13s} {row['concurrency']:2d} in flight: {row['sentences_per_s']:6.2f} sentences/s "
                f"({row['vs_serial']:.2f}x serial), median first audio {row['median_first_audio_s']:.3f} s{cores}"
            )
    return out


def soak(args: argparse.Namespace) -> dict:
    curve: list[tuple[int, float]] = []
    errors = 0
    with tempfile.TemporaryDirectory() as voices:
        server = ServerProcess.start(args.model, Path(voices), "--threads", str(args.threads), "--max-active",
                                     str(args.concurrency), timeout=STARTUP_S)  # fmt: skip
        url = server.url
        try:
            ensure_voice(url)
            done = 0
            with ThreadPoolExecutor(args.concurrency) as pool:
                while done < args.requests:
                    batch = min(args.every, args.requests - done)
                    for r in pool.map(lambda s: _safe(url, s), range(done, done + batch)):
                        errors += r is None
                    done += batch
                    rss = httpx.get(url + "/health", timeout=30).json()["rss_mb"]
                    curve.append((done, rss))
                    print(f"{done:6d} requests  RSS {rss:8.1f} MB", flush=True)
        finally:
            server.stop()
    warm = next(rss for n, rss in curve if n >= args.requests // 10)
    growth = (curve[-1][1] - warm) / warm
    print(f"RSS after warm-up {warm:.1f} MB, at the end {curve[-1][1]:.1f} MB: growth {growth * 100:+.2f} %; "
          f"{errors} failed requests")  # fmt: skip
    return {
        "model": str(args.model),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "errors": errors,
        "rss_after_warmup_mb": warm,
        "rss_end_mb": curve[-1][1],
        "growth": round(growth, 4),
        "curve": curve,
    }


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank: a value that was measured, never interpolated)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency(args: argparse.Namespace) -> dict:
    firsts: dict[float, list[float]] = {gap: [] for gap in args.idle}
    failed: dict[float, int] = dict.fromkeys(args.idle, 0)  # refused (random weights: "no speech") or no audio
    with tempfile.TemporaryDirectory() as voices:
        server = ServerProcess.start(args.model, Path(voices), "--threads", str(args.threads), timeout=STARTUP_S)
        try:
            ensure_voice(server.url)
            one(server.url, 999, SHORT_TEXT)  # warm-up: the voice's caches, the first call of each graph
            for i in range(args.requests):
                for gap in args.idle:
                    time.sleep(gap)
                    try:
                        r = one(server.url, i, SHORT_TEXT)
                    except httpx.HTTPError as e:
                        print(f"request {i} after {gap} s idle failed: {e}", file=sys.stderr)
                        r = {"audio": 0.0}
                    if r["audio"] > 0:
                        firsts[gap].append(round(r["first"], 3))
                    else:
                        failed[gap] += 1
        finally:
            server.stop()
    rows = []
    for gap, values in firsts.items():
        if not values:
            raise SystemExit(f"no request after {gap} s idle gave audio ({failed[gap]} failed)")
        row = {"idle_s": gap, "requests": len(values), "failed": failed[gap],
               "median_first_audio_s": quantile(values, 0.5),
               "p90_first_audio_s": quantile(values, 0.9), "worst_first_audio_s": max(values),
               "first_audio_s": values}  # fmt: skip
        rows.append(row)
        print(f"after {gap:5.1f} s idle: first audio median {row['median_first_audio_s']:.3f} s, "
              f"90th percentile {row['p90_first_audio_s']:.3f} s, worst {row['worst_first_audio_s']:.3f} s "
              f"({len(values)} requests)")  # fmt: skip
    return {"machine": platform.processor() or platform.machine(), "model": str(args.model), "text": SHORT_TEXT,
            "threads": args.threads, "rows": rows}  # fmt: skip


def _safe(url: str, seed: int) -> dict | None:
    try:
        return one(url, seed, "Pump three is hot." if seed % 2 else TEXT)
    except httpx.HTTPError as e:
        print(f"request {seed} failed: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["batching", "soak", "latency"])
    p.add_argument("-m", "--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", default=None, help="batching: list (default 1,4,8); soak: one number (4)")
    p.add_argument("--requests", type=int, default=None,
                   help="batching: per level (16); soak: total (2000); latency: per idle gap (20)")  # fmt: skip
    p.add_argument("--idle", default="0,10", help="latency: seconds idle before each request, a list taking turns")
    p.add_argument("--every", type=int, default=50, help="soak: RSS sample interval in requests")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.mode == "batching":
        args.concurrency = [int(x) for x in (args.concurrency or "1,4,8").split(",")]
        args.requests = args.requests or 16
        result = batching(args)
    elif args.mode == "latency":
        args.idle = [float(x) for x in args.idle.split(",")]
        args.requests = args.requests or 20
        result = latency(args)
    else:
        args.concurrency = int(args.concurrency or 4)
        args.requests = args.requests or 2000
        result = soak(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        if args.mode == "soak":
            plot_soak(result, args.json.with_suffix(".png"))
    return result


def plot_soak(result: dict, out: Path) -> None:
    """The RSS curve of a soak run as a PNG (needs matplotlib, the [bench] extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, rss = zip(*result["curve"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(n, rss, marker=".")
    ax.axhline(result["rss_after_warmup_mb"] * 1.05, color="red", linestyle="--", label="+5 % of after warm-up")
    ax.set_xlabel("requests served")
    ax.set_ylabel("server RSS, MB")
    ax.set_ylim(0, max(rss) * 1.2)
    ax.set_title(f"soak: {result['requests']} requests, {result['concurrency']} in flight, "
                 f"growth {result['growth'] * 100:+.2f} %")  # fmt: skip
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
