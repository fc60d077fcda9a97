"""The LM's weight GEMM alone, per quantization kernel, for one decoded row and for a prefill of many rows.

    python bench/lm_gemm_probe.py [--rows 1,100] [--threads 2] [--k 896] [--n 4864]

One ``MatMul`` of the Qwen2-0.5B MLP shape (896 x 4864, random weights) in ORT: fp32, dynamic int8 per channel
(``quantize_dynamic``: ``DynamicQuantizeMatMul``, what the ``int8`` LM recipe uses), and weight-only
``MatMulNBits`` (8 and 4 bits, block 32 and 128, accuracy level 4 = int8 compute; the ``int8w``/``int4`` recipes
use 8/4 bits, block 32). Prints the best of 5 x 10 calls in ms and the rate in GOPS for each row count. This is
how the prefill's cost was traced to ``MatMulNBits``' many-row kernels (docs/benchmarks.md, LM).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import numpy as np


def _graphs(k: int, n: int, out: Path) -> dict[str, Path]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(w, "w")])  # fmt: skip
    paths = {"fp32": out / "fp32.onnx"}
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), paths["fp32"])
    paths["dynamic int8"] = out / "int8.onnx"
    quantize_dynamic(paths["fp32"], paths["dynamic int8"], per_channel=True, weight_type=QuantType.QInt8)
    for bits, block in ((8, 32), (8, 128), (4, 32), (4, 128)):
        q = MatMulNBitsQuantizer(onnx.load(paths["fp32"]), bits=bits, block_size=block, is_symmetric=True,
                                 accuracy_level=4)  # fmt: skip
        q.process()
        paths[f"MatMulNBits {bits}-bit block {block}"] = out / f"nbits{bits}_{block}.onnx"
        q.model.save_model_to_file(str(paths[f"MatMulNBits {bits}-bit block {block}"]))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,100")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=896)
    ap.add_argument("--n", type=int, default=4864)
    args = ap.parse_args()
    logging.disable(logging.INFO)  # the quantizers' progress lines
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {name: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
                    for name, p in _graphs(args.k, args.n, Path(tmp)).items()}  # fmt: skip
    rng = np.random.default_rng(1)
    for m in (int(r) for r in args.rows.split(",")):
        x = {"x": rng.standard_normal((m, args.k)).astype(np.float32)}
        best = dict.fromkeys(sessions, float("inf"))
        for _ in range(5):  # the variants take turns
            for name, sess in sessions.items():
                sess.run(None, x)
                t0 = time.perf_counter()
                for _ in range(10):
                    sess.run(None, x)
                best[name] = min(best[name], (time.perf_counter() - t0) / 10)
        print(f"{m} row(s), {args.k} x {args.n}, {args.threads} threads:")
        for name, s in best.items():
            print(f"  {name:30s} {s * 1e3:8.3f} ms  {2 * m * args.k * args.n / s / 1e9:7.0f} GOPS")


if __name__ == "__main__":
    main()
