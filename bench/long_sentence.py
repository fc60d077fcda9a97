"""Memory of a long sentence: its peak RSS and what the process keeps after it.

    python bench/long_sentence.py MODEL_DIR [--tokens 750] [--flow-steps 1] [--threads 2]
                                  [--window-frames N] [--shrink-frames N]

Loads the engine as ``cosyvoice-cpu bench`` does (a registered 3 s voice), then speaks the bench sentence forced
to 250 speech tokens (10 s: the usual working size of ORT's arena), one forced to ``--tokens`` (750: 30 s), and
the 250-token one again, printing after each the RSS, the peak so far and the wall time. ``--window-frames`` and
``--shrink-frames`` set ``EngineConfig.vocoder_window_frames`` / ``arena_shrink_frames`` (default: the engine's;
0 turns each off). ``--flow-steps`` defaults to 1: the estimator's memory does not depend on the step count, and
ten steps over 1650 frames take minutes on 2 cores, so the times printed are not the default quality's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.benchmark.machine import peak_rss_mb
from cosyvoice_cpu.benchmark.tasks import TEXT, _config, load
from cosyvoice_cpu.engine import Timings
from cosyvoice_cpu.hardware.pages import status_mb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=750)
    ap.add_argument("--flow-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window-frames", type=int, default=None, help="EngineConfig.vocoder_window_frames")
    ap.add_argument("--shrink-frames", type=int, default=None, help="EngineConfig.arena_shrink_frames")
    args = ap.parse_args()
    extra: dict[str, Any] = {}
    if args.window_frames is not None:
        extra["vocoder_window_frames"] = args.window_frames
    if args.shrink_frames is not None:
        extra["arena_shrink_frames"] = args.shrink_frames
    engine, voice = load(args.model_dir, args.threads, **extra)
    print(f"window {engine.vocoder.window_frames} frames (context {engine.vocoder.context}), "
          f"shrink after encoder calls over {engine.flow.arena_shrink_frames} frames")  # fmt: skip
    print(f"{'sentence':18s} {'wall s':>7s} {'LM s':>6s} {'flow s':>7s} {'vocoder s':>9s} {'RSS MB':>7s} "
          f"{'peak MB':>8s}")  # fmt: skip
    print(f"{'load + voice':18s} {'':41s} {status_mb('VmRSS') or 0:7.0f} {peak_rss_mb():8.0f}", flush=True)
    for tokens in (250, args.tokens, 250):
        t, t0 = Timings(), time.perf_counter()
        chunks = engine.synthesize(TEXT, voice, _config(tokens, flow_steps=args.flow_steps), timings=t)
        wave = np.concatenate([c.samples for c in chunks])
        wall = time.perf_counter() - t0
        label = f"{tokens} tokens ({len(wave) / engine.sample_rate:.0f} s)"
        print(f"{label:18s} {wall:7.1f} {t.lm:6.1f} {t.flow:7.1f} {t.vocoder:9.2f} {status_mb('VmRSS') or 0:7.0f} "
              f"{peak_rss_mb():8.0f}", flush=True)  # fmt: skip
        assert np.isfinite(wave).all()
    engine.close()


if __name__ == "__main__":
    main()
