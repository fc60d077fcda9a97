"""One streamed chunk of the CosyVoice2 stream estimator: the shipped ONNX Runtime graph against OpenVINO bf16.

    python bench/ov_stream_probe.py --ort DIR --fp32 FP32_DIR [--frames 100] [--context 50] [--prompt 150]

``DIR``'s ``flow_estimator_stream.onnx`` runs on ONNX Runtime as exported (the int8 recipes' graph); ``FP32_DIR``'s
fp32 stream graph is compiled by OpenVINO as it is (its fused attention expanded) with bf16 inference. Each backend
runs in its own process: one chunk of ``--frames`` new mel frames after ``--context`` cached frames and a
``--prompt``-frame voice prompt, guidance rows included (batch 2), the first call and the median of 6 more, and
the process RSS. Prints one JSON line per backend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.hardware.pages import status_mb


def child(args: argparse.Namespace) -> None:
    n, c, p = args.frames, args.context, args.prompt
    rng = np.random.default_rng(0)
    shapes = {"x": (2, 80, n), "mu": (2, 80, n), "cond": (2, 80, n), "spks": (2, 80), "t": (2,),
              "prompt_h": (56, 2, p, 256), "context_h": (56, 2, c, 256), "conv_state": (2, 8256, 2)}  # fmt: skip
    if args.backend == "onnxruntime":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(str(Path(args.ort) / "flow_estimator_stream.onnx"), so,
                                    providers=["CPUExecutionProvider"])  # fmt: skip
        types = {i.name: i.type for i in sess.get_inputs()}
        feeds = {k: rng.standard_normal(s).astype(np.float16 if types[k] == "tensor(float16)" else np.float32)
                 for k, s in shapes.items()}  # fmt: skip
        feeds["keep_frames"] = np.array(n, np.int64)

        def run() -> None:
            sess.run(None, feeds)
    else:
        from cosyvoice_cpu.backends.openvino import import_openvino

        ov = import_openvino()

        props = {
            "INFERENCE_PRECISION_HINT": "bf16",
            "INFERENCE_NUM_THREADS": args.threads,
            "PERFORMANCE_HINT": "LATENCY",
        }
        compiled = ov.Core().compile_model(str(Path(args.fp32) / "flow_estimator_stream.onnx"), "CPU", props)
        feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        feeds["keep_frames"] = np.array(n, np.int64)

        def run() -> None:
            compiled.create_infer_request().infer(feeds)

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"backend": args.backend, "frames": n, "context": c, "prompt": p,
                      "first_ms": round(first * 1000), "median_ms": round(statistics.median(times) * 1000),
                      "rss_mb": round(status_mb("VmRSS") or 0)}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ort", required=True, help="model directory whose stream graph ONNX Runtime runs")
    ap.add_argument("--fp32", required=True, help="fp32 model directory whose stream graph OpenVINO compiles")
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--context", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.backend:
        return child(args)
    for backend in ("onnxruntime", "openvino"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--backend", backend]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
