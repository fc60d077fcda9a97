"""What the exported ONNX graphs hold, read with onnx (not a test module)."""

from __future__ import annotations

from pathlib import Path


def nbits_accuracy(path: Path) -> set[int]:
    """The ``accuracy_level`` of every ``MatMulNBits`` node of the graph at ``path`` (empty: no such node)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    return {a.i for n in nodes for a in n.attribute if a.name == "accuracy_level"}
