"""Which operator makes an int8 graph give other numbers on another CPU: the int8 operators alone, and the flow
estimator node by node, natively and under qemu (the targets of bench/qemu_platforms.py).

- single operators on fixed inputs: DynamicQuantizeLinear; MatMulInteger u8 x s8 with 7-bit and 8-bit weights;
  MatMulNBits (8-bit weights) at accuracy level 1 (fp32 compute) and 4 (int8 activations), for 1 and 16 rows;
- the demo model's ``flow_estimator.onnx`` with every node's output made a graph output (graph optimizations
  off), on the graph probe's inputs (cosyvoice_cpu.probes.graphs): the first nodes whose output differs while
  their inputs agree, and the share of elements each DynamicQuantizeLinear rounds to another step.

The graphs are written here (with onnx) and only run in the child (onnxruntime alone), so the arm64 root of
``qemu_platforms.py arm-root`` needs no onnx wheel.

    python bench/qemu_ops.py [--cpu Denverton,IvyBridge,Haswell-v4] [--arm-root R --arm-cpu cortex-a76,cortex-a72]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from qemu_platforms import DEMO, run  # bench/ is the script directory, first on sys.path

K, N, BLOCK = 256, 128, 32


def _model(nodes: list, inputs: list, outputs: list, inits: list, path: Path) -> None:
    from onnx import helper, save

    graph = helper.make_graph(nodes, path.stem, inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    save(helper.make_model(graph, opset_imports=opsets), str(path))


def write_graphs(d: Path) -> None:
    """The single-operator graphs and the estimator with every node output, plus their inputs (inputs.npz)."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    x = (2 * rng.standard_normal((16, K))).astype(np.float32)
    out = [h.make_tensor_value_info(n, t, None) for n, t in (("q", T.UINT8), ("s", T.FLOAT), ("z", T.UINT8))]
    inp = [h.make_tensor_value_info("x", T.FLOAT, ["m", K])]
    _model([h.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])], inp, out, [], d / "dql.onnx")
    feeds["dql:x"] = x
    a = rng.integers(0, 256, (64, K)).astype(np.uint8)
    for bits in (7, 8):
        w = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), (K, N)).astype(np.int8)
        inits = [nh.from_array(w, "w"), nh.from_array(np.array(128, np.uint8), "az")]
        node = h.make_node("MatMulInteger", ["a", "w", "az"], ["y"])
        io = ([h.make_tensor_value_info("a", T.UINT8, a.shape)], [h.make_tensor_value_info("y", T.INT32, None)])
        _model([node], *io, inits, d / f"matmulinteger_{bits}bit.onnx")
        feeds[f"matmulinteger_{bits}bit:a"] = a
    weights = rng.integers(0, 256, (N, K // BLOCK, BLOCK)).astype(np.uint8)
    scales = (rng.random(N * (K // BLOCK)) * 0.01 + 0.001).astype(np.float32)
    for level in (1, 4):
        for rows in (1, 16):
            name = f"matmulnbits_level{level}_{rows}row"
            attrs = {"K": K, "N": N, "bits": 8, "block_size": BLOCK, "accuracy_level": level}
            node = h.make_node("MatMulNBits", ["x", "qw", "sc"], ["y"], domain="com.microsoft", **attrs)
            inits = [nh.from_array(weights, "qw"), nh.from_array(scales, "sc")]
            _model([node], inp, [h.make_tensor_value_info("y", T.FLOAT, None)], inits, d / f"{name}.onnx")
            feeds[f"{name}:x"] = x[:rows]
    est = onnx.load(str(DEMO / "flow_estimator.onnx"))
    declared = {o.name for o in est.graph.output}
    for node in est.graph.node:
        est.graph.output.extend(onnx.ValueInfoProto(name=o) for o in node.output if o and o not in declared)
    onnx.save(est, str(d / "estimator_nodes.onnx"))
    from cosyvoice_cpu.probes.graphs import probe_model

    probe = probe_model(DEMO)
    feeds.update({f"estimator_nodes:{k.split('/')[-1]}": v for k, v in probe.items() if "flow_estimator/in/" in k})
    np.savez(d / "inputs.npz", **feeds)


def child(d: Path, out: Path) -> None:
    import onnxruntime as ort

    feeds = dict(np.load(d / "inputs.npz"))
    results = {}
    for path in sorted(d.glob("*.onnx")):
        o = ort.SessionOptions()
        o.intra_op_num_threads = 1
        o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        s = ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])
        names = [x.name for x in s.get_outputs()]
        values = s.run(names, {i.name: feeds[f"{path.stem}:{i.name}"] for i in s.get_inputs()})
        results.update({f"{path.stem}:{n}": v for n, v in zip(names, values)})
    np.savez(out, **results)


def _err(a: np.ndarray, b: np.ndarray) -> float:
    if a.dtype.kind in "iub" and a.dtype.itemsize == 1:  # quantized values: the share that moved a step
        return float(np.mean(a != b))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a64 - b64), initial=0) / (np.max(np.abs(a64), initial=0) or 1.0))


def report(ref: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> None:
    import onnx

    for key in sorted(k for k in ref if not k.startswith("estimator_nodes:")):
        print(f"  {key:40s} err {_err(ref[key], other[key]):.2e}  ({int(np.sum(ref[key] != other[key]))} differ)")
    for rows in (1, 16):  # where no int8 kernel exists, level 4 is level 1 (fp32 compute)
        level4, level1 = other[f"matmulnbits_level4_{rows}row:y"], ref[f"matmulnbits_level1_{rows}row:y"]
        print(f"  matmulnbits level 4 here vs level 1 native, {rows} row(s): err {_err(level1, level4):.2e}")
    est = onnx.load(str(DEMO / "flow_estimator.onnx"), load_external_data=False)
    val = {k.split(":", 1)[1]: (ref[k], other[k]) for k in ref if k.startswith("estimator_nodes:")}
    val.update({k.split("/")[-1]: (v, v) for k, v in probe_inputs().items()})
    first, flips = [], []
    for node in est.graph.node:
        ins = [_err(*val[i]) for i in node.input if i in val]
        outs = [_err(*val[o]) for o in node.output if o in val]
        if outs and max(outs) > 0 and not any(ins):
            first.append(f"{node.op_type} {max(outs):.1e}")
        if node.op_type == "DynamicQuantizeLinear":
            flips.append(f"{_err(*val[node.output[0]]):.1e}")
    print(f"  estimator: nodes whose output differs while their inputs agree: {', '.join(first) or 'none'}")
    print(f"  estimator: share of elements each DynamicQuantizeLinear (in graph order) rounds apart: {' '.join(flips)}")
    out = next(o.name for o in est.graph.output)
    print(f"  estimator: output err {_err(*val[out]):.2e}")


def probe_inputs() -> dict[str, np.ndarray]:
    from cosyvoice_cpu.probes.graphs import probe_model

    return {k: v for k, v in probe_model(DEMO).items() if "flow_estimator/in/" in k}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cpu", type=lambda v: [c for c in v.split(",") if c], default=["Denverton", "IvyBridge", "Haswell-v4"]
    )
    p.add_argument("--arm-cpu", type=lambda v: [c for c in v.split(",") if c], default=[])
    p.add_argument("--arm-root", type=Path)
    p.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_graphs(d)
        runs = {}
        for target in ["native", *a.cpu, *a.arm_cpu]:
            seconds = run(target, [__file__, "--child", str(d), str(d / f"{target}.npz")], a.arm_root)
            runs[target] = dict(np.load(d / f"{target}.npz"))
            print(f"{target}: ran in {seconds:.1f} s")
        for target in [*a.cpu, *a.arm_cpu]:
            print(f"\n{target} against native:")
            report(runs["native"], runs[target])


if __name__ == "__main__":
    main()
