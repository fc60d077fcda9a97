"""Flow estimator speed/accuracy probe: fp32 vs dynamic int8 on the weight GEMMs (the ``int8`` recipe) vs
weight-only 8-bit ``MatMulNBits`` (int8 compute with activations quantized per row and block of 32, so a row's
output does not depend on its batch neighbours). The attention products are inside ``MultiHeadAttention`` since
the fused estimator ops, which ORT runs in fp32 only, so there is no "int8 attention" variant to try any more.

    python bench/estimator_probe.py MODEL_DIR_FP32/flow_estimator.onnx [--frames 650] [--threads 2]

Batch 2 (CFG), random inputs, median of 3 calls after a warm-up; relative error = max |int8 - fp32| / max |fp32|;
"row dep." = max |row 0 of the batch - row 0 run alone| / max |row 0| (0 when rows are independent).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.onnxruntime import make_session
from cosyvoice_cpu.benchmark.feeds import estimator_feeds
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.export.quantize import quantize_int8_dynamic, quantize_nbits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("estimator", type=Path, help="an fp32 flow_estimator.onnx")
    ap.add_argument("--frames", type=int, default=650)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    feeds = estimator_feeds(args.frames, np.random.default_rng(0))

    def bench(path: Path, name: str, ref: np.ndarray | None = None) -> np.ndarray:
        sess = make_session(path, SessionConfig(threads=args.threads))
        out = sess.run(None, feeds)[0]
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        err = "" if ref is None else f"  rel err {rel_err(out, ref):.2e}"
        alone = sess.run(None, {k: v[:1] for k, v in feeds.items()})[0]
        print(f"{name:24s} {1000 * np.median(times):7.0f} ms/call{err}  row dep. {rel_err(out[:1], alone):.1e}",
              flush=True)  # fmt: skip
        return out

    ref = bench(args.estimator, "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "int8.onnx"
        quantize_int8_dynamic(args.estimator, dst, reduce_range=True)  # what the recipe ships
        bench(dst, "int8 weight GEMMs", ref)
        dst = Path(tmp) / "nbits8.onnx"
        quantize_nbits(args.estimator, dst, bits=8, block_size=32, accuracy_level=4)
        bench(dst, "int8w (MatMulNBits 8)", ref)


if __name__ == "__main__":
    main()
