"""The engine on ONNX Runtime against the engine with the plan's OpenVINO graphs, measured side by side.

    python bench/backend_ab.py MODEL_DIR [--threads 2] [--runs 4] [--tokens 250]

``cosyvoice-cpu bench --backend onnxruntime,openvino`` runs each backend in its own process one after the other
(so each has its own peak RSS), which on a shared, noisy machine can put the two under different loads. Here both
engines are loaded in one process and take turns on the bench workload (the registered 3 s voice, a sentence
forced to ``--tokens`` tokens, by default 10 s of audio; default quality; each measurement after its own warm-up
run), so their ratio is measured under the same load. Prints per backend the median flow RTF, end-to-end RTF and
flow ms per Euler step, and every run's flow RTF. Memory is not compared here (one process holds both).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cosyvoice_cpu.backends.plan import describe
from cosyvoice_cpu.benchmark.tasks import alternate, load, measure_e2e
from cosyvoice_cpu.manifest import Manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None, help="speech tokens per sentence (default: 10 s of audio)")
    ap.add_argument("--compiled-shapes", type=int, default=0, help="the OpenVINO engine's compiled_shapes (0: dynamic)")
    args = ap.parse_args()
    if args.tokens is None:
        args.tokens = round(10 * Manifest.load(args.model_dir).token_frame_rate)
    shapes = {"onnxruntime": 0, "openvino": args.compiled_shapes}
    engines = {b: load(args.model_dir, args.threads, backend=b, streaming_estimator=False, compiled_shapes=n)
               for b, n in shapes.items()}  # fmt: skip
    plans = {b: describe(engine.plan) for b, (engine, _) in engines.items()}
    results = alternate(engines, args.runs, lambda engine, voice: measure_e2e(engine, voice, args.tokens, 1))
    base = None
    for b, rs in results.items():
        flow = statistics.median(r["flow_rtf"] for r in rs)
        base = base or flow
        e2e = statistics.median(r["rtf"] for r in rs)
        step = statistics.median(r["flow_ms_per_step"] for r in rs)
        runs = ", ".join(f"{r['flow_rtf']:.3f}" for r in rs)
        print(f"{b:12s} flow RTF {flow:.3f} ({base / flow:.2f}x), end-to-end RTF {e2e:.3f}, flow {step:.0f} ms/step "
              f"(runs: {runs})")  # fmt: skip
        for line in plans[b]:
            print(f"{'':12s} {line}")


if __name__ == "__main__":
    main()
