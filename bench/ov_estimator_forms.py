"""One whole-sentence estimator call in every form the runtime can run it, alternated in one process.

    python bench/ov_estimator_forms.py -m MODEL_DIR [--frames 650] [--runs 5] [--threads 2] [--profile [--unfused]] \
        [--switch] [--precision bf16|f32]

``MODEL_DIR`` holds ``flow_estimator.onnx`` and an OpenVINO model (``export --openvino``). Forms, batch 2 (CFG),
``--frames`` frames (650: a 10 s sentence after a 3 s voice), medians of ``--runs`` alternated calls:

- ``ort``: ONNX Runtime's estimator, unpadded (what the ORT engine runs);
- ``ov dynamic``: the OpenVINO model compiled once with its dynamic axes (the runtime's default,
  ``--compiled-shapes 0``), unpadded and padded to the frame bucket (what the runtime runs: ``backends/buckets.py``);
- ``ov static``: compiled for the bucket's shape alone (``--compiled-shapes N``).

Also printed, from the model's graph at the bucket's shape: the multiply-accumulates of one call in weight layers
(MatMul/Convolution with constant weights) and in attention products (activation x activation). ``--profile``
adds OpenVINO's per-node time by node and kernel type for both compiles, and the rate the weight layers ran at.
``--unfused`` (with ``--profile``) also profiles the static compile with the CPU plugin's fused subgraphs off
(``SNIPPETS_MODE=DISABLE``): fused, the attention's two products and its softmax hide in one ``Subgraph`` node;
unfused, they run as ``MatMul`` and ``Softmax`` nodes, whose kernels say whether the products ran on AMX tiles
(``brgemm_avx512_amx...``) and how much of the attention the softmax is. ``--precision`` sets OpenVINO's compute
precision (default: the CPU's, as the runtime's:
:func:`~cosyvoice_cpu.backends.openvino_precision.precision_for_cpu`). ``--switch`` adds the time to bring a static
bucket from OpenVINO's model cache (what a bucket change costs the static form). Appends one JSON line to ``--out``.
Nothing here is imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.buckets import bucket, pad_axis
from cosyvoice_cpu.backends.openvino_precision import PRECISIONS, precision_for_cpu
from cosyvoice_cpu.benchmark.feeds import estimator_feeds
from cosyvoice_cpu.flow.graphs import ESTIMATOR_PADDING


def _constant(node: Any) -> bool:
    """Whether ``node`` is a constant weight (through Convert/FakeQuantize/Multiply/... of one)."""
    for _ in range(6):
        if node.get_type_name() == "Constant":
            return True
        if node.get_type_name() in ("Parameter", "MatMul", "ScaledDotProductAttention", "Softmax"):
            return False
        node = node.input_value(0).get_node()
    return False


def matmul_mkn(op: Any) -> tuple[int, int, int]:
    """(rows M, inputs K, outputs N) of a statically shaped MatMul: every leading axis of its output counts as rows."""
    a = list(op.get_input_shape(0))
    out = list(op.get_output_shape(0))
    return int(np.prod(out[:-1])), int(a[-2] if op.get_transpose_a() else a[-1]), int(out[-1])


def macs(model: Any) -> dict[str, float]:
    """GMAC of one call of a statically shaped OpenVINO model: weight layers and attention products."""
    out = {"weights": 0.0, "attention": 0.0}
    for op in model.get_ops():
        kind = op.get_type_name()
        if kind == "MatMul":
            m, k, n = matmul_mkn(op)
            out["weights" if _constant(op.input_value(1).get_node()) else "attention"] += m * k * n / 1e9
        elif kind in ("Convolution", "GroupConvolution"):
            w = list(op.get_input_shape(1))
            per_out = float(np.prod(w[2:] if kind == "GroupConvolution" else w[1:]))
            out["weights"] += float(np.prod(list(op.get_output_shape(0)))) * per_out / 1e9
        elif kind == "ScaledDotProductAttention":  # q (B, H, L, E) . k (B, H, S, E), then . v
            q, k = list(op.get_input_shape(0)), list(op.get_input_shape(1))
            out["attention"] += 2 * float(np.prod(q)) * k[-2] / 1e9
    return out


def time_fed(feeds: dict[str, np.ndarray], model: Any) -> dict[str, np.ndarray]:
    """``feeds`` for ``model``: a model that takes a time table (Fun-CosyVoice3's ``modulation`` (1, K)) in place
    of ``t`` gets one of small normal values (its values do not move the speed)."""
    names = {p.get_any_name(): p for p in model.inputs}
    if "t" in names or "modulation" not in names:
        return feeds
    width = names["modulation"].get_partial_shape()[1].get_length()
    out = {k: v for k, v in feeds.items() if k != "t"}
    out["modulation"] = 0.1 * np.random.default_rng(1).standard_normal((1, width)).astype(np.float32)
    return out


def reshaped_to_bucket(model: Any, feeds: dict[str, np.ndarray], frames: int) -> dict[str, np.ndarray]:
    """``feeds`` padded to the frame bucket of ``frames`` (as the runtime pads a call), and ``model`` reshaped to
    them in place (a static compile's shapes)."""
    padded = pad_axis(feeds, ESTIMATOR_PADDING, bucket(frames))
    model.reshape({k: list(v.shape) for k, v in padded.items()})
    return padded


def profile(request: Any) -> dict[str, float]:
    """ms per (node type, kernel) of the last call (PERF_COUNT compiles only), largest first; every kernel that
    ran, however short (a tiny test model's whole call can take under a millisecond per node type)."""
    agg: dict[str, float] = defaultdict(float)
    for p in request.profiling_info:
        agg[f"{p.node_type}/{p.exec_type}"] += p.real_time.total_seconds() * 1000
    return {k: round(v, 3) for k, v in sorted(agg.items(), key=lambda kv: -kv[1]) if v > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model-dir", type=Path, required=True)
    ap.add_argument("--frames", type=int, default=650)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--unfused", action="store_true", help="with --profile: also the static compile, snippets off")
    ap.add_argument("--switch", action="store_true")
    ap.add_argument("--out", default="bench/results/ov-estimator-forms.jsonl")
    ap.add_argument("--precision", choices=PRECISIONS, default=None, help="default: the CPU's")
    args = ap.parse_args()
    if args.unfused and not args.profile:
        ap.error("--unfused profiles a compile: it needs --profile")
    import onnxruntime as ort

    from cosyvoice_cpu.backends.openvino import import_openvino

    ov = import_openvino()

    xml = args.model_dir / "flow_estimator.ov.xml"
    size = bucket(args.frames)
    onnx_feeds = estimator_feeds(args.frames, np.random.default_rng(0))
    precision = args.precision or precision_for_cpu()
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision,
             "INFERENCE_NUM_THREADS": args.threads, "PERF_COUNT": args.profile}  # fmt: skip
    core = ov.Core()
    static_model = core.read_model(str(xml))
    plain = time_fed(onnx_feeds, static_model)
    padded = reshaped_to_bucket(static_model, plain, args.frames)
    dynamic = core.compile_model(core.read_model(str(xml)), "CPU", props).create_infer_request()
    static = core.compile_model(static_model, "CPU", props).create_infer_request()
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    sess = ort.InferenceSession(str(args.model_dir / "flow_estimator.onnx"), so, providers=["CPUExecutionProvider"])
    forms = {f"ort {args.frames}": lambda: sess.run(None, onnx_feeds),
             f"ov dynamic {args.frames}": lambda: dynamic.infer(plain),
             f"ov dynamic {size}": lambda: dynamic.infer(padded),
             f"ov static {size}": lambda: static.infer(padded)}  # fmt: skip
    if args.unfused:
        unfused = core.compile_model(static_model, "CPU", {**props, "SNIPPETS_MODE": "DISABLE"}).create_infer_request()
        forms[f"ov static {size} unfused"] = lambda: unfused.infer(padded)
    for run in forms.values():  # first calls (kernels for the shape, arenas) not timed
        run()
    times: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(args.runs):
        for name, run in forms.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1000)
    ref = statistics.median(times[f"ort {args.frames}"])
    row: dict[str, Any] = {"model_dir": str(args.model_dir), "frames": args.frames, "bucket": size,
                           "threads": args.threads, "precision": precision, "date": time.strftime("%Y-%m-%d"), "ms": {},
                           "gmac": {k: round(v, 2) for k, v in macs(static_model).items()}}  # fmt: skip
    for name, ts in times.items():
        med = statistics.median(ts)
        row["ms"][name] = round(med, 1)
        print(f"{name:22s} {med:7.1f} ms  ({ref / med:.2f}x ONNX Runtime)  runs: {', '.join(f'{t:.0f}' for t in ts)}")
    print(f"one call at {size} frames: {row['gmac']['weights']} GMAC in weight layers, "
          f"{row['gmac']['attention']} GMAC in attention products")  # fmt: skip
    if args.profile:
        row["profile"] = {"dynamic": profile(dynamic), "static": profile(static)}
        if args.unfused:
            row["profile"]["static unfused"] = profile(unfused)
        for form, prof in row["profile"].items():
            gemm = sum(v for k, v in prof.items() if k.split("/")[0] in ("FullyConnected", "Convolution",
                       "GroupConvolution", "FullyConnectedQuantizedLegacy"))  # fmt: skip
            print(f"ov {form} at {size}: weight layers {gemm:.0f} ms "
                  f"({row['gmac']['weights'] / max(gemm, 1e-9) * 1000:.0f} GMAC/s); top: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in list(prof.items())[:6]))  # fmt: skip
        if args.unfused:
            unf = row["profile"]["static unfused"]
            parts = {k: v for k, v in unf.items() if k.split("/")[0] in ("MatMul", "Softmax")}
            print(f"ov static unfused at {size}: the attention's products and softmax {sum(parts.values()):.0f} ms: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))  # fmt: skip
    if args.switch:
        with tempfile.TemporaryDirectory() as cache:
            core.set_property({"CACHE_DIR": cache})
            core.compile_model(static_model, "CPU", props)  # fills the cache
            t0 = time.perf_counter()
            request = core.compile_model(static_model, "CPU", props).create_infer_request()
            loaded = time.perf_counter() - t0
            request.infer(padded)
            first = time.perf_counter() - t0 - loaded
        row["switch_s"] = {"cache_load": round(loaded, 2), "first_call": round(first, 2)}
        print(f"a static bucket from the model cache: {loaded:.2f} s, then its first call {first:.2f} s")
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
