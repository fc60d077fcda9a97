"""What several commands share: the check for the ``[export]`` extra before a command that needs PyTorch, the
``--backend`` option of the commands that load an engine, and the engine and synthesis options of the two servers
(``serve`` and ``wyoming``)."""

from __future__ import annotations

import argparse
from typing import Any

from cosyvoice_cpu.backends.plan import CHOICES
from cosyvoice_cpu.config import (
    DEFAULT_PROMPT_CACHE_MB,
    MAX_FLOW_STEPS,
    MAX_PROMPT_CACHE_MB,
    EngineConfig,
    SynthesisConfig,
)
from cosyvoice_cpu.errors import MissingExtraError


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """``--backend``, ``--compiled-shapes`` and ``--no-split-rows`` (``EngineConfig.backend``,
    ``EngineConfig.compiled_shapes``, ``EngineConfig.split_rows``; :func:`backend_options` reads them)."""
    parser.add_argument(
        "--backend",
        default="auto",
        choices=CHOICES,
        help="inference backend for the graphs with an OpenVINO model in the directory: auto (per "
        "graph from the CPU: OpenVINO where it has AMX, AVX-512 BF16 or AVX-512 VNNI; `doctor -m DIR` prints "
        "the plan), onnxruntime, or openvino",
    )
    parser.add_argument(
        "--compiled-shapes",
        type=int,
        default=0,
        help="OpenVINO: 0 (default) compiles each graph once for every shape; N compiles per shape "
        "(static, somewhat faster, each holding its own memory; docs/backends.md) and keeps "
        "N",
    )
    add_split_rows_arg(parser)


def add_split_rows_arg(parser: argparse.ArgumentParser) -> None:
    """``--no-split-rows`` (``EngineConfig.split_rows`` off, as ``args.split_rows``)."""
    parser.add_argument(
        "--no-split-rows",
        dest="split_rows",
        action="store_false",
        help="with 2 threads, run each flow-estimator call on ONNX Runtime as one call on both threads instead of "
        "its two guidance rows side by side, one thread each (the default: faster streamed chunks and first "
        "audio, docs/streaming.md); for a box where other work keeps a core busy",
    )


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields of :func:`add_backend_args`' flags, as keyword arguments."""
    return {"backend": args.backend, "compiled_shapes": args.compiled_shapes, "split_rows": args.split_rows}


def seconds(value: str) -> float:
    """A servers' time flag (timeouts, audio bounds): seconds above 0, at most a day."""
    try:
        parsed = float(value)
    except ValueError:
        parsed = float("nan")
    if not 0 < parsed <= 86_400:
        raise argparse.ArgumentTypeError(f"takes seconds above 0 and at most 86400, not {value!r}")
    return parsed


def _whole(value: str, low: int, high: int, unit: str) -> int:
    """A flag's whole number of ``unit`` from ``low`` to ``high``; anything else an argparse error that says so."""
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"takes a whole number of {unit} from {low} to {high}, not {value!r}")
    return number


def _budget_mib(value: str) -> int:
    """A ``--prompt-cache-mb`` value: a whole number of MiB, 0 to ``MAX_PROMPT_CACHE_MB``."""
    return _whole(value, 0, MAX_PROMPT_CACHE_MB, "MiB")


def add_prompt_cache_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--prompt-cache-mb`` and ``--prompt-cache-fp16`` of the servers (``EngineConfig.prompt_cache_mb``,
    ``EngineConfig.prompt_cache_fp16``)."""
    parser.add_argument(
        "--prompt-cache-mb",
        type=_budget_mib,
        default=DEFAULT_PROMPT_CACHE_MB,
        metavar="MIB",
        help=f"memory for the voices' streaming caches, in MiB (default {DEFAULT_PROMPT_CACHE_MB}; least recently "
        "used dropped first; per server process): a voice keeps its prompt's flow activations per solver setting, "
        "87 MB for a 3 s voice with CosyVoice2 and 185 MB with Fun-CosyVoice3 (full size, int8 models; "
        "CosyVoice-300M keeps none); 0 keeps none and builds them again for every streamed request, before its "
        "first audio (the cost measured: docs/server.md)",
    )
    parser.add_argument(
        "--prompt-cache-fp16",
        action="store_true",
        help="fp32 models: keep each voice's streaming cache in "
        "float16 (half the memory, mel rel. error 2.6e-3, ~5 %% slower streamed chunks); int8 models "
        "(the default recipe) do so already",
    )


def _flow_steps(value: str) -> int:
    """A ``--flow-steps`` value: a whole number of Euler steps, 1 to ``MAX_FLOW_STEPS`` (``SynthesisConfig``)."""
    return _whole(value, 1, MAX_FLOW_STEPS, "Euler steps")


def add_synthesis_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--flow-steps`` of the servers: the synthesis setting a request starts from (``ServerSettings.defaults``),
    for clients that cannot send one (Home Assistant over Wyoming) or should not have to."""
    parser.add_argument(
        "--flow-steps",
        type=_flow_steps,
        default=SynthesisConfig.flow_steps,
        metavar="N",
        help=f"Euler steps of the flow for requests that do not ask for their own (default "
        f"{SynthesisConfig.flow_steps}, the official setting; fewer is faster at some cost in quality, both measured "
        "in docs/server.md); a voice's streaming cache is kept per step count",
    )


def synthesis_defaults(args: argparse.Namespace) -> SynthesisConfig:
    """The synthesis settings a server's requests start from (:func:`add_synthesis_flags`; validated with the rest
    of ``ServerSettings``)."""
    return SynthesisConfig(flow_steps=args.flow_steps)


def server_engine_config(args: argparse.Namespace, lm_batch_rows: int) -> EngineConfig:
    """The engine options of a server's command line (``--threads``, the backend's and the prompt cache's flags),
    validated; ``lm_batch_rows``: the LM scheduler's rows (the server's own rule)."""
    return EngineConfig(
        threads=args.threads,
        lm_batch_rows=lm_batch_rows,
        prompt_cache_mb=args.prompt_cache_mb,
        prompt_cache_fp16=args.prompt_cache_fp16,
        **backend_options(args),
    ).validate()


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
