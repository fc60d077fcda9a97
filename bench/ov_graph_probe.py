"""Is a graph faster on OpenVINO than on ONNX Runtime *at the shapes it is really called with*?

``python bench/ov_graph_probe.py -m DIR --graph hift_decode`` (or ``flow_encoder``; a CosyVoice2 directory: the
feeds follow its contracts and 50 Hz mel / 25 Hz tokens) converts ``DIR``'s ONNX graph to
OpenVINO (float16 weights, bf16 or f32 inference by the runtime's rule, one dynamic compile, as the runtime's
OpenVINO backend opens models) and times both backends, each in its own process (so RSS is its own), in two patterns:

- ``repeat``: one shape called again and again (what a single-shape micro-benchmark sees);
- ``distinct``: every call a new length, drawn at random (what whole sentences and vocoder windows do: a
  sentence's frame count is its own).

It prints per pattern the audio real-time factor (seconds of compute per second of audio the calls cover), the
process's RSS after the calls and, for ``hift_decode``, the wave SNR of OpenVINO against ONNX Runtime. Results are
appended as JSON lines to ``--out``. Nothing here is imported by the runtime.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.hardware.pages import status_mb

TMP = Path(tempfile.gettempdir())
FRAME_RATE = {"hift_decode": 50.0, "flow_encoder": 25.0}  # calls' length unit per second of audio (CosyVoice2)


def feeds(graph: str, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of one call covering ``n`` units (mel frames for the vocoder, speech tokens for the encoder)."""
    if graph == "hift_decode":
        return {"mel": (rng.standard_normal((1, 80, n)) * 2 - 5).astype(np.float32),
                "source": (rng.standard_normal((1, 1, n * 480)) * 0.1).astype(np.float32)}  # fmt: skip
    return {"token": rng.integers(0, 6561, (1, n)), "context": np.zeros((1, 0), np.int64),
            "embedding": rng.standard_normal((1, 192)).astype(np.float32), "chunk_size": np.array(0)}  # fmt: skip


def session(backend: str, onnx_path: Path, threads: int):
    """A ``run(feeds) -> first output`` callable on ``backend``."""
    if backend == "onnxruntime":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        return lambda f: sess.run(None, f)[0]
    from cosyvoice_cpu.backends.openvino import import_openvino
    from cosyvoice_cpu.backends.openvino_precision import precision_for_cpu

    ov = import_openvino()

    xml = TMP / f"ov_probe_{onnx_path.stem}.xml"
    ov.save_model(ov.convert_model(str(onnx_path)), str(xml), compress_to_fp16=True)
    core = ov.Core()
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision_for_cpu(),
             "INFERENCE_NUM_THREADS": threads}  # fmt: skip
    compiled = core.compile_model(core.read_model(str(xml)), "CPU", props)

    def run(f: dict[str, np.ndarray]) -> np.ndarray:
        request = compiled.create_infer_request()
        request.infer(f)
        return np.array(request.get_output_tensor(0).data, copy=True)

    return run


def child(args: argparse.Namespace) -> None:
    """One backend, both patterns; prints one JSON line."""
    onnx_path = Path(args.model_dir) / f"{args.graph}.onnx"
    run = session(args.backend, onnx_path, args.threads)
    rng = np.random.default_rng(0)
    lo, hi = args.lengths
    out: dict[str, object] = {"backend": args.backend, "graph": args.graph, "threads": args.threads}
    repeat_n = (lo + hi) // 2
    patterns = {"repeat": [repeat_n] * args.calls, "distinct": [int(n) for n in rng.integers(lo, hi, args.calls)]}
    for name, lengths in patterns.items():
        run(feeds(args.graph, lengths[0], np.random.default_rng(1)))  # the first call (compile, arena) not timed
        total, units = 0.0, 0
        for i, n in enumerate(lengths[1:]):
            f = feeds(args.graph, n, np.random.default_rng(100 + i))
            t0 = time.perf_counter()
            run(f)
            total += time.perf_counter() - t0
            units += n
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rss = round(status_mb("VmRSS") or 0)
        out[name] = {"rtf": round(total / (units / FRAME_RATE[args.graph]), 4), "rss_mb": rss,
                     "calls": len(lengths) - 1}  # fmt: skip
    if args.graph == "hift_decode":  # the same inputs' output, saved for the SNR
        wave = run(feeds(args.graph, repeat_n, np.random.default_rng(7)))
        np.save(TMP / f"ov_probe_{args.backend}.npy", wave)
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model-dir", required=True)
    ap.add_argument("--graph", choices=sorted(FRAME_RATE), default="hift_decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--lengths", type=int, nargs=2, default=None, help="call lengths drawn from [lo, hi)")
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/ov-graph-probe.jsonl")
    args = ap.parse_args()
    if args.lengths is None:
        args.lengths = [60, 500] if args.graph == "hift_decode" else [30, 250]
    if args.backend:
        return child(args)
    rows = []
    for backend in ("onnxruntime", "openvino"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--backend", backend]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(line))
        print(line, flush=True)
    if args.graph == "hift_decode":
        ref, got = (np.load(TMP / f"ov_probe_{b}.npy") for b in ("onnxruntime", "openvino"))
        snr = float(10 * np.log10((ref**2).sum() / max(((got - ref) ** 2).sum(), 1e-30)))
        rows[1]["wave_snr_db"] = round(snr, 1)
        print(f"wave SNR of OpenVINO vs ONNX Runtime: {snr:.1f} dB")
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "model_dir": str(args.model_dir), "date": time.strftime("%Y-%m-%d")}) + "\n")


if __name__ == "__main__":
    main()
