"""The runtime makes no NumPy BLAS call: neither the synthesis path nor voice creation.

After each BLAS call OpenBLAS (NumPy's BLAS) keeps its worker threads spinning for a while. One matrix-vector
product per streamed chunk in the vocoder's source kept a second core busy for as long as a server streamed:
0.35 s of CPU per sentence of the tiny demo model, taken from the concurrent requests (4 in flight served
1.39-1.53x the serial rate with it, 1.64x without; docs/server.md). ONNX Runtime does the matrix work; NumPy code
on the synthesis path uses elementwise ops, reductions and ``einsum`` (its own loop, no BLAS).

The check is on the source: any ``@``, ``dot``, ``matmul``, ``tensordot``, ``inner``, ``vdot`` or ``linalg`` in a
runtime module fails. Voice creation (``audio/features.py``) was exempt until a matrix product there hung: OpenBLAS's
threaded GEMM waits forever for worker threads that a ``fork()`` in another thread shut down mid-product (its
``pthread_atfork`` handler; OpenVINO's import-time telemetry forked while a voice was made: issue 35).
"""

from __future__ import annotations

import ast
from pathlib import Path

import cosyvoice_cpu

PACKAGE = Path(cosyvoice_cpu.__file__).parent
NOT_RUNTIME = ("reference/", "export/", "fixtures/", "demo_model/")
BLAS_NAMES = {"dot", "matmul", "tensordot", "inner", "vdot", "linalg"}


def _blas_uses(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.MatMult):
            found.append(f"{name}:{node.lineno}: @")
        elif isinstance(node, ast.Attribute) and node.attr in BLAS_NAMES:
            found.append(f"{name}:{node.lineno}: .{node.attr}")
    return sorted(found)


def test_runtime_modules_make_no_blas_call() -> None:
    modules = [p for p in PACKAGE.rglob("*.py")
               if not str(p.relative_to(PACKAGE)).startswith(NOT_RUNTIME)]  # fmt: skip
    assert any(p.name == "hift.py" for p in modules) and len(modules) > 30
    found = [use for p in modules for use in _blas_uses(p.read_text(), str(p.relative_to(PACKAGE)))]
    why = "NumPy BLAS calls in the runtime (OpenBLAS spins a core, and can hang after a fork):\n"
    assert not found, why + "\n".join(found)


def test_the_check_sees_a_matrix_product() -> None:
    bad = "import numpy as np\n\ndef f(a, b):\n    a @= b\n    return np.linalg.norm(np.dot(a, b) + a @ b)\n"
    assert _blas_uses(bad, "x.py") == ["x.py:4: @", "x.py:5: .dot", "x.py:5: .linalg", "x.py:5: @"]
    assert _blas_uses("import numpy as np\ny = np.einsum('ij,j->i', a, b)\n", "ok.py") == []
