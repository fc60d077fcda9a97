"""Where one ONNX graph's time goes: ORT's profiler, summed per operator type (and per op + output shape).

    python bench/ort_profile.py MODEL_DIR/flow_estimator.onnx [--frames 650] [--batch 2] [--threads 2] [--runs 3]
    python bench/ort_profile.py MODEL_DIR/flow_estimator_stream.onnx --frames 20 --dim prompt_frames=150 \
        --dim context_frames=0    # a first streamed chunk on a 3 s voice
    python bench/ort_profile.py V3_DIR/flow_estimator_stream.onnx --frames 70 --dim prompt_frames=100 \
        --dim time_rows=1 --dim context_frames=0 --int offset=100 --int chunk_frames=50 \
        --int keep_frames=50   # v3's first window

Random float inputs; a dimension named ``batch`` gets ``--batch``, one named by ``--dim NAME=N`` gets N, every
other named dimension ``--frames``; an input called ``mask`` is all ones (nothing padded: what the runtime
feeds); integer inputs are zeros unless ``--int NAME=V`` sets them (scalars). Prints the
median wall time per call (without profiling), then per-op-type kernel time per call, then the heaviest
(op, output shape) pairs. An ``If`` node's time includes the nodes of the branch it ran, which are listed too
(so shares overlap). This is how the flow estimator was profiled for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def _feeds(sess: ort.InferenceSession, frames: int, batch: int, dims: dict[str, int],
           ints: dict[str, int]) -> dict[str, np.ndarray]:  # fmt: skip
    rng = np.random.default_rng(0)
    sizes = {"batch": batch, **dims}
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(d, frames) for d in i.shape]
        if "float" in i.type:
            value = np.ones(shape, np.float32) if i.name == "mask" else rng.standard_normal(shape, np.float32)
            feeds[i.name] = value.astype(np.float16) if i.type == "tensor(float16)" else value
        else:
            feeds[i.name] = np.full(shape, ints.get(i.name, 0), np.int64 if "int64" in i.type else np.int32)
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graph", type=Path)
    ap.add_argument("--frames", type=int, default=650)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="size of a named input dimension")
    ap.add_argument("--int", action="append", default=[], metavar="NAME=V", help="value of an integer input")
    args = ap.parse_args()
    try:
        dims = {k: int(v) for k, v in (d.split("=") for d in args.dim)}
        ints = {k: int(v) for k, v in (d.split("=") for d in args.int)}
    except ValueError:
        ap.error(f"--dim and --int take NAME=N (an integer), got {args.dim} {args.int}")

    def options(profile: str | None) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if profile:
            so.enable_profiling = True
            so.profile_file_prefix = profile
        return so

    sess = ort.InferenceSession(str(args.graph), options(None), providers=["CPUExecutionProvider"])
    feeds = _feeds(sess, args.frames, args.batch, dims, ints)
    sess.run(None, feeds)
    walls = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        walls.append(time.perf_counter() - t0)
    print(f"{args.graph.name}: {statistics.median(walls) * 1000:.1f} ms per call (median of {args.runs}), "
          f"batch {args.batch}, {args.frames} frames {dims or ''}, {args.threads} threads")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        profiled = options(str(Path(tmp) / "prof"))
        prof = ort.InferenceSession(str(args.graph), profiled, providers=["CPUExecutionProvider"])
        for _ in range(args.runs):
            prof.run(None, feeds)
        events = json.loads(Path(prof.end_profiling()).read_text())
    by_op: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    by_shape: collections.Counter[tuple[str, str]] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"]
            by_op[op] += e["dur"]
            count[op] += 1
            by_shape[(op, str(e["args"].get("output_type_shape")))] += e["dur"]
    total = sum(by_op.values())
    print("\n| op | ms per call | share | nodes |\n|---|---|---|---|")
    for op, us in by_op.most_common(args.top):
        print(f"| {op} | {us / args.runs / 1000:.1f} | {100 * us / total:.1f} % | {count[op] // args.runs} |")
    print(f"\nkernel total {total / args.runs / 1000:.1f} ms per call\n\n| op | output | ms per call |\n|---|---|---|")
    for (op, shape), us in by_shape.most_common(args.top):
        print(f"| {op} | {shape} | {us / args.runs / 1000:.1f} |")


if __name__ == "__main__":
    main()
