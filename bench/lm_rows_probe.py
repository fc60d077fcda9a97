"""What running a lone LM row beside an idle one (``LMSession.min_rows=2``, the ``int4`` LM's setting) costs, and
what ``int4`` gains over ``int8w``: one stream's prefill and decode on exported model directories, side by side.

    python bench/lm_rows_probe.py INT4_DIR INT8W_DIR [--runs 5] [--steps 50] [--threads 2]
    python bench/lm_rows_probe.py INT4_DIR INT8W_DIR --stream [--runs 3]

Opens the LM of each directory (the ``int4`` one twice: with ``min_rows`` 1 and 2), then per run and session in
turn: a 166-position prefill (the bench's prompt length) and ``--steps`` decode steps of random speech tokens on a
fresh cache. Prints medians of the prefill time and the decode ms per token, and the largest difference between a
lone row's log-probabilities and the same row in a 2-row batch for each session (0 = the same bits).

``--stream``: the three as whole engines instead (the bench's registered 3 s voice), each streaming the bench's
10 s sentence (250 forced tokens) in turn, after a warm-up; the LM decodes in the scheduler's thread beside the
flow of earlier chunks, so this shows what the padded row's compute costs when the two cores are shared. Prints
the medians of the first audio and of the whole streamed RTF.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

PROMPT = 166


def _open(model_dir: Path, threads: int, min_rows: int | None):  # -> LMSession
    from cosyvoice_cpu.lm.session import LMSession
    from cosyvoice_cpu.manifest import Manifest

    return LMSession.from_dir(model_dir, Manifest.load(model_dir).graphs["lm"].attrs, threads=threads,
                              min_rows=min_rows)  # fmt: skip


def _timed(session, prompt: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
    """(prefill s, decode ms per token) of one stream."""
    cache = session.new_cache(1)
    t0 = time.perf_counter()
    session.prefill(cache, 0, prompt)
    t1 = time.perf_counter()
    for t in tokens:
        session.decode(cache, [0], [int(t)])
    return t1 - t0, (time.perf_counter() - t1) / len(tokens) * 1e3


def _batch_gap(session, prompt: np.ndarray, tokens: np.ndarray) -> float:
    """Max |logp| difference between row 0 run alone and beside a second stream, over a prefill and 8 steps."""
    alone_cache, both = session.new_cache(1), session.new_cache(2)
    alone = [session.prefill(alone_cache, 0, prompt)]
    pair = [session.prefill(both, 0, prompt)]
    session.prefill(both, 1, prompt[: PROMPT // 2])
    for t in tokens[:8]:
        alone.append(session.decode(alone_cache, [0], [int(t)])[0])
        pair.append(session.decode(both, [0, 1], [int(t), int(t)])[0])
    return float(np.abs(np.stack(alone) - np.stack(pair)).max())


def _stream(args: argparse.Namespace) -> None:
    from cosyvoice_cpu.benchmark.tasks import TEXT, alternate, first_audio, load

    engines = {"int4, min_rows 1": load(args.int4_dir, args.threads), "int4, min_rows 2": load(args.int4_dir,
               args.threads), "int8w": load(args.int8w_dir, args.threads)}  # fmt: skip
    engines["int4, min_rows 1"][0].lm.session.runner.min_rows = 1  # the scheduler's cache has rows to spare
    results = alternate(engines, args.runs, lambda engine, voice: first_audio(engine, voice, TEXT, 250, 1))
    print(f"{args.threads} threads, {args.runs} runs alternated, streamed 10 s sentence (250 tokens), medians")
    print("| LM | first audio, s | whole streamed RTF | runs (RTF) |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        rtfs = [r["stream_rtf"] for r in rs]
        print(
            f"| {name} | {statistics.median(r['first_audio_s'] for r in rs):.3f} | {statistics.median(rtfs):.3f} "
            f"| {', '.join(f'{x:.3f}' for x in rtfs)} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("int4_dir", type=Path)
    ap.add_argument("int8w_dir", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream", action="store_true", help="streamed sentences on whole engines instead")
    args = ap.parse_args()
    if args.stream:
        _stream(args)
        return
    sessions = {
        "int4, min_rows 1": _open(args.int4_dir, args.threads, 1),
        "int4, min_rows 2": _open(args.int4_dir, args.threads, 2),
        "int8w": _open(args.int8w_dir, args.threads, None),
    }
    rng = np.random.default_rng(0)
    hidden = next(iter(sessions.values())).spec.hidden
    prompt = rng.standard_normal((PROMPT, hidden)).astype(np.float32) * 0.02
    tokens = rng.integers(0, 6561, args.steps)
    for s in sessions.values():  # warm-up
        _timed(s, prompt, tokens[:5])
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in sessions}
    for _ in range(args.runs):
        for name, s in sessions.items():
            times[name].append(_timed(s, prompt, tokens))
    print(f"{args.threads} threads, {args.runs} runs alternated, {args.steps} decode steps, medians")
    print("| LM | prefill 166 positions, s | decode ms per token | tokens/s | lone vs batched row, max abs logp |")
    print("|---|---|---|---|---|")
    for name, s in sessions.items():
        pre = statistics.median(p for p, _ in times[name])
        dec = statistics.median(d for _, d in times[name])
        print(f"| {name} | {pre:.3f} | {dec:.2f} | {1e3 / dec:.1f} | {_batch_gap(s, prompt, tokens):.2e} |")


if __name__ == "__main__":
    main()
