"""The engine under two (or more) backend plans, measured side by side in one process.

    python bench/backend_ab.py MODEL_DIR [--backends onnxruntime,openvino] [--measure e2e[,lm,first,stream]] \
        [--threads 2] [--runs 4] [--tokens 250] [--compiled-shapes N] [--ov-precision bf16,f32]

``cosyvoice-cpu bench --backend onnxruntime,openvino`` runs each backend in its own process one after the other (so
each has its own peak RSS), which on a shared, noisy machine can put the two under different loads. Here the engines
of ``--backends`` (plans: ``auto``, ``onnxruntime``, ``openvino``) are loaded in one process and take turns on the
bench workload (the registered 3 s voice, a sentence forced to ``--tokens`` tokens, by default 10 s of audio;
default quality; ``e2e`` and ``lm`` each after their own warm-up run, the streams after one warm-up stream of each
kind per engine), so their ratio is measured under the same load. ``auto,openvino`` on a directory with an int8
``lm_ov`` compares the LM on ONNX Runtime and on OpenVINO with the same estimator. ``--ov-precision bf16,f32`` loads
every plan but ``onnxruntime`` once per OpenVINO compute precision (labelled ``PLAN@PRECISION``; without it, the
CPU's own, :func:`~cosyvoice_cpu.backends.openvino_precision.precision_for_cpu`); a stateful LM computes in f32
whatever it says.
Each run measures, per ``--measure``:

- ``e2e``: a whole sentence: flow RTF, end-to-end RTF, flow ms per Euler step;
- ``lm``: the LM alone (the bench's ``measure_lm``): prefill seconds (after the voice's prefix) and decode tokens/s;
- ``first``: the 8-character sentence streamed (``--short-tokens``): seconds to its first audio;
- ``stream``: the 10 s sentence streamed: first audio and the streamed RTF.

Prints per backend the medians with the ratio to the first backend (> 1: faster), and every run. Memory is not
compared here (one process holds all the engines).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cosyvoice_cpu.backends.base import ONNXRUNTIME, OPENVINO
from cosyvoice_cpu.backends.openvino_precision import PRECISIONS
from cosyvoice_cpu.backends.plan import CHOICES, describe
from cosyvoice_cpu.backends.registry import BACKENDS
from cosyvoice_cpu.benchmark.tasks import SHORT_TEXT, TEXT, _config, alternate, listen, load, measure_e2e, measure_lm
from cosyvoice_cpu.manifest import Manifest

if TYPE_CHECKING:
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.voices.voice import Voice

# measure -> (the keys printed, whether a larger value is better)
KEYS = {
    "e2e": (("flow_rtf", False), ("rtf", False), ("flow_ms_per_step", False)),
    "lm": (("lm_prefill_s", False), ("lm_decode_tok_s", True)),
    "first": (("short_first_audio_s", False),),
    "stream": (("first_audio_s", False), ("stream_rtf", False)),
}


def measures(names: list[str], tokens: int, short_tokens: int) -> Callable:
    """One run of every measure in ``names`` on one engine: the merged results."""

    def run(engine, voice) -> dict[str, float]:
        out: dict[str, float] = {}
        if "e2e" in names:
            out.update(measure_e2e(engine, voice, tokens, 1))
        if "lm" in names:
            out.update(measure_lm(engine, voice, tokens, 1))
        if "first" in names:
            r = listen(engine, voice, SHORT_TEXT, _config(short_tokens, stream=True))
            out["short_first_audio_s"] = r["first_audio_s"]
        if "stream" in names:
            out.update(listen(engine, voice, TEXT, _config(tokens, stream=True)))
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--backends", default="onnxruntime,openvino", help="the engines' plans, comma-separated")
    ap.add_argument("--measure", default="e2e", help=f"comma-separated: {', '.join(KEYS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None, help="speech tokens per sentence (default: 10 s of audio)")
    ap.add_argument("--short-tokens", type=int, default=None, help="tokens of the 8-character sentence (2 s)")
    ap.add_argument("--compiled-shapes", type=int, default=0, help="the OpenVINO engines' compiled_shapes (0: dynamic)")
    ap.add_argument("--ov-precision", default="", help="OpenVINO compute precisions, comma-separated (bf16, f32): "
                    "each plan but onnxruntime once per precision (default: the CPU's)")  # fmt: skip
    args = ap.parse_args()
    names, backends = args.measure.split(","), args.backends.split(",")
    if unknown := set(names) - set(KEYS):
        ap.error(f"--measure: unknown {sorted(unknown)}; choose from {', '.join(KEYS)}")
    if unknown := set(backends) - set(CHOICES):
        ap.error(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(CHOICES)}")
    if len(set(backends)) != len(backends):
        ap.error(f"--backends: each plan once (got {args.backends})")
    asked = args.ov_precision.split(",") if args.ov_precision else []
    if unknown := set(asked) - set(PRECISIONS):
        ap.error(f"--ov-precision: unknown {sorted(unknown)}; choose from {', '.join(PRECISIONS)}")
    if len(set(asked)) != len(asked):
        ap.error(f"--ov-precision: each precision once (got {args.ov_precision})")
    if asked and set(backends) == {ONNXRUNTIME}:
        ap.error("--ov-precision: no plan here runs OpenVINO (add auto or openvino to --backends)")
    precisions: list[str | None] = [*asked] or [None]
    rate = Manifest.load(args.model_dir).token_frame_rate
    tokens = args.tokens or round(10 * rate)
    short = args.short_tokens or round(2 * rate)
    streaming = bool({"first", "stream"} & set(names))
    shapes = args.compiled_shapes
    engines = {}
    for b in backends:
        for p in [None] if b == ONNXRUNTIME else precisions:
            label = b if p is None else f"{b}@{p}"
            engines[label] = load_at(p, args.model_dir, args.threads, backend=b, streaming_estimator=streaming,
                                     compiled_shapes=shapes)  # fmt: skip
    plans = {b: describe(engine.plan) for b, (engine, _) in engines.items()}
    report(compare(engines, names, args.runs, tokens, short), names, plans)


def load_at(precision: str | None, *args: object, **config: object) -> tuple[Engine, Voice]:
    """:func:`~cosyvoice_cpu.benchmark.tasks.load` with OpenVINO compiling at ``precision`` (None: the CPU's): the
    backend reads it when it opens a graph, so it holds for this engine only."""
    backend = BACKENDS[OPENVINO]
    before, backend.precision = backend.precision, precision
    try:
        return load(*args, **config)
    finally:
        backend.precision = before


def compare(
    engines: dict[str, tuple[Engine, Voice]], names: list[str], runs: int, tokens: int, short_tokens: int
) -> dict[str, list[dict[str, float]]]:
    """``runs`` alternated runs of the measures ``names`` on every engine (label -> every run's results), after one
    warm-up stream of each streamed kind per engine: each stream shape's first call (``e2e`` and ``lm`` warm up
    inside their own measure)."""
    if streamed := [n for n in names if n in ("first", "stream")]:
        warm = measures(streamed, tokens, short_tokens)
        for engine, voice in engines.values():
            warm(engine, voice)
    return alternate(engines, runs, measures(names, tokens, short_tokens))


def report(results: dict[str, list[dict[str, float]]], names: list[str], plans: dict[str, list[str]]) -> None:
    """Per engine: the medians of ``names``' keys with their ratio to the first engine's (> 1: faster), every
    run, and the engine's plan (``plans``: label -> lines; none for a label it lacks)."""
    first = None
    for label, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        first = first or med
        cells = []
        for name in names:
            for key, higher in KEYS[name]:
                ratio = med[key] / first[key] if higher else first[key] / med[key]
                cells.append(f"{key} {med[key]:.3f} ({ratio:.2f}x)")
        print(f"{label:14s} " + ", ".join(cells))
        for key, _ in (k for name in names for k in KEYS[name]):
            print(f"{'':14s} {key} runs: {', '.join(f'{r[key]:.3f}' for r in rs)}")
        for line in plans.get(label, ()):
            print(f"{'':14s} {line}")


if __name__ == "__main__":
    main()
