"""Which backend runs which graph: the per-graph plan behind ``--backend auto|onnxruntime|openvino``.

A model directory lists its ONNX graphs and, where the export wrote them (``export --openvino``), OpenVINO
models of some of those graphs under the key ``<graph>_ov``: the whole-sentence flow estimator (every family) and,
where the LM is the Qwen2 LM (CosyVoice2, Fun-CosyVoice3), the LM as a stateful model (``lm_ov``, attrs
``stateful``). The plan gives every graph one backend and the reason, which ``cosyvoice-cpu doctor`` prints:

- ``onnxruntime``: every graph on ONNX Runtime (what every machine ran before OpenVINO).
- ``openvino``: every graph that has an OpenVINO model runs on it; a ConfigError when ``openvino`` is missing or
  the directory has no OpenVINO model.
- ``auto``: OpenVINO for a graph where it was measured to win: the directory has its OpenVINO model, ``openvino`` is
  installed, the CPU has AMX, AVX-512 BF16 or AVX-512 VNNI (:func:`openvino_isa`: the CPUs OpenVINO was measured, or
  for AVX-512 VNNI alone emulated, faster on; it computes there in bf16 or f32:
  :mod:`~cosyvoice_cpu.backends.openvino_precision`), the graph can be padded to shared shapes where it is padded at
  all (the estimators' ``pad_exact``; a stateful LM pads its own prefills, its rows carry their own mask), and the
  machine has memory to spare: OpenVINO's estimator holds more than ONNX Runtime's (:data:`OV_MIN_MEMORY`; measured:
  docs/backends.md, "Shapes, compiles and memory"). Anything else runs as it always did, on ONNX Runtime.

Only one backend ever holds a graph's weights: the graph with an OpenVINO plan is not opened in ONNX Runtime.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cosyvoice_cpu.backends.base import BACKEND_NAMES, ONNXRUNTIME, OPENVINO
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import FACTS, facts

if TYPE_CHECKING:
    from cosyvoice_cpu.hardware.cpu import CpuInfo
    from cosyvoice_cpu.manifest import GraphEntry

logger = logging.getLogger(__name__)

AUTO = "auto"
CHOICES = (AUTO, *BACKEND_NAMES)  # --backend: auto, or one backend for every graph
OV_SUFFIX = "_ov"  # manifest key of a graph's OpenVINO model: "<graph>_ov"
# The graphs ``export --openvino`` writes an OpenVINO model of (``export/openvino_graphs.py``,
# ``export/openvino_lm.py``): where one is missing on a CPU that would run it faster, the plan's reason says how to
# get it. The LM only for the families whose facts say ``openvino_lm`` (:func:`openvino_exportable`).
OPENVINO_EXPORTABLE = frozenset({"flow_estimator", "lm"})
EXPORT_OPENVINO = "cosyvoice-cpu export --from OFFICIAL_DIR --to MODEL_DIR --openvino int8"
# The stateful int4 LM against ONNX Runtime's int8w in the engine, alternated (the Zen 5's: the bench, one backend after
# the other) (docs/backends.md, "The LM on OpenVINO")
LM_INT4_GAIN = (
    "1.35x faster on an AVX-512 BF16 Zen 4 (end to end 1.17x, less memory), 1.23x on a Zen 5, 1.52x faster on an "
    "AMX Xeon (prefill 1.45x) and 1.73x faster on an Intel Xeon held to AVX-512 VNNI (end to end 1.09-1.26x)"
)
# What OpenVINO was measured to gain per graph, for the reason of a missing model (docs/backends.md)
OV_GAIN = {
    "flow_estimator": "OpenVINO ran the whole-sentence flow 1.1-1.85x faster (on an Intel core without AMX, in f32: "
    "0.92-1.15x, about even)",
    "lm": f"OpenVINO's int4 LM decoded {LM_INT4_GAIN} than ONNX Runtime's int8w in the engine, at int4's cost in "
    "argmax agreement, which the export prints: check it (on random weights Fun-CosyVoice3's LM lost far more than "
    "CosyVoice2's, docs/quantization.md)",
}
# The export command that writes each graph's OpenVINO model in the form ``auto`` runs
OV_EXPORT = {"flow_estimator": EXPORT_OPENVINO, "lm": EXPORT_OPENVINO + " --openvino-lm int4"}
# Memory (available, capped by the cgroup limit) below which ``auto`` keeps ONNX Runtime: the OpenVINO estimator
# raises the engine's peak (docs/backends.md, "Shapes, compiles and memory"), so a 2 GB edge box keeps the lean
# engine and a server gets the fast one.
OV_MIN_MEMORY = 3 << 30
NO_MODEL = "no OpenVINO model of this graph in the directory"
NO_ISA = "neither AMX, AVX-512 BF16 nor AVX-512 VNNI"  # openvino_isa None, in the plan's reasons


@dataclass(frozen=True)
class GraphPlan:
    """One graph's backend: ``graph`` (manifest key of the ONNX graph), ``backend``, ``reason`` (for doctor),
    ``key`` (the manifest key of the file that backend opens)."""

    graph: str
    backend: str
    reason: str
    key: str

    @property
    def other_model(self) -> bool:
        """Whether the graph runs from another model file than its ONNX graph (its OpenVINO model)."""
        return self.key != self.graph


def may_use_openvino(choices: list[str]) -> bool:
    """Whether any of these ``--backend`` choices can run an OpenVINO model (so one is worth exporting)."""
    return any(check_choice(c) != ONNXRUNTIME for c in choices)


def openvino_installed() -> bool:
    """Whether the ``openvino`` package can be imported (without importing it)."""
    return importlib.util.find_spec("openvino") is not None


def check_choice(choice: str) -> str:
    """``choice`` if it is one of :data:`CHOICES`, else a ConfigError listing them."""
    if choice not in CHOICES:
        raise ConfigError(f"backend must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


def openvino_exportable(family: str | None) -> frozenset[str]:
    """The graphs of ``family`` that ``export --openvino`` writes an OpenVINO model of (None: an unknown family,
    only the flow estimator, which every family has)."""
    if family is None or not facts(family).openvino_lm:
        return OPENVINO_EXPORTABLE - {"lm"}
    return OPENVINO_EXPORTABLE


def plan_backends(
    graphs: dict[str, GraphEntry],
    choice: str,
    cpu: CpuInfo | None = None,
    installed: bool | None = None,
    memory: int | None = -1,
    family: str | None = None,
) -> dict[str, GraphPlan]:
    """The plan for a manifest's ``graphs`` (key -> :class:`~cosyvoice_cpu.manifest.GraphEntry`).

    Args:
        choice: ``auto``, ``onnxruntime`` or ``openvino``.
        cpu: a :class:`~cosyvoice_cpu.hardware.cpu.CpuInfo` (None: :func:`~cosyvoice_cpu.hardware.cpu.detect`'s,
            cpuid's features; unknown counts as no bf16).
        installed: whether ``openvino`` is importable (None: look).
        memory: bytes this process may use (-1: read it, :attr:`~cosyvoice_cpu.hardware.cpu.Hardware.memory_for_us`;
            None: unknown, no limit assumed).
        family: the manifest's family, which says which missing OpenVINO models ``export --openvino`` would
            write (:func:`openvino_exportable`; None: the flow estimator's only).
    Returns:
        ONNX graph key -> :class:`GraphPlan`, for every graph of the directory except the OpenVINO models.
    """
    check_choice(choice)
    if installed is None:
        installed = openvino_installed()
    if choice == AUTO and (cpu is None or memory == -1):
        from cosyvoice_cpu.hardware.cpu import detect

        hw = detect()
        cpu = hw.cpu if cpu is None else cpu
        memory = hw.memory_for_us if memory == -1 else memory
    onnx = [k for k in graphs if not k.endswith(OV_SUFFIX)]
    with_ov = [k for k in onnx if k + OV_SUFFIX in graphs]
    if choice == OPENVINO:
        if not with_ov:
            raise ConfigError(
                "--backend openvino: this model directory has no OpenVINO model; export it with "
                "`cosyvoice-cpu export ... --openvino int8` (or bf16), or use --backend "
                "auto"
            )
        if not installed:
            raise ConfigError(
                "--backend openvino needs the openvino package: pip install 'cosyvoice-cpu[openvino]' "
                "(or use --backend auto or onnxruntime)"
            )
    plan = {}
    exportable = openvino_exportable(family)
    for key in onnx:
        backend, reason = ONNXRUNTIME, NO_MODEL
        if choice == AUTO and key not in with_ov:
            reason = _missing(key, cpu, installed, memory) if key in exportable else _never_exported(key)
        if choice == ONNXRUNTIME:
            reason = "--backend onnxruntime"
        elif key in with_ov and choice == OPENVINO:
            backend, reason = OPENVINO, "--backend openvino"
        elif key in with_ov:
            backend, reason = _auto(graphs[key + OV_SUFFIX], cpu, installed, memory)
        plan[key] = GraphPlan(key, backend, reason, key + OV_SUFFIX if backend == OPENVINO else key)
    return plan


def _never_exported(key: str) -> str:
    """The reason under ``auto`` for graph ``key``, of which ``export --openvino`` writes no OpenVINO model for
    this family: so that a user on a capable CPU is not left looking for a command that does not exist."""
    if key in OPENVINO_EXPORTABLE:  # the LM of a family whose LM has no stateful OpenVINO form
        with_lm = " and ".join(f.title for f in FACTS if f.openvino_lm)
        return f"{NO_MODEL}; export writes one only of the Qwen2 LM ({with_lm})"
    return f'{NO_MODEL}; export writes none (why: docs/backends.md, "Graphs that stay on ONNX Runtime, measured")'


def _missing(key: str, cpu: CpuInfo | None, installed: bool, memory: int | None) -> str:
    """The reason under ``auto`` for graph ``key``, of which ``export --openvino`` could have written an OpenVINO
    model but did not: on a CPU where that model would run faster, with the command that writes it."""
    reason = NO_MODEL
    isa = openvino_isa(cpu)
    if isa is None:
        return reason + f" (none needed: this CPU has {NO_ISA}, ONNX Runtime is as fast here)"
    if memory is not None and memory < OV_MIN_MEMORY:
        return reason + f" (none needed: {memory / 2**30:.1f} GiB of memory is too little for it)"
    install = "" if installed else "pip install 'cosyvoice-cpu[openvino,openvino-export]', then "
    return f"{reason}; this CPU has {isa}; {OV_GAIN[key]} (docs/backends.md): {install}{OV_EXPORT[key]}"


def _auto(entry: GraphEntry, cpu: CpuInfo | None, installed: bool, memory: int | None) -> tuple[str, str]:
    """(backend, reason) under ``auto`` for a graph whose OpenVINO model is ``entry``."""
    what = f"OpenVINO model {entry.file.file} ({entry.precision})"
    if not installed:
        return ONNXRUNTIME, f"{what} present, but openvino is not installed (pip install 'cosyvoice-cpu[openvino]')"
    isa = openvino_isa(cpu)
    if cpu is None or isa is None:
        return ONNXRUNTIME, (
            f"{what} present, but this CPU has {NO_ISA}: OpenVINO was measured faster only on CPUs with one of "
            "them (on AVX2 alone it gained nothing)"
        )
    if entry.attrs.get("stateful", False):  # the LM: pads its own prefills, its own rule
        return _auto_lm(entry, what, isa)
    if not entry.attrs.get("pad_exact", False):
        return ONNXRUNTIME, (
            f"{what} present, but padding changes this graph's output (pad_exact false: it "
            "would run unpadded, each sentence length compiled anew; a CosyVoice-300M export "
            "from before its masked GroupNorm, or one without the gate: re-export) "
            "(--backend openvino to use it anyway)"
        )
    if memory is not None and memory < OV_MIN_MEMORY:
        return ONNXRUNTIME, (
            f"{what} present, but only {memory / 2**30:.1f} GiB of memory is available and it holds more than ONNX "
            f"Runtime's (docs/backends.md); auto wants {OV_MIN_MEMORY >> 30} GiB (--backend openvino to use it anyway)"
        )
    return OPENVINO, f"{what}; the CPU has {isa}; {_precision(cpu)}"


def openvino_isa(cpu: CpuInfo | None) -> str | None:
    """What makes ``auto`` consider OpenVINO on ``cpu`` (the label its reasons print), or None: AMX, AVX-512 BF16,
    or AVX-512 VNNI alone (Cascade Lake, Ice Lake): OpenVINO's f32 kernels with int8 layers, which an Intel core
    without AMX runs (:mod:`~cosyvoice_cpu.backends.openvino_precision`), need no more, and with its kernels capped
    at that instruction set (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI``: the estimator's and the LM's kernels the same
    as uncapped) the int4 LM decoded faster than ONNX Runtime's int8w (:data:`LM_INT4_GAIN`; docs/backends.md, "CPUs
    with AVX-512 VNNI but no BF16"; emulated on a newer Xeon, not run on such a CPU). None: an unreadable CPU, AVX2
    alone, AVX-512 without VNNI."""
    if cpu is None:
        return None
    if cpu.amx:
        return "AMX"
    if cpu.bf16:
        return "AVX-512 BF16"
    if cpu.avx512 and "avx512_vnni" in cpu.flags:
        return "AVX-512 VNNI"
    return None


def _precision(cpu: CpuInfo) -> str:
    """The precision the OpenVINO backend compiles the estimator at on ``cpu``, for the reason."""
    from cosyvoice_cpu.backends.registry import BACKENDS

    if BACKENDS[OPENVINO].compute_precision(cpu) == "bf16":
        return "computed in bf16"
    if not (cpu.bf16 or cpu.amx):
        return "computed in f32 (this CPU has no bf16 arithmetic)"
    return (
        "computed in f32 (bf16 is kept only where it was measured faster than ONNX Runtime: AMX, AMD's AVX-512 BF16; "
        "on an Intel core without AMX its products measured slower than f32: docs/backends.md)"
    )


def _auto_lm(entry: GraphEntry, what: str, isa: str) -> tuple[str, str]:
    """(backend, reason) under ``auto`` for the stateful LM ``entry`` on a CPU with ``isa``: OpenVINO where it was
    measured faster in the whole engine, its int4 weights (docs/backends.md, "The LM on OpenVINO"; it also held
    less memory than ONNX Runtime's int8w after one sentence, so no memory floor applies; its prefills run in pieces
    of a few sizes, so it keeps memory for those sizes only, not for every prompt length: "Memory per prompt
    length")."""
    agreement = entry.attrs.get("agreement")
    agreed = "" if agreement is None else f", greedy agreement with the ONNX LM {agreement:.3f} at export"
    if entry.attrs.get("weights", entry.precision) != "int4":
        return ONNXRUNTIME, (
            f"{what} present, but OpenVINO's int8 LM was no faster than ONNX Runtime's int8w in the engine "
            "(alternated: a one-stream decode step 1.17x slower on an AVX-512 BF16 Zen 4 and as fast on an AMX Xeon, "
            "where prefill was 1.10x faster and first audio the same; the bare LM at 4 rows 1.14-1.35x faster) "
            "(--backend openvino to use it anyway; export --openvino-lm int4 for the fast one)"
        )
    return OPENVINO, (
        f"{what}, stateful{agreed}; the CPU has {isa}: OpenVINO's int4 LM decoded {LM_INT4_GAIN} than ONNX "
        "Runtime's int8w in the engine"
    )


def describe(plan: dict[str, GraphPlan]) -> list[str]:
    """``graph: backend (reason)`` per graph, those with the same backend and reason on one line (doctor, logs)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for p in plan.values():
        groups.setdefault((p.backend, p.reason), []).append(p.graph)
    return [f"{', '.join(graphs)}: {backend} ({reason})" for (backend, reason), graphs in groups.items()]
