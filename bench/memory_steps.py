"""Where a process's peak RSS is reached: the bench's single-stream task, step by step, in one process.

    python bench/memory_steps.py MODEL_DIR [--threads 2] [--runs 1] [--tokens 250] [--mmap-threshold-kb N]
                                           [--keep-weight-pages] [--backend auto]

Runs the steps of ``cosyvoice-cpu bench``'s single task in its order (load and register the voice, the LM alone,
the 4-row LM batch, a whole sentence at default quality, one at the fast preset, the streamed 8-character
sentence, the streamed 10 s sentence), then a whole sentence again (a server serving both modes meets one after
streams: with a second backend's estimator open by then, that can be where it peaks), and prints after each the
current RSS, the peak so far (``VmHWM``), what the step added to the peak, and the memory glibc's malloc holds
free in its heaps (``mallinfo2``: freed but not returned to the OS; "-" where glibc lacks it). Speed is not
measured here; ``cosyvoice-cpu bench`` measures the task's peak in its own process (its "peak RSS of the whole
engine" row), without the last step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cosyvoice_cpu.benchmark.tasks import (
    SHORT_TEXT,
    TEXT,
    first_audio,
    graph_backends,
    load,
    measure_e2e,
    measure_lm,
    measure_lm_batched,
    peak_rss_mb,
)
from cosyvoice_cpu.hardware.malloc import malloc_free_bytes
from cosyvoice_cpu.hardware.pages import status_mb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--short-tokens", type=int, default=50)
    ap.add_argument(
        "--mmap-threshold-kb",
        type=int,
        default=None,
        help="EngineConfig.malloc_mmap_threshold_kb (default: the engine's; 0 leaves malloc alone)",
    )
    ap.add_argument(
        "--keep-weight-pages",
        action="store_true",
        help="EngineConfig.release_weight_pages=False: keep the weight-file pages ORT touched at load",
    )
    ap.add_argument("--backend", default=None, help="EngineConfig.backend (default: the engine's, auto)")
    args = ap.parse_args()
    n, runs = args.tokens, args.runs
    state: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if args.mmap_threshold_kb is not None:
        extra["malloc_mmap_threshold_kb"] = args.mmap_threshold_kb
    if args.backend is not None:
        extra["backend"] = args.backend
    if args.keep_weight_pages:
        extra["release_weight_pages"] = False

    def setup() -> None:
        state["engine"], state["voice"] = load(args.model_dir, args.threads, **extra)

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("load + voice", setup),
        ("LM alone", lambda: measure_lm(state["engine"], state["voice"], n, runs)),
        ("LM, 4 rows", lambda: measure_lm_batched(state["engine"], state["voice"], 4)),
        ("whole sentence", lambda: measure_e2e(state["engine"], state["voice"], n, runs)),
        ("fast preset", lambda: measure_e2e(state["engine"], state["voice"], n, runs, flow_steps=5)),
        (
            "streamed, 8 characters",
            lambda: first_audio(state["engine"], state["voice"], SHORT_TEXT, args.short_tokens, runs),
        ),
        ("streamed, 10 s", lambda: first_audio(state["engine"], state["voice"], TEXT, n, runs)),
        # not in the bench's task: a server that serves both modes meets whole sentences after streams too
        ("whole, after streams", lambda: measure_e2e(state["engine"], state["voice"], n, runs)),
    ]
    print(f"{'step':24s} {'RSS MB':>8s} {'peak MB':>8s} {'+peak':>6s} {'malloc free MB':>15s}")
    last = 0.0
    for label, step in steps:
        step()
        peak, free = peak_rss_mb(), malloc_free_bytes()
        free_mb = "-" if free is None else f"{free / 2**20:.0f}"
        print(f"{label:24s} {status_mb('VmRSS') or 0:8.0f} {peak:8.0f} {peak - last:+6.0f} {free_mb:>15s}", flush=True)
        last = peak
    # which backend ran each graph (the --backend asked for, as the engine planned it)
    backends = graph_backends(state["engine"].plan)
    print("the engine's plan: " + ", ".join(f"{g} on {b}" for g, b in backends.items()), flush=True)
    state["engine"].close()


if __name__ == "__main__":
    main()
