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


def add_unload_flag(parser: argparse.ArgumentParser) -> None:
    """``--unload-after S`` of the servers (:class:`~cosyvoice_cpu.server.unload.UnloadingEngine`)."""
    parser.add_argument(
        "--unload-after",
        type=float,
        metavar="S",
        help="release the engine (the model's memory) after S seconds without a request, and load it again at "
        "the next one (for a box that runs other things too; the first request after pays the load)",
    )


def load_engine(args: argparse.Namespace, config: object) -> object:
    """The engine of a server: ``Engine.load(args.model, config)``, or with ``--unload-after`` one that is released
    when idle and loaded again on use."""
    from cosyvoice_cpu.engine import Engine

    if getattr(args, "unload_after", None) is None:
        return Engine.load(args.model, config)
    from cosyvoice_cpu.server.unload import UnloadingEngine

    return UnloadingEngine(lambda: Engine.load(args.model, config), args.unload_after)


def need_export_extra() -> None:
    """Raise :class:`MissingExtraError` with the install command unless PyTorch can be imported."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(
            "this command needs the [export] extra (PyTorch): pip install torch==2.13.0 && "
            "pip install 'cosyvoice-cpu[export]'"
        ) from e
