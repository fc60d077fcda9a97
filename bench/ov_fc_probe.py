"""The rate of OpenVINO's weight layers in an estimator and alone at its layer shapes: what bounds them on this CPU.

    python bench/ov_fc_probe.py -m MODEL_DIR [--frames 650] [--rows-times 1,2,4] [--forms bf16,int8] \
        [--square 256,512,1024,2048] [--activations none,gelu,gelu-tanh,relu] [--depth 8] [--runs 10] \
        [--threads 2] [--out bench/results/ov-fc-probe.jsonl]

First, one call of ``MODEL_DIR/flow_estimator.ov.xml`` as exported (static at the frame bucket's shape, CFG batch
2): its ``FullyConnected`` nodes grouped by the activation the CPU plugin fused into them (a GELU computed after the
product inside the layer's node, from the runtime graph's ``originalLayersNames``), with each group's GMAC, time
and rate.

Then each weight-layer shape of the model (MatMul with a constant weight: M rows, K inputs, N outputs) as a model
of its own (random weights; their values do not move the speed): ``--depth`` layers alternately K -> N and N -> K,
each followed by one of ``--activations`` (:data:`ACTS`; an infer call's fixed cost spread over the layers), at M
times each of ``--rows-times`` rows (more rows per call: the CFG rows and several sentences batched), in each form:

- ``bf16``: the fp32 layers compiled with ``INFERENCE_PRECISION_HINT`` bf16 (AMX bf16 tiles where the CPU has them);
- ``int8``: quantized by NNCF's transformer preset as the exporter quantizes the estimator (int8 weights and
  activations).

The variants of one shape are compiled together and their calls alternated (the row counts one after the other).
Printed per variant: the ``FullyConnected`` nodes' own time per layer (OpenVINO's per-node counters: the layer with
what the plugin fused into it), its rate in GMAC/s, the whole call's time per layer (``call``: with the model's
input conversion and whatever the plugin left outside the layers' nodes) and the kernels; then the model's weight
layers' time predicted from these (sum of count x time at ``--rows-times`` 1). ``--square`` times square layers of
those widths at the model's largest row count instead (the rate against K alone). Appends one JSON line to
``--out``. Nothing here is imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from ov_estimator_forms import _constant, matmul_mkn, reshaped_to_bucket, time_fed

from cosyvoice_cpu.backends.buckets import bucket
from cosyvoice_cpu.benchmark.feeds import estimator_feeds


def layer_shapes(model: Any) -> Counter[tuple[int, int, int]]:
    """(M rows, K inputs, N outputs) of every MatMul with a constant weight in a statically shaped model, counted."""
    found: Counter[tuple[int, int, int]] = Counter()
    for op in model.get_ops():
        if op.get_type_name() == "MatMul" and _constant(op.input_value(1).get_node()):
            found[matmul_mkn(op)] += 1
    return found


ACTS = ("none", "gelu", "gelu-tanh", "relu")


def layer_model(ov: Any, m: int, k: int, n: int, depth: int, activation: str) -> Any:
    """An fp32 model of ``depth`` layers with biases over m rows, alternately (k -> n) and (n -> k), each followed by
    ``activation`` (one of :data:`ACTS`; ``gelu`` is erf's), random weights."""
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([m, k], np.float32, name="x")
    y = x
    for i in range(depth):
        a, b = (k, n) if i % 2 == 0 else (n, k)
        w = ops.constant((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32))
        bias = ops.constant((0.01 * rng.standard_normal(b)).astype(np.float32))  # not zero: a zero Add is removed
        y = ops.add(ops.matmul(y, w, False, False), bias)
        if activation.startswith("gelu"):
            y = ops.gelu(y, "tanh" if activation == "gelu-tanh" else "erf")
        elif activation == "relu":
            y = ops.relu(y)
    return ov.Model([y], [x], f"fc_{m}_{k}_{n}")


ACTIVATIONS = ("Gelu", "Mish", "Swish", "Sigmoid", "Tanh", "Relu", "SoftPlus", "HSwish")


def by_activation(compiled: Any, model: Any, request: Any, runs: int, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """The model's own ``FullyConnected`` nodes grouped by the activation the CPU plugin fused into them (from the
    runtime graph's ``originalLayersNames``): per group its node count, GMAC (from the runtime nodes' shapes), ms
    (median of ``runs`` calls) and rate. ``model``: the statically shaped model ``compiled`` was compiled from."""
    kind = {op.get_friendly_name(): op.get_type_name() for op in model.get_ops()}
    group: dict[str, str] = {}
    gmac: dict[str, float] = {}
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) != "FullyConnected":
            continue
        # a node the plugin's passes made keeps its type in its name (``Gelu_3900``)
        types = {kind.get(n, n.rsplit("_", 1)[0]) for n in info["originalLayersNames"].astype(str).split(",")}
        name = group[op.get_friendly_name()] = "+".join(sorted(types & set(ACTIVATIONS))) or "none"
        k = op.get_input_partial_shape(0)[-1].get_length()
        gmac[name] = gmac.get(name, 0.0) + float(np.prod(list(op.get_output_shape(0)))) * k / 1e9
    times: dict[str, list[float]] = {g: [] for g in gmac}
    for _ in range(runs):
        request.infer(feeds)
        call = dict.fromkeys(gmac, 0.0)
        for p in request.profiling_info:
            if p.node_name in group:
                call[group[p.node_name]] += p.real_time.total_seconds() * 1000
        for g, ms in call.items():
            times[g].append(ms)
    out = {}
    for g, ts in times.items():
        ms = statistics.median(ts)
        out[g] = {"nodes": sum(1 for v in group.values() if v == g), "gmac": round(gmac[g], 6), "ms": round(ms, 1),
                  "gmac_s": round(gmac[g] / max(ms, 1e-9) * 1000, 1)}  # fmt: skip
    return out


def fc_nodes(request: Any) -> tuple[float, str]:
    """ms and kernels of the layers' nodes in the last call of a PERF_COUNT compile."""
    rows = [p for p in request.profiling_info if p.node_type.startswith("FullyConnected") and p.real_time]
    return sum(p.real_time.total_seconds() * 1000 for p in rows), ",".join(sorted({p.exec_type for p in rows}))


def time_variants(
    core: Any, props: dict[str, Any], rows: int, k: int, n: int, variants: list[tuple[str, str]], depth: int, runs: int
) -> dict[tuple[str, str], tuple[float, float, str]]:
    """Each (form, activation) of :func:`layer_model` at (rows, k, n), compiled together and its calls alternated
    ``runs`` times (each run starting from the next variant, so the VM's slow minutes fall on every one): per variant
    the median ms per layer of its ``FullyConnected`` nodes, the median ms per layer of the whole call, its kernels."""
    import logging

    import nncf

    from cosyvoice_cpu.backends.openvino import import_openvino

    logging.getLogger("nncf").setLevel(logging.ERROR)  # after its import, which sets its own level
    ov = import_openvino()
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    requests = {}
    for form, act in variants:
        model = layer_model(ov, rows, k, n, depth, act)
        if form == "int8":
            model = nncf.quantize(model, nncf.Dataset([{"x": x}]), subset_size=1,
                                  model_type=nncf.ModelType.TRANSFORMER)  # fmt: skip
        requests[form, act] = core.compile_model(model, "CPU", props).create_infer_request()
        requests[form, act].infer({"x": x})  # the first call (kernels, buffers) not timed
    layer: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    call: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    kinds: dict[tuple[str, str], set[str]] = {v: set() for v in variants}
    order = list(requests.items())
    for r in range(runs):
        for v, request in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            request.infer({"x": x})
            call[v].append((time.perf_counter() - t0) * 1000 / depth)
            t, kind = fc_nodes(request)
            layer[v].append(t / depth)
            kinds[v].add(kind)
    return {v: (statistics.median(layer[v]), statistics.median(call[v]), ",".join(sorted(kinds[v]))) for v in variants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model-dir", type=Path, required=True)
    ap.add_argument("--frames", type=int, default=650)
    ap.add_argument("--rows-times", default="1,2,4")
    ap.add_argument("--forms", default="bf16,int8")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--square", default="", help="widths W: time (M, W) x (W, W) layers instead of the model's")
    ap.add_argument("--activations", default="none,gelu", help=f"after each layer, alternated: {', '.join(ACTS)}")
    ap.add_argument("--depth", type=int, default=8, help="layers per model (the per-call cost spread over them)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/ov-fc-probe.jsonl")
    args = ap.parse_args()
    forms = args.forms.split(",")
    if set(forms) - {"bf16", "int8"}:
        ap.error(f"--forms: bf16 and int8 only, got {args.forms}")
    times_rows = [int(t) for t in args.rows_times.split(",")]
    if 1 not in times_rows:
        ap.error("--rows-times: include 1 (the model's own rows, which the predicted sums use)")
    activations = args.activations.split(",")
    if set(activations) - set(ACTS):
        ap.error(f"--activations: {', '.join(ACTS)} only, got {args.activations}")
    from cosyvoice_cpu.backends.openvino import import_openvino

    ov = import_openvino()
    core = ov.Core()
    model = core.read_model(str(args.model_dir / "flow_estimator.ov.xml"))
    plain = time_fed(estimator_feeds(args.frames, np.random.default_rng(0)), model)
    feeds = reshaped_to_bucket(model, plain, args.frames)
    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "bf16",
             "INFERENCE_NUM_THREADS": args.threads, "PERF_COUNT": True}  # fmt: skip
    compiled = core.compile_model(model, "CPU", props)
    request = compiled.create_infer_request()
    request.infer(feeds)
    groups = by_activation(compiled, model, request, args.runs, feeds)
    print(f"the model's own weight layers (FullyConnected nodes) at {bucket(args.frames)} frames, CFG batch 2, by the "
          "activation fused into them:")  # fmt: skip
    for g, v in groups.items():
        print(f"  {g:10s} {v['nodes']:4d} nodes {v['gmac']:7.2f} GMAC {v['ms']:7.1f} ms {v['gmac_s']:6.0f} GMAC/s")
    del request, compiled
    shapes = layer_shapes(model)
    if args.square:  # square layers at the model's largest row count: the rate against K alone
        rows = max(m for m, _, _ in shapes)
        shapes = Counter({(rows, int(w), int(w)): 1 for w in args.square.split(",")})
    row: dict[str, Any] = {"model_dir": str(args.model_dir), "frames": args.frames, "threads": args.threads,
                           "date": time.strftime("%Y-%m-%d"), "activations": activations, "depth": args.depth,
                           "square": args.square, "runs": args.runs, "forms": forms, "rows_times": times_rows,
                           "openvino": ov.get_version(), "model_layers": groups, "layers": []}  # fmt: skip
    print(f"{'M':>6} {'K':>5} {'N':>5} {'count':>5} {'form':5} {'activation':10} {'ms':>7} {'GMAC/s':>7} "
          f"{'call':>7}  kernel")  # fmt: skip
    variants = [(f, a) for f in forms for a in activations]
    predicted = dict.fromkeys(variants, 0.0)
    timed = {s: c for s, c in shapes.items() if s[0] >= 64}  # not the time embedding's few rows (negligible MACs)
    for (m, k, n), count in sorted(timed.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1]):
        for times in times_rows:
            rows = m * times
            timed_variants = time_variants(core, props, rows, k, n, variants, args.depth, args.runs)
            for (form, act), (med, call, kernels) in timed_variants.items():
                if times == 1:
                    predicted[form, act] += count * med
                rate = rows * k * n / 1e9 / max(med, 1e-9) * 1000
                entry = {"m": rows, "k": k, "n": n, "count": count, "form": form, "activation": act,
                         "ms": round(med, 3), "gmac_s": round(rate, 1), "call_ms": round(call, 3),
                         "kernel": kernels}  # fmt: skip
                row["layers"].append(entry)
                print(f"{rows:6d} {k:5d} {n:5d} {count:5d} {form:5} {act:10} {med:7.3f} {entry['gmac_s']:7.0f} "
                      f"{call:7.3f}  {entry['kernel']}")  # fmt: skip
    total = sum(m * k * n * c for (m, k, n), c in timed.items()) / 1e9
    row["weight_gmac"] = round(total, 2)
    row["predicted_ms"] = {f"{f} {a}": round(v, 1) for (f, a), v in predicted.items()}
    for (form, act), ms_sum in predicted.items():
        what = "these square layers" if args.square else "the model's weight-layer shapes"
        print(f"{form}, {act} after every layer: {what} ({total:.1f} GMAC) as these layers: "
              f"{ms_sum:.0f} ms ({total / max(ms_sum, 1e-9) * 1000:.0f} GMAC/s)")  # fmt: skip
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
