"""What several commands share: the check for the ``[export]`` extra before a command that needs PyTorch, and
the ``--backend`` option of the commands that load an engine."""

from __future__ import annotations

import argparse

from cosyvoice_cpu.backends.plan import CHOICES
from cosyvoice_cpu.errors import MissingExtraError


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--compiled-shapes`` (``EngineConfig.backend``, ``EngineConfig.compiled_shapes``)."""
    parser.add_argument(
        "--backend",
        default="auto",
        choices=CHOICES,
        help="inference backend for the graphs with an OpenVINO model in the directory: auto (per "
        "graph from the CPU: OpenVINO where it has bf16; `doctor -m DIR` prints the plan), "
        "onnxruntime, or openvino",
    )
    parser.add_argument(
        "--compiled-shapes",
        type=int,
        default=0,
        help="OpenVINO: 0 (default) compiles each graph once for every shape; N compiles per shape "
        "(static, somewhat faster, each holding its own memory; docs/backends.md) and keeps "
        "N",
    )


def need_export_extra() -> None:
    """Raise :class:`MissingExtraError` with the install command unless PyTorch can be imported."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(
            "this command needs the [export] extra (PyTorch): pip install torch==2.13.0 && "
            "pip install 'cosyvoice-cpu[export]'"
        ) from e
