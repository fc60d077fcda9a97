"""Streamed sentences under several chunk plans, alternated in one process: the streamed RTF and what a listener
waits for.

    python bench/chunk_plan_ab.py MODEL_DIR [--chunk-tokens 50,100,25] [--grid on|off|both] \
        [--first-chunk-tokens 10] [--steps 10[,7,5]] [--tokens 250] [--voice-seconds 3] [--runs 3] [--threads 2] \
        [--backend onnxruntime[,auto]]

One engine per ``--backend`` choice, the bench's registered voice (3 s unless ``--voice-seconds``: Fun-CosyVoice3's
chunk grid starts at the voice's length) and 10 s sentence (``tokens`` speech tokens forced), one warm-up sentence
per engine and step count (each count has its own prompt cache), then ``runs`` rounds in which every plan streams
the sentence once on every engine (plans and engines alternated, so they share the machine's load; the engines
stay loaded together). Per
plan, medians: first audio, streamed RTF (call to the last chunk, per second of audio), chunks, and the listener
of :class:`~cosyvoice_cpu.benchmark.text_stream.Playback` (starts at the first chunk, plays without pause while it
holds audio): how many times the audio ran dry and for how long in all.

A larger ``chunk_tokens`` re-runs the estimator's prompt and context and the encoder's window fewer times (less
work, a lower streamed RTF) but the listener waits for each longer chunk whole: the stall column says which
plan a listener is better served by. ``--steps`` below 10 stands in for a faster machine (less flow work), or
measures what a server's ``--flow-steps`` buys (several counts, comma-separated, are plans of their own).
Several ``--backend`` choices load one engine each (``auto``: the plan's OpenVINO graphs, e.g. the int4 LM of
``export --openvino-lm int4``), and every plan streams on each of them in turn.
``--grid off`` cuts the plain doubling instead of ending chunks on the flow's grid (Fun-CosyVoice3's attention
chunks, :class:`~cosyvoice_cpu.flow.common.ChunkPlan`), as the engine did before it had one.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from cosyvoice_cpu.benchmark.tasks import TEXT, _config, listen, load, medians
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream
from cosyvoice_cpu.flow.cosyvoice3_stream import CosyVoice3FlowStream

FLOW_STREAMS = (CosyVoice2FlowStream, CosyVoice3FlowStream)  # the engine's ChunkFlowStream kinds


@contextlib.contextmanager
def grid(on: bool) -> Iterator[None]:
    """The flows offer their grid (the default) or none (the plain doubling, as before ``ChunkPlan`` took a grid:
    a Fun-CosyVoice3 push then recomputes the attention chunk the push before ended inside)."""
    with contextlib.ExitStack() as stack:
        if not on:
            for kind in FLOW_STREAMS:
                stack.enter_context(mock.patch.object(kind, "grid", None))
        yield


def _counts(value: str) -> list[int]:
    """A comma list of positive whole numbers (``--chunk-tokens``, ``--steps``)."""
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"takes positive whole numbers, comma-separated, not {value!r}")
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--chunk-tokens", type=_counts, default="50,100,25", help="the plans' largest chunks")
    ap.add_argument("--first-chunk-tokens", type=int, default=10)
    ap.add_argument("--grid", choices=("on", "off", "both"), default="on",
                    help="chunks moved to the flow's grid (Fun-CosyVoice3's attention chunks) or not")  # fmt: skip
    ap.add_argument("--steps", type=_counts, default="10", help="Euler steps of the flow, comma-separated")
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--voice-seconds", type=float, default=3.0, help="the registered voice's length")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="onnxruntime", help="engine backends, comma-separated")
    args = ap.parse_args()
    grids = {"on": [True], "off": [False], "both": [True, False]}[args.grid]
    plans = {
        (n, on, steps): _config(args.tokens, stream=True, first_chunk_tokens=args.first_chunk_tokens,
                                chunk_tokens=n, flow_steps=steps)
        for n in args.chunk_tokens
        for on in grids
        for steps in args.steps
    }  # fmt: skip
    engines = {b: load(args.model_dir, args.threads, voice_seconds=args.voice_seconds, backend=b)
               for b in args.backend.split(",")}  # fmt: skip
    for engine, voice in engines.values():
        for steps in args.steps:  # warm-up: the voice's prompt cache (one per step count), the arenas
            listen(engine, voice, TEXT, next(c for (_, _, s), c in plans.items() if s == steps))
    rows: dict[tuple[str, int, bool, int], list[dict[str, float]]] = {(b, *key): [] for b in engines for key in plans}
    for _ in range(args.runs):
        for (n, on, steps), config in plans.items():
            for b, (engine, voice) in engines.items():
                with grid(on):
                    rows[b, n, on, steps].append(listen(engine, voice, TEXT, config))
    for engine, _ in engines.values():
        engine.close()
    print(f"{args.model_dir.name}, {args.tokens} tokens, first chunk {args.first_chunk_tokens} "
          f"tokens, a {args.voice_seconds:g} s voice ({voice.speech_tokens.size} tokens), {args.threads} threads; "
          f"medians of {args.runs}")  # fmt: skip
    print("\n| chunk_tokens | grid | chunks | first audio s | streamed RTF (runs) | stalls | stalled s | flow steps "
          "| backend |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for (b, n, on, steps), rs in rows.items():
        med = medians(rs)
        runs = ", ".join(f"{r['stream_rtf']:.3f}" for r in rs)
        print(f"| {n} | {'on' if on else 'off'} | {med['chunks']:.0f} | {med['first_audio_s']:.2f} | "
              f"{med['stream_rtf']:.3f} ({runs}) | {med['stalls']:g} | {med['stall_s']:.2f} | {steps} "
              f"| {b} |")  # fmt: skip


if __name__ == "__main__":
    main()
