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
import tempfile
from pathlib import Path

from cosyvoice_cpu.benchmark import PROMPT_TEXT, _prompt_wav, measure_e2e
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    engines = {}
    for label, streaming in (("stream graph (default)", True), ("flow_estimator.onnx", False)):
        engine = Engine.load(args.model_dir, EngineConfig(threads=args.threads, streaming_estimator=streaming))
        with tempfile.TemporaryDirectory() as tmp:
            voice = engine.make_voice(_prompt_wav(Path(tmp) / "prompt.wav"), PROMPT_TEXT, name="bench")
        engines[label] = (engine, voice)
    results: dict[str, list[dict[str, float]]] = {label: [] for label in engines}
    for _ in range(args.runs):
        for label, (engine, voice) in engines.items():
            results[label].append(measure_e2e(engine, voice, 250, 1))
    for label, rs in results.items():
        steps, rtf = [r["flow_ms_per_step"] for r in rs], statistics.median(r["rtf"] for r in rs)
        print(f"{label:24s} flow {statistics.median(steps):.1f} ms/step, RTF {rtf:.3f}"
              f"  (runs: {', '.join(f'{x:.0f}' for x in steps)}; sessions {sorted(engines[label][0].flow._sessions)})")
    for engine, _ in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
