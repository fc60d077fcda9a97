"""The one-node ONNX graphs :mod:`cosyvoice_cpu.probes.calibrate` times, written into the package.

The runtime cannot import ``onnx`` (the runtime wall), so the graphs ship as files in
``cosyvoice_cpu/calibration/``; this module is how they were made, and a test checks the packaged files equal
what it builds now::

    python -m cosyvoice_cpu.export.calibration_graphs      # rewrite the packaged files

Each graph has named dynamic dimensions, so the calibration chooses the sizes.
"""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).resolve().parent.parent / "calibration"
OPSET = 17


def build() -> dict[str, bytes]:
    """Serialized models by file name: ``sgemm.onnx``, ``qgemm.onnx``, ``attention.onnx``.

    - ``sgemm``: fp32 ``MatMul`` a (m, k) x b (k, n) -> (m, n).
    - ``qgemm``: ``MatMulInteger`` uint8 a (m, k) x int8 b (k, n) -> int32 (m, n), the u8s8 product the
      dynamically quantized estimator runs.
    - ``attention``: ``com.microsoft.MultiHeadAttention`` (8 heads) on q, k, v (batch, frames, 512) without mask
      or bias, i.e. ORT's flash kernel as one estimator block calls it.
    """
    from onnx import TensorProto, helper

    def model(node: object, inputs: list, outputs: list, domains: tuple[str, ...] = ()) -> bytes:
        graph = helper.make_graph([node], "calibration", inputs, outputs)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, 1) for d in domains]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="cosyvoice-cpu")
        m.ir_version = 8  # readable by every onnxruntime the package supports
        return m.SerializeToString()

    f32, u8, i8, i32 = TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32
    vi = helper.make_tensor_value_info
    bsd = ["batch", "frames", 512]
    return {
        "sgemm.onnx": model(
            helper.make_node("MatMul", ["a", "b"], ["c"]),
            [vi("a", f32, ["m", "k"]), vi("b", f32, ["k", "n"])],
            [vi("c", f32, ["m", "n"])],
        ),
        "qgemm.onnx": model(
            helper.make_node("MatMulInteger", ["a", "b"], ["c"]),
            [vi("a", u8, ["m", "k"]), vi("b", i8, ["k", "n"])],
            [vi("c", i32, ["m", "n"])],
        ),
        "attention.onnx": model(
            helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=8),
            [vi(n, f32, bsd) for n in ("q", "k", "v")],
            [vi("o", f32, bsd)],
            ("com.microsoft",),
        ),
    }


def write(directory: Path = PACKAGED) -> list[Path]:
    """Write :func:`build`'s graphs into ``directory``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in build().items():
        (directory / name).write_bytes(data)
        paths.append(directory / name)
    return paths


if __name__ == "__main__":
    for p in write():
        print(p)
