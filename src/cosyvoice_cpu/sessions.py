"""The one ONNX Runtime session factory of the runtime, and the graph-contract check.

Every stage opens its graphs here so threads, spinning and the arena are configured in one place, and so a graph
whose inputs/outputs do not match what the stage feeds it fails at load with a message naming the file and the
difference (not at the first ``run`` with an ORT error).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ModelDirError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionConfig:
    """ORT options for one session.

    Attributes:
        threads: intra-op threads (0 = ORT's default, all cores).
        spinning: let idle pool threads spin (lower latency for one stream; off when several run concurrently).
        mem_pattern: ORT's per-shape memory planning (off for graphs fed many shapes: it caches a plan each).
    """

    threads: int = 0
    spinning: bool = False
    mem_pattern: bool = False

    def validate(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = all cores), got {self.threads}")


def make_session(path: str | Path, config: SessionConfig | None = None) -> Any:
    """Open ``path`` on the CPU execution provider; a missing or unreadable graph is a :class:`ModelDirError`."""
    import onnxruntime as ort

    config = config or SessionConfig()
    config.validate()
    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"graph {path} is missing; re-export the model directory")
    so = ort.SessionOptions()
    so.intra_op_num_threads = config.threads
    so.inter_op_num_threads = 1
    so.enable_mem_pattern = config.mem_pattern
    so.log_severity_level = 3
    spin = "1" if config.spinning else "0"
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own exception types (InvalidGraph, NoSuchFile, Fail, ...)
        raise ModelDirError(f"cannot load graph {path}: {str(e).splitlines()[0]}; re-export the model") from e


def check_io(session: Any, inputs: Iterable[str], outputs: Iterable[str], what: str) -> None:
    """Raise :class:`ModelDirError` unless the session's input and output names are exactly as expected."""
    have_in = [i.name for i in session.get_inputs()]
    have_out = [o.name for o in session.get_outputs()]
    want_in, want_out = list(inputs), list(outputs)
    problems = []
    if sorted(have_in) != sorted(want_in):
        problems.append(f"inputs {have_in} (expected {want_in})")
    if sorted(have_out) != sorted(want_out):
        problems.append(f"outputs {have_out} (expected {want_out})")
    if problems:
        raise ModelDirError(
            f"{what} graph has " + " and ".join(problems) + ": it was not written by this version of "
            "`cosyvoice-cpu export`; re-export the model directory"
        )
