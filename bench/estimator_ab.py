"""Whole sentences on the stream graph (the default engine: one estimator for both modes) against
``flow_estimator.onnx`` (``EngineConfig(streaming_estimator=False)``), measured side by side.

    python bench/estimator_ab.py MODEL_DIR [--threads 2] [--runs 4]

Both engines are loaded in one process and run alternately on the bench workload (the registered 3 s voice, a
10 s sentence forced to 250 tokens, default quality; each measurement after its own warm-up run). Prints the
median flow ms per Euler step and end-to-end RTF of each, every run's flow ms per step, and which estimator
sessions each engine opened. Memory is not compared here (one process holds both): ``cosyvoice-cpu bench``
measures it per process.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cosyvoice_cpu.benchmark.tasks import alternate, load, measure_e2e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    engines = {
        label: load(args.model_dir, args.threads, streaming_estimator=streaming)
        for label, streaming in (("stream graph (default)", True), ("flow_estimator.onnx", False))
    }
    # alternately; each measurement after its own warm-up run
    results = alternate(engines, args.runs, lambda engine, voice: measure_e2e(engine, voice, 250, 1))
    sessions = {label: sorted(engine.flow._sessions) for label, (engine, _) in engines.items()}
    for label, rs in results.items():
        steps, rtf = [r["flow_ms_per_step"] for r in rs], statistics.median(r["rtf"] for r in rs)
        print(
            f"{label:24s} flow {statistics.median(steps):.1f} ms/step, RTF {rtf:.3f}"
            f"  (runs: {', '.join(f'{x:.0f}' for x in steps)}; estimator sessions opened {sessions[label]})"
        )


if __name__ == "__main__":
    main()
