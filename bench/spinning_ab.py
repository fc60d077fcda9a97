"""ORT thread spinning on or off (``EngineConfig.spinning``), side by side in one process.

    python bench/spinning_ab.py MODEL_DIR [--threads 2] [--runs 3] [--lm-spin-us 100,1000]

Two engines on one model directory, one with spinning pool threads and one without (the default), take turns
on the same workload as ``cosyvoice-cpu bench``: a whole 10 s sentence (RTF), the LM alone (decode ms per
token), the streamed 10 s sentence (first audio and streamed RTF) and four whole sentences on four threads at
once (wall seconds). Prints every run and the medians.

``--lm-spin-us`` replaces the all-sessions spinning engine with engines whose LM session alone spins, each for at
most the given microseconds before its pool thread sleeps (ORT's ``session.intra_op.spin_duration_us``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from cosyvoice_cpu.benchmark.tasks import TEXT, _config, alternate, first_audio, load, measure_e2e, measure_lm


def four_at_once(engine: Any, voice: Any, tokens: int) -> float:
    """Wall seconds for four whole sentences synthesized on four threads sharing ``engine``."""

    def one() -> None:
        for _ in engine.synthesize(TEXT, voice, _config(tokens)):
            pass

    threads = [threading.Thread(target=one) for _ in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def lm_spinning(engine: Any, model_dir: Path, threads: int, spin_us: int) -> None:
    """Give ``engine`` an LM session whose pool thread spins for at most ``spin_us`` (the other options as
    ``sessions.make_session``'s defaults)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    for key, value in (
        ("session.intra_op.allow_spinning", "1"),
        ("session.inter_op.allow_spinning", "0"),
        ("session.intra_op.spin_duration_us", str(spin_us)),
        ("session.use_env_allocators", "1"),
    ):
        so.add_session_config_entry(key, value)
    engine.lm.session.session = ort.InferenceSession(str(model_dir / "lm.onnx"), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--lm-spin-us", default=None, help="comma list of LM-only spin durations (microseconds)")
    args = ap.parse_args()
    n = args.tokens
    engines = {"spinning off": load(args.model_dir, args.threads)}
    if args.lm_spin_us is None:
        engines["spinning on"] = load(args.model_dir, args.threads, spinning=True)
    for us in [] if args.lm_spin_us is None else [int(x) for x in args.lm_spin_us.split(",")]:
        engines[f"LM {us} us"] = load(args.model_dir, args.threads)
        lm_spinning(engines[f"LM {us} us"][0], args.model_dir, args.threads, us)

    def measure(engine: Any, voice: Any) -> dict[str, float]:
        row = {"e2e_rtf": measure_e2e(engine, voice, n, 1)["rtf"], **first_audio(engine, voice, TEXT, n, 1)}
        row["lm_decode_ms"] = measure_lm(engine, voice, n, 1)["lm_decode_ms"]
        row["four_at_once_s"] = four_at_once(engine, voice, n)
        return row

    for label, rows in alternate(engines, args.runs, measure).items():
        for key in rows[0]:
            values = [r[key] for r in rows]
            print(f"{label:13s} {key:15s} median {statistics.median(values):8.3f}   runs "
                  + " ".join(f"{v:.3f}" for v in values))  # fmt: skip


if __name__ == "__main__":
    main()
