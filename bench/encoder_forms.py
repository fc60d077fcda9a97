"""The flow encoder in each weight form, alternated call by call at the token counts the engine calls it with.

    python bench/encoder_forms.py FP32_EXPORT_DIR [--tokens 85,115,153] [--whole 325] [--runs 7] [--threads 2] \
        --work DIR

``FP32_EXPORT_DIR`` is an export with an fp32 ``flow_encoder.onnx`` (``cosyvoice-cpu export --quant fp32
--no-verify`` of an official-format directory). The probe quantizes it with the exporter's own functions into
``--work`` (reused when present):

- ``fp32``: the graph as exported;
- ``int8w acc1``: weight-only ``MatMulNBits`` 8-bit, block 32, fp32 compute (``accuracy_level`` 1: the ``int8w``
  encoder of exports before 2026-12-05);
- ``int8w acc4``: the same with int8 compute (``accuracy_level`` 4: the ``int8w`` encoder now);
- ``int8 dynamic``: ``DynamicQuantizeMatMul`` with 7-bit weights (the estimator's scheme).

``--tokens`` are chunk calls: CosyVoice2 / Fun-CosyVoice3 encoders get ``--lookahead`` look-ahead tokens after
them; ``--whole`` is a whole sentence's call, without look-ahead (0: none). CosyVoice-300M's encoder takes a
stretch matrix to ``tokens * 22050 / 256 / 50`` frames. A streamed chunk's call covers the prompt, the context
window and the new tokens: 85 tokens for a first chunk of 10 after a 3 s CosyVoice2 voice (75 tokens), 153 for a
steady one. Prints the median ms per call and the max relative error of
``mu`` against fp32. Nothing here is imported by the runtime.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cosyvoice_cpu.export.quantize import quantize_int8_dynamic, quantize_nbits
from cosyvoice_cpu.manifest import Manifest

# each quantized form: how the exporter's functions write it from the fp32 graph (src, dst)
QUANTIZED: dict[str, Callable[[Path, Path], None]] = {
    "int8w acc1": lambda src, dst: quantize_nbits(src, dst, bits=8, block_size=32, accuracy_level=1),
    "int8w acc4": lambda src, dst: quantize_nbits(src, dst, bits=8, block_size=32, accuracy_level=4),
    "int8 dynamic": lambda src, dst: quantize_int8_dynamic(src, dst, reduce_range=True),
}
FORMS = ("fp32", *QUANTIZED)


def build(src: Path, work: Path) -> dict[str, Path]:
    """Each form's graph file (written into ``work`` unless it is there)."""
    paths = {"fp32": src}
    for name, quantize in QUANTIZED.items():
        dst = work / name.replace(" ", "_") / src.name
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            quantize(src, dst)
        paths[name] = dst
    return paths


def feeds_for(
    sess: ort.InferenceSession, tokens: int, lookahead: int, vocab: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Random ids below ``vocab`` and a speaker vector for ``tokens`` tokens, shaped from the graph's own inputs
    (``context``: the look-ahead ids, where the graph takes them)."""
    names = {i.name for i in sess.get_inputs()}
    feeds = {"token": rng.integers(0, vocab, (1, tokens)).astype(np.int64),
             "embedding": rng.standard_normal((1, 192)).astype(np.float32)}  # fmt: skip
    if "context" in names:
        feeds["context"] = rng.integers(0, vocab, (1, lookahead)).astype(np.int64)
    if "chunk_size" in names:
        feeds["chunk_size"] = np.array(0, np.int64)  # full attention, as the engine's chunks
    if "stretch" in names:  # CosyVoice-300M: each frame takes the token under it
        frames = round(tokens * 22050 / 256 / 50)
        stretch = np.zeros((tokens, frames), np.float32)
        stretch[np.minimum(np.arange(frames) * tokens // frames, tokens - 1), np.arange(frames)] = 1.0
        feeds["stretch"] = stretch
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--tokens", default="85,115,153")
    ap.add_argument("--whole", type=int, default=325)
    ap.add_argument("--lookahead", type=int, default=3)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, required=True, help="where the quantized forms are written (and reused)")
    args = ap.parse_args()
    src = args.export_dir / "flow_encoder.onnx"
    if not src.is_file():
        ap.error(f"{src} does not exist: give an export directory (cosyvoice-cpu export --quant fp32)")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    sessions = {k: ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"])
                for k, p in build(src, args.work).items()}  # fmt: skip
    vocab = int(Manifest.load(args.export_dir).graphs["flow_encoder"].attrs.get("vocab_size", 4096))
    calls = [(int(t), args.lookahead) for t in args.tokens.split(",")] + ([(args.whole, 0)] if args.whole else [])
    print("| tokens (+ look-ahead) | " + " | ".join(FORMS) + " |")
    print("|---|" + "---|" * len(FORMS))
    for n, lookahead in calls:
        feeds = feeds_for(sessions["fp32"], n, lookahead, vocab, np.random.default_rng(n))
        ahead = feeds["context"].shape[1] if "context" in feeds else 0
        outs = {k: s.run(None, feeds)[0] for k, s in sessions.items()}  # first calls, not timed
        times: dict[str, list[float]] = {k: [] for k in sessions}
        for _ in range(args.runs):
            for k, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feeds)
                times[k].append((time.perf_counter() - t0) * 1000)
        ref = outs["fp32"]
        errors = {k: np.abs(outs[k] - ref).max() / np.abs(ref).max() for k in FORMS}
        cells = [f"{statistics.median(times[k]):.1f} ms (mu error {errors[k]:.1e})" for k in FORMS]
        print(f"| {n} (+ {ahead}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
