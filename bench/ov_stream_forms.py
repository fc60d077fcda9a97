"""The CosyVoice2 stream estimator at the chunk plan's shapes: ONNX Runtime's shipped graph against OpenVINO forms.

    python bench/ov_stream_forms.py export --from OFFICIAL_DIR --work WORK
    python bench/ov_stream_forms.py speed --ort MODEL_DIR --work WORK [--forms ort,ov-bf16,ov-int8] [--prompt 150]
    python bench/ov_stream_forms.py engine --ort MODEL_DIR --work WORK [--form ov-int8] [--runs 4]

``export`` traces the stream estimator of a full-size official CosyVoice2 directory in its plain form (attention
as MatMul/Softmax, as the whole-sentence OpenVINO model is) to ``WORK/stream_plain.onnx``, converts it to OpenVINO
(``stream_bf16.ov.xml``: float16 weights, bf16 compute) and quantizes it with NNCF (``stream_int8.ov.xml``: the
transformer preset, calibrated on chunk feeds of random normal values; a speed form, not a quality one).

``speed`` runs each form in its own process over the shapes a streamed sentence meets with the default chunk plan
(first chunk 10 tokens = 20 frames, doubling to 50 tokens = 100 frames, 25 tokens = 50 frames of context; CFG batch
2): per shape the first call and the median of 6 more, with the CPU time the process spent in them (every thread,
busy or waiting in a spin: ORT's threads do not spin here, as in the engine), then the process RSS. ``ort`` is
``MODEL_DIR``'s ``flow_estimator_stream.onnx`` (the int8 recipes' graph, float16 caches); ``ov-*-static`` compiles
one model per shape instead of one dynamic compile.

``engine`` asks what a form does where users hear it: two engines on ``MODEL_DIR`` under ``auto``, the second
with its stream estimator replaced by the OpenVINO form (one dynamic compile; float32 caches, which the flow asks
the graph for), take turns streaming the 8-character sentence (2 s) and the 10 s one, ``--runs`` times after a
warm-up run each (``bench/backend_ab.py``'s ``--measure first,stream``, and its report: the medians of the first
audio and the streamed RTF with their ratio to ``ort``'s, every run), then the process's peak RSS (both engines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.row_groups import batch_axis, join_rows
from cosyvoice_cpu.hardware.pages import status_mb

# (new frames, context frames) of a 10 s sentence's chunks under the default plan (the last one shorter)
SHAPES = ((20, 0), (40, 20), (80, 50), (100, 50), (60, 50))
LAYERS, WIDTH, CONV = 56, 256, 8256


def feeds_for(n: int, c: int, p: int, half: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    cache = np.float16 if half else np.float32
    f = {
        "x": rng.standard_normal((2, 80, n)),
        "mu": rng.standard_normal((2, 80, n)),
        "cond": rng.standard_normal((2, 80, n)),
        "spks": rng.standard_normal((2, 80)),
        "t": rng.random(2),
        "conv_state": rng.standard_normal((2, CONV, 2)),
    }
    f = {k: v.astype(np.float32) for k, v in f.items()}
    f["prompt_h"] = rng.standard_normal((LAYERS, 2, p, WIDTH)).astype(cache)
    f["context_h"] = rng.standard_normal((LAYERS, 2, c, WIDTH)).astype(cache)
    f["keep_frames"] = np.array(min(n, 50), np.int64)
    return f


def half_caches(session: Any, path: Path, flag: str) -> bool:
    """Whether a CosyVoice2 stream estimator session takes float16 caches; SystemExit naming ``flag`` when the
    graph at ``path`` is no CosyVoice2 stream estimator."""
    cache = {i.name: i.type for i in session.get_inputs()}.get("prompt_h")
    if cache is None:
        raise SystemExit(f"{flag}: {path} is not a CosyVoice2 stream estimator (no prompt_h input)")
    return cache == "tensor(float16)"


def as_taken(session: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` laid out as the engine feeds ``session``: inputs with an inner batch axis (the caches) rows apart
    where the session splits its calls by rows (``GraphSession.rows_apart``), C order otherwise."""
    if not getattr(session, "rows_apart", False):
        return feeds
    out = dict(feeds)
    for node in session.get_inputs():
        if node.name in feeds and (axis := batch_axis(list(node.shape))):
            out[node.name] = join_rows([feeds[node.name]], axis)  # one part: a copy laid out rows apart
    return out


def alternated_ms(forms: dict[str, Any], feeds: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    """Median ms per call of each session on ``feeds`` (laid out as the engine feeds it: :func:`as_taken`) over
    ``runs`` rounds, the sessions alternated call by call with a 30 ms pause before each (a spinning pool of the
    previous session would otherwise take the next one's cores)."""
    times: dict[str, list[float]] = {k: [] for k in forms}
    laid_out = {label: as_taken(s, feeds) for label, s in forms.items()}
    for _ in range(runs):
        for label, s in forms.items():
            time.sleep(0.03)
            t0 = time.perf_counter()
            s.run(None, laid_out[label])
            times[label].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def export(args: argparse.Namespace) -> None:
    import nncf

    from cosyvoice_cpu.backends.openvino import import_openvino
    from cosyvoice_cpu.export.flow.cosyvoice2_stream import export_stream_estimator
    from cosyvoice_cpu.workshop.parts import load_reference

    ov = import_openvino()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    plain = work / "stream_plain.onnx"
    if not plain.exists():
        flow = load_reference(args.src, ("flow",)).flow.eval()
        export_stream_estimator(flow.decoder.estimator, plain)
        del flow
    model = ov.convert_model(str(plain))
    ov.save_model(model, str(work / "stream_bf16.ov.xml"), compress_to_fp16=True)
    rng = np.random.default_rng(0)
    samples = [feeds_for(n, c, args.prompt, False, rng) for n, c in SHAPES for _ in range(2)]
    q = nncf.quantize(model, nncf.Dataset(samples), subset_size=len(samples), model_type=nncf.ModelType.TRANSFORMER)
    ov.save_model(q, str(work / "stream_int8.ov.xml"), compress_to_fp16=True)
    print("written", sorted(p.name for p in work.glob("stream_*")))


def child(args: argparse.Namespace) -> None:
    form, threads = args.form, args.threads
    rng = np.random.default_rng(0)
    if form == "ort":
        from cosyvoice_cpu.backends.base import SessionConfig
        from cosyvoice_cpu.backends.onnxruntime import make_session

        # the engine's session options (spinning off)
        sess = make_session(Path(args.ort) / "flow_estimator_stream.onnx", SessionConfig(threads=threads))
        half = next(i.type for i in sess.get_inputs() if i.name == "prompt_h") == "tensor(float16)"

        def runner(n: int, c: int):
            return lambda f: sess.run(None, f)
    else:
        from cosyvoice_cpu.backends.openvino import import_openvino

        ov = import_openvino()
        core = ov.Core()
        half = False
        kind = form.split("-")[1]
        props = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        model_path = str(Path(args.work) / f"stream_{kind}.ov.xml")
        dynamic = None if form.endswith("-static") else core.compile_model(model_path, "CPU", props)

        def runner(n: int, c: int):
            if dynamic is not None:
                req = dynamic.create_infer_request()
            else:
                m = core.read_model(model_path)
                shapes = {k: v.shape for k, v in feeds_for(n, c, args.prompt, False, rng).items()}
                m.reshape({m.input(k).get_any_name(): list(s) for k, s in shapes.items()})
                req = core.compile_model(m, "CPU", props).create_infer_request()
            return lambda f: req.infer(f)

    out = {"form": form, "prompt": args.prompt, "shapes": []}
    total = total_cpu = 0.0
    for n, c in SHAPES:
        f = feeds_for(n, c, args.prompt, half, rng)
        run = runner(n, c)
        t0 = time.perf_counter()
        run(f)
        first = time.perf_counter() - t0
        times, cpu = [], []
        for _ in range(6):
            t0, c0 = time.perf_counter(), time.process_time()
            run(f)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        med, cpu_med = statistics.median(times), statistics.median(cpu)
        total += med
        total_cpu += cpu_med
        out["shapes"].append({"n": n, "c": c, "first_ms": round(first * 1000), "median_ms": round(med * 1000, 1),
                              "cpu_ms": round(cpu_med * 1000, 1)})  # fmt: skip
    out["sum_median_ms"] = round(total * 1000, 1)
    out["sum_cpu_ms"] = round(total_cpu * 1000, 1)
    out["rss_mb"] = round(status_mb("VmRSS") or 0)
    out["hwm_mb"] = round(status_mb("VmHWM") or 0)
    print(json.dumps(out))


def speed(args: argparse.Namespace) -> None:
    for form in args.forms.split(","):
        cmd = [sys.executable, __file__, "child", "--form", form, "--ort", args.ort, "--work", args.work,
               "--prompt", str(args.prompt), "--threads", str(args.threads)]  # fmt: skip
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


def engine_ab(args: argparse.Namespace) -> None:
    from backend_ab import compare, report  # bench/ is the script directory, first on sys.path

    from cosyvoice_cpu.backends.base import SessionConfig
    from cosyvoice_cpu.backends.openvino import OpenVino
    from cosyvoice_cpu.benchmark.tasks import load

    engines = {"ort": load(Path(args.ort), args.threads), args.form: load(Path(args.ort), args.threads)}
    xml = Path(args.work) / f"stream_{args.form.split('-')[1]}.ov.xml"
    flow = engines[args.form][0].flow
    precision = "bf16" if args.form.startswith("ov-bf16") else None  # the form's name, else the runtime's rule
    config = SessionConfig(threads=args.threads, max_shapes=0)
    flow._sessions["stream"] = OpenVino(precision=precision).open(xml, config)
    rate = engines["ort"][0].manifest.token_frame_rate  # 10 s and 2 s of speech tokens, as the bench forces them
    names = ["first", "stream"]
    report(compare(engines, names, args.runs, round(10 * rate), round(2 * rate)), names, {})
    print(json.dumps({"hwm_mb": round(status_mb("VmHWM") or 0)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--from", dest="src", required=True)
    e.add_argument("--work", required=True)
    e.add_argument("--prompt", type=int, default=150)
    g = sub.add_parser("engine")
    g.add_argument("--ort", required=True)
    g.add_argument("--work", required=True)
    g.add_argument("--form", default="ov-int8", choices=("ov-int8", "ov-bf16"))
    g.add_argument("--runs", type=int, default=4)
    g.add_argument("--threads", type=int, default=2)
    for name in ("speed", "child"):
        s = sub.add_parser(name)
        s.add_argument("--ort", required=True)
        s.add_argument("--work", required=True)
        s.add_argument("--forms", default="ort,ov-bf16,ov-int8")
        s.add_argument("--form")
        s.add_argument("--prompt", type=int, default=150)
        s.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    {"export": export, "speed": speed, "child": child, "engine": engine_ab}[args.cmd](args)


if __name__ == "__main__":
    main()
