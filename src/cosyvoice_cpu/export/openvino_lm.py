"""``export --openvino``'s LM part: the Qwen2 LM (CosyVoice2, Fun-CosyVoice3) as a stateful OpenVINO model.

Written beside the ONNX graphs as ``lm.ov.xml`` + ``lm.ov.bin`` (manifest key ``lm_ov``) when the family's LM is
the Qwen2 LM (:attr:`cosyvoice_cpu.export.families.ExportFamily.stateful_lm`) and ``--openvino-lm`` is not
``none``: int8 weights by default (NNCF ``INT8_ASYM``), int4 with ``--openvino-lm int4``. The model and its
contract (KV cache as model state, ``beam_idx``): :mod:`cosyvoice_cpu.export.lm.openvino_stateful`. What runs it is
the OpenVINO backend, chosen for the ``lm`` graph by :mod:`cosyvoice_cpu.backends.plan`.

The entry's attrs are the ``lm`` entry's (the LM's facts and its embedding tables, which both forms share) plus
``backend: openvino``, ``stateful: true``, ``weights`` and ``agreement``: the teacher-forced greedy-argmax
agreement of this model with the directory's own ``lm.onnx`` (at the recipe's precision, on ONNX Runtime) on
held-out random prompts, both run through the runtime's ``LMSession`` as the engine runs them
(:mod:`cosyvoice_cpu.export.lm.agreement`).
It is recorded and printed, never a refusal: random-weight fixtures have near-flat distributions whose argmax
flips easily (measured on the full-size fixture: docs/quantization.md, "The LM on OpenVINO").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cosyvoice_cpu.backends.base import OPENVINO, SessionConfig
from cosyvoice_cpu.export.common import GraphArtifact
from cosyvoice_cpu.export.lm.agreement import Agreement, SessionForm, random_prompts, teacher_forced_agreement
from cosyvoice_cpu.export.lm.openvino_stateful import OV_LM_FILE, check_extra, export_stateful_lm
from cosyvoice_cpu.export.openvino_graphs import io_specs_ov
from cosyvoice_cpu.lm.session import LMSession

logger = logging.getLogger(__name__)

KEY = "lm_ov"
CHOICES = ("none", "int8", "int4")  # --openvino-lm; none: no OpenVINO LM is written
DEFAULT = "int8"
# the agreement's prompts: held out from the LM gate's (seed + AGREEMENT_SEED), each AGREEMENT_LENGTH positions
# (fewer when the KV cache is short), then AGREEMENT_STEPS teacher-forced positions
AGREEMENT_PROMPTS, AGREEMENT_LENGTH, AGREEMENT_STEPS, AGREEMENT_SEED = 3, 64, 32, 300
# attrs of the lm entry that describe the ONNX graph's own quantization, not the OpenVINO model's
ONNX_ONLY_ATTRS = ("int8_weight_bits",)

Step = Callable[[str], None]


def measure_agreement(out: Path, attrs: dict[str, Any], seed: int, threads: int = 2) -> tuple[Agreement, str]:
    """The agreement of ``out/lm.ov.xml`` with ``out/lm.onnx`` (its reference) on held-out random prompts, both
    run as the engine runs them (:class:`~cosyvoice_cpu.lm.session.LMSession`, the OpenVINO model opened through
    the backend seam)."""
    onnx = LMSession.from_dir(out, attrs, threads=threads)
    ov = LMSession.from_dir(out, attrs, OV_LM_FILE, SessionConfig(threads=threads, backend=OPENVINO))
    steps = AGREEMENT_STEPS
    length = min(AGREEMENT_LENGTH, onnx.spec.max_len - steps - 1)
    prompts = random_prompts(onnx, AGREEMENT_PROMPTS, length, seed + AGREEMENT_SEED)
    result = teacher_forced_agreement(SessionForm(ov), SessionForm(onnx), prompts, steps, rows=onnx.spec.speech_rows)
    return result, onnx.graph.name


def agreement_line(attrs: dict[str, Any]) -> str:
    """One line for the export summary from an ``lm_ov`` entry's attrs."""
    a = attrs.get("agreement")
    if a is None:
        return f"{KEY}: stateful OpenVINO LM, {attrs.get('weights')} weights (agreement not measured: --no-verify)"
    of = attrs.get("agreement_of", {})
    return (
        f"{KEY}: stateful OpenVINO LM, {attrs.get('weights')} weights: greedy agreement with "
        f"{of.get('reference', 'lm.onnx')} {a:.3f} over {of.get('prompts')} random prompts x {of.get('steps')} "
        f"teacher-forced steps (mean KL {of.get('mean_kl', float('nan')):.2g} nats; random weights flip argmax "
        "more easily than a trained LM)"
    )


def export_openvino_lm(
    lm: Any, out: Path, onnx_lm: GraphArtifact, weights: str, seed: int, step: Step, verify: bool = True
) -> GraphArtifact:
    """Write ``lm.ov.xml/.bin`` with ``weights`` (``int8`` or ``int4``) into ``out`` (which holds the exported
    ``lm.onnx``, artifact ``onnx_lm``, and its embedding tables); return its artifact. ``verify``: measure the
    agreement with ``lm.onnx`` (else recorded as None)."""
    check_extra(weights)
    t0 = time.perf_counter()
    step(f"LM: OpenVINO stateful model ({weights} weights)")
    path = export_stateful_lm(lm, out, weights=weights)
    attrs = {k: v for k, v in onnx_lm.attrs.items() if k not in ONNX_ONLY_ATTRS}
    attrs.update(backend="openvino", form_of="lm", stateful=True, weights=weights, agreement=None)
    if verify:
        step(f"LM: greedy agreement of the OpenVINO {weights} LM with lm.onnx ({onnx_lm.precision})")
        result, graph = measure_agreement(out, onnx_lm.attrs, seed)
        attrs["agreement"] = round(result.agreement, 4)
        attrs["agreement_of"] = {
            "reference": f"{graph} ({onnx_lm.precision})",
            "prompts": result.prompts,
            "steps": result.steps,
            "mean_kl": result.mean_kl,
        }
    line = agreement_line(attrs)
    logger.info("%s", line)
    step(line)
    inputs, outputs = io_specs_ov(path)
    logger.info("OpenVINO stateful LM written in %.1f s", time.perf_counter() - t0)
    return GraphArtifact(KEY, OV_LM_FILE, [OV_LM_FILE[: -len(".xml")] + ".bin"], weights, inputs, outputs, attrs)
