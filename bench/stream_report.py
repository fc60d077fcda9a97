"""Streaming flow: cost per chunk and mel error of the bounded context, against the official O(n^2) recompute.

    python bench/stream_report.py MODEL_DIR [--threads 2] [--tokens 250] [--prompt-tokens 75] [--json OUT]

Forced random speech tokens (weights are random too: the LM is not involved), a 3 s prompt and 10 s of output
by default, the default chunk plan (15 tokens, then doubling to 50). Modes, all on the same tokens:

- ``whole``: one non-streaming flow call (full attention), the reference for cost;
- ``official``: the work the official streaming does per chunk: encode every token so far and solve the whole
  prefix (prompt + all frames) again, keeping only the new frames (O(n^2)); timed with our full-attention
  estimator, which costs the same as the chunk-causal one;
- ``exact``: :class:`CosyVoice2FlowStream` with unbounded context (cached activations; equals a one-shot chunk-causal
  solve);
- ``ctx=N``: :class:`CosyVoice2FlowStream` with N tokens of context (the engine default is 25).

All streams share one prompt cache (a registered voice); its one-off build time and size are reported.

Prints a markdown table and writes JSON. Timing is one run on a shared machine: read ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.flow.common import ChunkPlan
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream, CosyVoice2PromptCache
from cosyvoice_cpu.manifest import Manifest


def _inputs(n_prompt: int, n_tok: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return (rng.integers(0, 6561, n_prompt), rng.integers(0, 6561, n_tok),
            (rng.standard_normal((2 * n_prompt, 80)) - 4).astype(np.float32) * 0.5,
            rng.standard_normal(192).astype(np.float32))  # fmt: skip


def _chunks(n_tok: int, lookahead: int) -> list[tuple[int, int, bool]]:
    plan = ChunkPlan(15, 50, lookahead)
    cuts = []
    while plan.ready(n_tok):
        cuts.append((*plan.cut(), False))
    return [*cuts, (plan.offset, n_tok, True)]


def run_stream(stage: CosyVoice2Flow, inputs: tuple[np.ndarray, ...], context: int | None,
               cache: CosyVoice2PromptCache) -> tuple[np.ndarray, list[float]]:  # fmt: skip
    prompt, toks, feat, emb = inputs
    fs = CosyVoice2FlowStream(stage, prompt, feat, emb, context_tokens=context, prompt_cache=cache)
    mels, times = [], []
    for a, b, final in _chunks(len(toks), fs.lookahead):
        t0 = time.perf_counter()
        mels.append(fs.push(toks[a:b], None if final else toks[b : b + fs.lookahead]))
        times.append(time.perf_counter() - t0)
    return np.concatenate(mels, axis=2), times


def run_official(stage: CosyVoice2Flow, inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, list[float]]:
    """Per chunk: the whole prefix again (encoder + every Euler step over prompt + all frames so far)."""
    prompt, toks, feat, emb = inputs
    look = stage.settings.pre_lookahead_len
    mels, times = [], []
    for a, b, final in _chunks(len(toks), look):
        t0 = time.perf_counter()
        mel = stage.inference(
            toks[:b], prompt, feat, emb, context=None if final else toks[b : b + look], streaming=True
        )  # fmt: skip (chunk-causal encoder, full-attention estimator)
        mels.append(mel[:, :, 2 * a :])
        times.append(time.perf_counter() - t0)
    return np.concatenate(mels, axis=2), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--contexts", default="0,10,25,50,100")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    m = Manifest.load(args.model_dir)
    stage = CosyVoice2Flow.from_dir(args.model_dir, m.flow, threads=args.threads)
    inputs = _inputs(args.prompt_tokens, args.tokens)
    stage.inference(inputs[1][:20], inputs[0], inputs[2], inputs[3])  # warm-up
    t0 = time.perf_counter()
    whole = stage.inference(inputs[1], inputs[0], inputs[2], inputs[3])
    rows = {"whole": {"total_s": time.perf_counter() - t0, "chunk_s": []}}
    t0 = time.perf_counter()
    cache = CosyVoice2PromptCache.build(stage, inputs[0], inputs[2], inputs[3])
    build_s = time.perf_counter() - t0
    exact, times = run_stream(stage, inputs, None, cache)
    rows["exact"] = {"total_s": sum(times), "chunk_s": times}
    _, times = run_official(stage, inputs)
    rows["official"] = {"total_s": sum(times), "chunk_s": times, "mel_l1_vs_exact": None}
    for ctx in (int(c) for c in args.contexts.split(",")):
        mel, times = run_stream(stage, inputs, ctx, cache)
        rows[f"ctx={ctx}"] = {"total_s": sum(times), "chunk_s": times,
                              "mel_l1_vs_exact": float(np.abs(mel - exact).mean())}  # fmt: skip
    for row in rows.values():
        row.setdefault("mel_l1_vs_exact", 0.0 if row is rows["exact"] else None)
    rows["whole"]["mel_l1_vs_exact"] = float(np.abs(whole - exact).mean())

    audio_s = args.tokens / 25
    result = {
        "model": str(args.model_dir), "recipe": m.recipe["name"], "threads": args.threads,
        "machine": platform.processor() or platform.machine(), "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "audio_s": audio_s, "mel_abs_mean": float(np.abs(exact).mean()),
        "chunks": _chunks(args.tokens, stage.settings.pre_lookahead_len), "rows": rows,
        "prompt_cache": {"build_s": build_s, "mb": cache.nbytes / 1e6},
    }  # fmt: skip
    print(f"{args.tokens} tokens ({audio_s:.0f} s), prompt {args.prompt_tokens} tokens, recipe {m.recipe['name']}, "
          f"{args.threads} threads; mean |mel| {result['mel_abs_mean']:.3f}; prompt cache built once in "
          f"{build_s:.2f} s, {cache.nbytes / 1e6:.0f} MB\n")  # fmt: skip
    print("| mode | flow s | flow RTF | first chunk s | last chunk s | mel L1 vs exact |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        cs = row["chunk_s"]
        err = "" if row["mel_l1_vs_exact"] is None else f"{row['mel_l1_vs_exact']:.4f}"
        print(f"| {name} | {row['total_s']:.2f} | {row['total_s'] / audio_s:.3f} | "
              f"{cs[0] if cs else float('nan'):.2f} | {cs[-1] if cs else float('nan'):.2f} | {err} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
