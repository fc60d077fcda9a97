"""The LM/flow pipeline, measured side by side: streamed 10 s sentences with the LM decoding in the scheduler's
background thread (the engine's default, ``lm_batch_rows`` 4) against the LM in the caller's thread
(``lm_batch_rows=0``: each chunk's tokens are decoded only when the caller asks for the next chunk).

    python bench/pipeline_ab.py MODEL_DIR [--threads 2] [--runs 4] [--short]

Both engines are loaded in one process and run alternately (same workload as ``cosyvoice-cpu bench``: the
registered 3 s voice, 250 forced tokens, or with ``--short`` the 8-character sentence forced to 50 tokens; each
measurement follows a warm-up run); prints the medians of the first audio and of the whole streamed RTF, and
each run's RTF.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cosyvoice_cpu.benchmark.tasks import SHORT_TEXT, TEXT, alternate, first_audio, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--short", action="store_true", help="the 8-character sentence (50 tokens) instead")
    args = ap.parse_args()
    text, tokens = (SHORT_TEXT, 50) if args.short else (TEXT, 250)
    engines = {rows: load(args.model_dir, args.threads, lm_batch_rows=rows) for rows in (0, 4)}
    # alternately; each measurement after its own warm-up run
    results = alternate(engines, args.runs, lambda engine, voice: first_audio(engine, voice, text, tokens, 1))
    for rows, rs in results.items():
        label = "LM in the caller's thread (lm_batch_rows=0)" if rows == 0 else "LM ahead in its thread (default)"
        firsts = [r["first_audio_s"] for r in rs]
        rtfs = [r["stream_rtf"] for r in rs]
        print(
            f"{label:45s} first audio {statistics.median(firsts):.3f} s, streamed RTF {statistics.median(rtfs):.3f}"
            f"  (runs: {', '.join(f'{x:.3f}' for x in rtfs)})"
        )


if __name__ == "__main__":
    main()
