"""What each frame bucket costs the OpenVINO flow estimator under one dynamic compile (the runtime's default).

``python bench/ov_bucket_memory.py -m DIR`` opens ``DIR``'s ``flow_estimator.ov.xml`` through the runtime's OpenVINO
backend (``max_shapes`` 0: one dynamic compile), then calls it once per bucket of
:mod:`cosyvoice_cpu.backends.buckets` (batch 2, the guidance pair), smallest first, twice over. Per call it prints the
frames, the process RSS after it and the call's time: the first pass shows what a bucket's first call costs
(kernels made for that shape, kept afterwards), the second whether memory grows further. ``--max-frames`` bounds
the largest bucket (long ones take seconds per call). Results go to ``--out`` as JSON.

``--unpadded N`` instead calls N distinct lengths (100, 105, 110, ... frames) once each, as an unpadded graph is
fed, and records the session's compiles with the RSS: the session recompiles after
``backends.openvino.DYNAMIC_SHAPES`` shapes, which gives their kernels back.

``--release`` makes every call give its working memory back (``release_memory``, as the flow's last Euler step of
a sentence does), so the RSS is what a shape leaves behind; ``--property KEY=VALUE`` (repeatable) sets a CPU-plugin
property before the compile (e.g. ``SNIPPETS_MODE=DISABLE``, ``CPU_RUNTIME_CACHE_CAPACITY=0``), to measure what a
knob gives back against what it costs per call (the properties the backend sets on every compile, threads,
latency and precision hints, cannot be changed here). Each row records the anonymous part of the RSS too, and the
report counts the fused subgraphs in the compiled model (``SNIPPETS_MODE=DISABLE`` leaves none).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.buckets import bucket
from cosyvoice_cpu.backends.openvino import OpenVino
from cosyvoice_cpu.benchmark.feeds import estimator_feeds
from cosyvoice_cpu.hardware.pages import status_mb

# compile properties OpenVino.open sets itself (they win over a property set on the plugin)
BACKEND_SET = ("PERFORMANCE_HINT", "INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model-dir", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-frames", type=int, default=2048)
    ap.add_argument("--unpadded", type=int, default=0, help="call this many distinct lengths instead of buckets")
    ap.add_argument("--release", action="store_true", help="every call gives its working memory back")
    ap.add_argument("--property", action="append", default=[], metavar="KEY=VALUE", help="a CPU-plugin property")
    ap.add_argument("--out", default=None, help="JSON report (default bench/results/ov-bucket-memory[-unpadded].json)")
    args = ap.parse_args()
    out = args.out or f"bench/results/ov-bucket-memory{'-unpadded' if args.unpadded else ''}.json"
    properties = dict(_property(ap, p) for p in args.property)
    # recompiles load from OpenVINO's model cache, as the runtime's do (a fresh one where properties are set, so no
    # model compiled under other ones is loaded)
    cache = "" if not args.unpadded else (tempfile.mkdtemp(prefix="ov-cache-") if properties else None)
    backend = OpenVino(cache_dir=cache)
    if properties:
        backend.core().set_property("CPU", properties)
    session = backend.open(Path(args.model_dir) / "flow_estimator.ov.xml", SessionConfig(threads=args.threads))
    rng = np.random.default_rng(0)
    rows = []
    start = round(status_mb("VmRSS") or 0)
    sizes = sorted({bucket(n) for n in range(50, args.max_frames + 1)})
    passes = [sizes, sizes] if not args.unpadded else [[100 + 5 * i for i in range(args.unpadded)]]
    for rep, lengths in enumerate(passes):
        for t in lengths:
            feeds = estimator_feeds(t, rng)
            t0 = time.perf_counter()
            session.run(None, feeds, release_memory=args.release)
            seconds = time.perf_counter() - t0
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            rss = round(status_mb("VmRSS") or 0)
            rows.append({"pass": rep + 1, "frames": t, "rss_mb": rss, "anon_mb": round(status_mb("RssAnon") or 0),
                         "seconds": round(seconds, 3), "compiles": session.compiles})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    runtime = session.compiled({k: v.shape for k, v in feeds.items()}).get_runtime_model()
    subgraphs = sum(op.get_rt_info()["layerType"].astype(str) == "Subgraph" for op in runtime.get_ops())
    report = {"model_dir": str(args.model_dir), "threads": args.threads, "rss_before_mb": start,
              "release": args.release, "properties": properties, "fused_subgraphs": subgraphs,
              "date": time.strftime("%Y-%m-%d"), "calls": rows}  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    if cache and properties:
        shutil.rmtree(cache, ignore_errors=True)  # the fresh cache made above


def _property(ap: argparse.ArgumentParser, text: str) -> tuple[str, str]:
    key, sep, value = (part.strip() for part in text.partition("="))
    if not sep or not key or not value:
        ap.error(f"--property takes KEY=VALUE, got {text!r}")
    if key in BACKEND_SET:
        ap.error(f"--property {key}: the backend sets it on every compile (--threads for the threads)")
    return key, value


if __name__ == "__main__":
    main()
