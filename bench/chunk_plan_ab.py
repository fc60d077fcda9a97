"""Streamed sentences under several chunk plans, alternated in one process: the streamed RTF and what a listener
waits for.

    python bench/chunk_plan_ab.py MODEL_DIR [--chunk-tokens 50,100,25] [--first-chunk-tokens 10] \
        [--steps 10] [--tokens 250] [--runs 3] [--threads 2] [--backend onnxruntime]

One engine, the bench's registered 3 s voice and 10 s sentence (``tokens`` speech tokens forced), one warm-up
sentence, then ``runs`` rounds in which every plan streams the sentence once (plans alternated, so they share
the machine's load). Per plan, medians: first audio, streamed RTF (call to the last chunk, per second of audio),
chunks, and the listener of :class:`~cosyvoice_cpu.benchmark.text_stream.Playback` (starts at the first chunk,
plays without pause while it holds audio): how many times the audio ran dry and for how long in all.

A larger ``chunk_tokens`` re-runs the estimator's prompt and context and the encoder's window fewer times (less
work, a lower streamed RTF) but the listener waits for each longer chunk whole: the stall column says which
plan a listener is better served by. ``--steps`` below 10 stands in for a faster machine (less flow work).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cosyvoice_cpu.benchmark.tasks import TEXT, _config, listen, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--chunk-tokens", default="50,100,25", help="the plans' largest chunks, comma-separated")
    ap.add_argument("--first-chunk-tokens", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="Euler steps of the flow")
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="onnxruntime")
    args = ap.parse_args()
    sizes = [int(s) for s in args.chunk_tokens.split(",")]
    engine, voice = load(args.model_dir, args.threads, backend=args.backend)
    plans = {
        n: _config(args.tokens, stream=True, first_chunk_tokens=args.first_chunk_tokens, chunk_tokens=n,
                   flow_steps=args.steps)
        for n in sizes
    }  # fmt: skip
    listen(engine, voice, TEXT, plans[sizes[0]])  # warm-up: the voice's prompt cache, the arenas
    rows: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
    for _ in range(args.runs):
        for n in sizes:
            rows[n].append(listen(engine, voice, TEXT, plans[n]))
    engine.close()
    print(f"{args.model_dir.name}, {args.tokens} tokens, {args.steps} steps, first chunk {args.first_chunk_tokens} "
          f"tokens, {args.threads} threads, {args.backend}; medians of {args.runs}")  # fmt: skip
    print("\n| chunk_tokens | chunks | first audio s | streamed RTF (runs) | stalls | stalled s |")
    print("|---|---|---|---|---|---|")
    for n, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        runs = ", ".join(f"{r['stream_rtf']:.3f}" for r in rs)
        print(f"| {n} | {med['chunks']:.0f} | {med['first_audio_s']:.2f} | {med['stream_rtf']:.3f} ({runs}) | "
              f"{med['stalls']:.0f} | {med['stall_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
