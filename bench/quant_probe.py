"""Load time, peak RSS and per-stage speed of the torch-free runtime on one exported model directory.

    python bench/quant_probe.py MODEL_DIR [--threads 2] [--size full]     # prints one JSON line

Runs in its own process with torch blocked, so the RSS is the runtime's alone. ``probe_runtime`` runs it as a
subprocess for ``quant_report.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.benchmark.feeds import estimator_feeds
from cosyvoice_cpu.benchmark.machine import peak_rss_mb

SHAPES = {"tiny": {"prefill": 60, "frames": 200, "voc_frames": 100}, "full": {"prefill": 100, "frames": 650,
                                                                               "voc_frames": 500}}  # fmt: skip


def _median_ms(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def probe(model_dir: Path, threads: int, size: str) -> dict:
    sys.modules["torch"] = None  # type: ignore[assignment]  # the runtime must not need it
    from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
    from cosyvoice_cpu.lm.session import LMSession
    from cosyvoice_cpu.manifest import Manifest
    from cosyvoice_cpu.vocoder.hift import Vocoder
    from cosyvoice_cpu.vocoder.source import SourceNoise

    shapes = SHAPES[size]
    t0 = time.perf_counter()
    m = Manifest.load(model_dir)
    lm = LMSession.from_dir(model_dir, m.graphs["lm"].attrs, threads=threads)
    flow = CosyVoice2Flow.from_dir(model_dir, m.flow, threads=threads)
    flow.split_rows = False  # one call per step, as the recorded figures were taken (EngineConfig.split_rows)
    voc = Vocoder.from_dir(model_dir, m.graphs["hift_decode"].attrs, threads=threads)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)

    emb = lm.embed_speech(rng.integers(0, 6561, shapes["prefill"]))
    cache = lm.new_cache(1)
    prefill_ms = _median_ms(lambda: (cache.reset(0), lm.prefill(cache, 0, emb)), 3)
    cache.reset(0)
    lm.prefill(cache, 0, emb)
    toks = iter(rng.integers(0, 6561, 200).tolist())
    decode_ms = _median_ms(lambda: lm.decode(cache, [0], [next(toks)]), 40)

    t = shapes["frames"]
    est_in = estimator_feeds(t, rng)
    est = flow.estimator
    estimator_ms = _median_ms(lambda: est.run(["estimator_out"], est_in), 3)

    mel = (rng.standard_normal((1, 80, shapes["voc_frames"])) - 5).astype(np.float32)
    cfg = voc.source_cfg
    noise = SourceNoise.draw(rng, 1, mel.shape[2] * cfg.upsample, cfg.harmonics)
    vocoder_ms = _median_ms(lambda: voc(mel, noise=noise), 3)
    return {
        "load_s": load_s,
        "lm_prefill_ms": prefill_ms,
        "lm_decode_ms": decode_ms,
        "estimator_ms": estimator_ms,
        "estimator_frames": t,
        "vocoder_ms": vocoder_ms,
        "vocoder_frames": shapes["voc_frames"],
        "runtime_peak_rss_mb": peak_rss_mb(),
    }


def probe_runtime(model_dir: Path, threads: int, size: str) -> dict:
    out = subprocess.run([sys.executable, __file__, str(model_dir), "--threads", str(threads), "--size", size],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", choices=list(SHAPES), default="full")
    a = ap.parse_args()
    print(json.dumps(probe(a.model_dir, a.threads, a.size)))
