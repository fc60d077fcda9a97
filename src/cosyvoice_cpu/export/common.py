"""Shared pieces of the per-stage ONNX exporters: artifacts, numerics-gate results, saving.

Every stage exporter (the family modules of ``lm/``, ``flow/``, ``hift/``) returns :class:`GraphArtifact` records for
the files it wrote and a ``verify_*`` function returning :class:`GateResult` records; ``exporter`` turns both
into the manifest. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import FamilyFacts

logger = logging.getLogger(__name__)

OPSET = 17
# Initializers at least this large go to the external ``.data`` file (memory-mapped by ORT at load).
EXTERNAL_MIN_BYTES = 1024


@dataclass
class TensorSpec:
    """One graph input or output: name, element type, symbolic shape (strings are dynamic axes)."""

    name: str
    dtype: str  # numpy dtype name: "float32", "int64", "int32"
    shape: list[int | str]
    doc: str = ""


@dataclass
class GraphArtifact:
    """A graph written into the model directory.

    ``key`` is the manifest key (``lm``, ``flow_encoder``, ``flow_estimator``, ``flow_estimator_stream``,
    ``hift_f0``, ``hift_decode``); ``file`` and ``data`` are relative to the model directory.
    """

    key: str
    file: str
    data: list[str] = field(default_factory=list)
    precision: str = "fp32"
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)  # stage facts the runtime needs (e.g. max_len)

    @classmethod
    def of(cls, out_dir: Path, key: str, file: str, attrs: dict[str, Any], precision: str = "fp32") -> GraphArtifact:
        """The artifact of a graph written at ``out_dir/file``: external data and I/O read from the files."""
        data = [file + ".data"] if (Path(out_dir) / (file + ".data")).exists() else []
        inputs, outputs = io_specs(Path(out_dir) / file)
        return cls(key, file, data, precision, inputs, outputs, dict(attrs))


@dataclass
class GateResult:
    """One numerics check: ``value`` (e.g. a max relative error) must be ``<= tolerance``."""

    graph: str
    check: str
    value: float
    tolerance: float
    detail: str = ""
    phase: str = "fp32"  # which graphs were checked: "fp32" or the recipe precision (e.g. "int8w")

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.value)) and self.value <= self.tolerance

    def __str__(self) -> str:
        mark = "ok" if self.passed else "FAILED"
        what = f"{self.graph} [{self.phase}]: {self.check} = {self.value:.3g} (tolerance {self.tolerance:.3g})"
        return f"{what} {mark} {self.detail}".rstrip()


@dataclass(frozen=True)
class LMGate:
    """What the LM numerics gate (:func:`cosyvoice_cpu.export.lm.cosyvoice2.verify_lm`) needs of a family's graph, given
    by its graph module (the ``GATE`` of each family module of ``export/lm/``), not sniffed from the LM.

    Attributes:
        facts: the family's facts (``lm_speaker``: the prompt holds an x-vector row).
        attrs: ``(lm, max_len) -> attrs`` of the written ``lm`` artifact (v3: its own head size and stop facts).
        text_vocab: ``lm -> n``, the text ids the LM's text table holds (prompt text ids are drawn below n).
        text_encoder: prompt text passes through the ``lm_text_encoder`` graph (v1).
    """

    facts: FamilyFacts
    attrs: Callable[[Any, int], dict[str, Any]]
    text_vocab: Callable[[Any], int]
    text_encoder: bool = False


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref| (0 when both are all zero)."""
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if ours.shape != ref.shape:
        return float("inf")
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    diff = float(np.max(np.abs(ours - ref))) if ref.size else 0.0
    return diff / scale if scale > 0 else diff


def gate(key: str, check: str, ours: np.ndarray, ref: np.ndarray, tol: float, detail: str = "") -> GateResult:
    """A :class:`GateResult` of ``rel_err(ours, ref)`` against ``tol``, logged."""
    result = GateResult(key, check, rel_err(ours, ref), tol, detail)
    logger.info("%s", result)
    return result


def verify_setup(
    out_dir: Path,
    files: dict[str, str] | None,
    tolerance: dict[str, float] | None,
    default_files: dict[str, str],
    default_tolerance: dict[str, float],
    what: str,
) -> tuple[dict[str, Path], dict[str, float]]:
    """A verifier's graph paths (``default_files`` overridden by ``files``, under ``out_dir``) and tolerances
    (``default_tolerance`` overridden by ``tolerance``); ConfigError for a key neither default knows."""
    unknown = set(tolerance or {}) - set(default_tolerance) or set(files or {}) - set(default_files)
    if unknown:
        raise ConfigError(
            f"{what}: unknown keys {sorted(unknown)}; tolerance keys are {sorted(default_tolerance)}, "
            f"file keys {sorted(default_files)}"
        )
    paths = {k: Path(out_dir) / v for k, v in {**default_files, **(files or {})}.items()}
    return paths, {**default_tolerance, **(tolerance or {})}


def save_onnx(model: Any, path: Path) -> list[str]:
    """Save an ``onnx.ModelProto`` to ``path``, weights >= 1 KiB in ``<name>.data`` beside it.

    Returns the external data file names written (empty when the model had no large initializers).
    """
    import onnx

    path = Path(path)
    data_name = path.name + ".data"
    if (path.parent / data_name).exists():
        (path.parent / data_name).unlink()
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=EXTERNAL_MIN_BYTES,
    )
    written = [data_name] if (path.parent / data_name).exists() else []
    for name in (path.name, *written):  # onnx writes external data 0600; a model directory is shared read-only
        (path.parent / name).chmod(0o644)
    return written


def torch_export(module: Any, args: tuple, path: Path, **kwargs: Any) -> None:
    """``torch.onnx.export`` with the TorchScript exporter (no onnxscript needed), opset :data:`OPSET`.

    The graph is first written to ``path`` and then re-saved with external data by :func:`save_onnx`.
    """
    import onnx
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, args, str(path), dynamo=False, opset_version=OPSET, do_constant_folding=True, **kwargs
        )
    model = onnx.load(str(path), load_external_data=True)
    save_onnx(model, path)


def io_specs(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Read a graph's inputs and outputs (names, dtypes, symbolic shapes) from the file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def spec(v: Any) -> TensorSpec:
        t = v.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        shape: list[int | str] = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
        return TensorSpec(v.name, dtype, shape, v.doc_string)

    inits = {i.name for i in model.graph.initializer}
    return [spec(v) for v in model.graph.input if v.name not in inits], [spec(v) for v in model.graph.output]


def replace_dir(new: Path, out: Path) -> None:
    """Move directory ``new`` to ``out``; an existing ``out`` is first renamed aside, so a crash leaves one."""
    backup = None
    if out.exists() or out.is_symlink():
        backup = out.with_name(f".{out.name}.old-{new.name}")
        out.rename(backup)
    try:
        new.rename(out)
    except BaseException:
        if backup is not None:  # put the old directory back under its name
            backup.rename(out)
        raise
    if backup is not None:
        if backup.is_dir() and not backup.is_symlink():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.unlink()
