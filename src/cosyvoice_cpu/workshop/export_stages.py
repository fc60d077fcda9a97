"""Per-stage export steps: fp32 graphs, their numerics gate, the recipe's quantization, the quantized gate.

One stage at a time is loaded in PyTorch and freed before the next, which keeps the export's peak memory near
the largest stage (the LM) instead of the whole model.
"""

from __future__ import annotations

import gc
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ExportError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact
from cosyvoice_cpu.export.quantize import (
    Recipe,
    convert_embedding,
    quantize_int8_dynamic,
    quantize_nbits,
)
from cosyvoice_cpu.lm_files import MIN_ROWS_KEY
from cosyvoice_cpu.workshop.parts import export_family, load_reference

logger = logging.getLogger(__name__)

Step = Callable[[str], None]

# Gate tolerances of quantized graphs (fp32 gates use each verifier's own, much tighter, defaults), about 3-10x
# the values measured on the tiny and full-size random-weight fixtures (recorded in each export's manifest):
# LM logp rel err int8 1.4e-3..4.7e-3, int8w 1.4e-3..2.3e-3, int4 1.3e-2..2.8e-2; mean KL over the 9 gate steps
# int8 8e-6..5e-5, int8w 8e-6..2e-5, int4 8e-4..2.1e-3; greedy argmax mismatch 0..3 of 9 steps (random weights give
# near-flat distributions, so it is loose and KL is the real gate). MatMulNBits rows are independent: a batched row
# equals the row alone exactly. Estimator int8 (reduce_range): velocity 1.4-3.6 %, whole-flow mel 1 %. Flow encoder
# int8w (int8 compute): mu 9.6e-3..1.45e-2 (full-size and demo fixtures).
# HiFT int8w: decode 6.9e-3, wave 1.2e-2.
# Dynamic int8 (u8 activations x s8 weights) stores 7-bit weights (reduce_range) for every stage. Without VNNI (an
# AVX2-only CPU: Zen 3 EPYC, Haswell..Comet Lake) ORT's u8s8 GEMM sums pairs of products in int16 (vpmaddubsw),
# which saturates with full 8-bit weights: on a Zen 3 EPYC the tiny LM's next-token agreement with PyTorch over 150
# teacher-forced steps was 0.65 with 8-bit weights and 0.97 with 7 (KL 6.3e-3 vs 1.6e-5), and the estimator's
# velocity error 8.7-12 % with 8 bits (0.6-3.6 % with VNNI). 7 bits are exact on every ISA, so a model
# directory behaves the same on the machine that exported it and on the gateway it is copied to. The manifest
# records the bits (attrs int8_weight_bits); hardware.Hardware.int8_warning flags older 8-bit LM exports.
INT8_WEIGHT_BITS = 7
_LM_8BIT = {"logp": 0.02, "greedy_mismatch": 0.34, "decode_kl": 5e-4}
QUANT_TOLERANCE: dict[str, dict[str, Any]] = {
    "lm:fp32": {"logp": 0.01, "greedy_mismatch": 0.23, "decode_kl": 1e-4},  # fp32 graph, fp16 embedding tables
    "lm:int8": _LM_8BIT,
    "lm:int8w": {**_LM_8BIT, "batch_vs_single": 1e-5},
    "lm:int8w-b128": {**_LM_8BIT, "batch_vs_single": 1e-5},  # full size: logp 3.3e-3, 300-step KL 2.5e-5
    "lm:int4": {"logp": 0.1, "batch_vs_single": 1e-5, "greedy_mismatch": 0.56, "decode_kl": 0.02},
    "flow_estimator:int8": {"estimator": 0.08, "mel": 0.08},
    "flow_encoder:int8w": {"encoder": 0.05, "mel": 0.03},
    "flow_estimator:int8+flow_encoder:int8w": {"encoder": 0.05, "estimator": 0.08, "mel": 0.08},
    "hift:int8w": {"decode": 0.02, "wave": 0.05},
}


def _passed(gates: list[GateResult], new: list[GateResult]) -> list[GateResult]:
    """Append ``new`` to ``gates``; raise :class:`ExportError` at once when one of them failed."""
    failed = [g for g in new if not g.passed]
    if failed:
        raise ExportError(
            "numerics gate failed, the export is discarded: "
            + "; ".join(str(g) for g in failed)
            + ". Re-run with --debug and report it, or choose a less aggressive --quant recipe"
        )
    return gates + new


def _move(art: GraphArtifact, src_dir: Path, dst_dir: Path) -> None:
    for name in (art.file, *art.data):
        shutil.move(str(src_dir / name), str(dst_dir / name))


def _quantize(art: GraphArtifact, precision: str, work: Path, out: Path) -> GraphArtifact:
    """Replace ``out/art.file`` (fp32) by its ``precision`` variant; the fp32 files go to ``work``."""
    if precision == "fp32":
        return art
    _move(art, out, work)
    src, dst = work / art.file, out / art.file
    lm, estimator, hift = art.key.startswith("lm"), art.key.startswith("flow_estimator"), art.key == "hift_decode"
    attrs = dict(art.attrs)
    if (lm or estimator) and precision == "int8":
        quantize_int8_dynamic(src, dst, reduce_range=True)  # 7-bit weights: INT8_WEIGHT_BITS
        attrs["int8_weight_bits"] = INT8_WEIGHT_BITS
        from cosyvoice_cpu.export.flow.common import cache_io, half_cache_io

        caches = cache_io({i.name for i in art.inputs}) if estimator else None
        if caches:  # an estimator's stream graph: its caches in float16
            half_cache_io(dst, *caches)
    elif lm and precision in ("int4", "int8w", "int8w-b128"):
        block = 128 if precision == "int8w-b128" else 32
        four = precision == "int4"  # AVX2's one-row 4-bit kernel rounds apart from the many-row one: lm.LMSession
        quantize_nbits(
            src,
            dst,
            bits=4 if four else 8,
            block_size=block,
            accuracy_level=4,
            metadata={MIN_ROWS_KEY: "2"} if four else None,
        )
    elif art.key == "flow_time" and precision == "int8":
        # run once per Euler schedule, so weight-only 8-bit (MatMulNBits, int8 compute): 164 MB on disk at full
        # size, opened for ~0.3 s with ~+190 MB (fp32 compute, accuracy 1, dequantized every weight: +400 MB)
        quantize_nbits(src, dst, bits=8, block_size=32, accuracy_level=4)
    elif art.key == "flow_encoder" and precision == "int8w":
        # int8 compute (accuracy 4, activations quantized per row and block), as the LM's int8w: every streamed
        # chunk re-encodes the prompt and its window, and at fp32 compute (accuracy 1) the weight-only layers were
        # slower than fp32 weights (docs/quantization.md, "Flow encoder `int8w` in the default recipe")
        quantize_nbits(src, dst, bits=8, block_size=32, accuracy_level=4)
    elif hift and precision == "int8w":
        from cosyvoice_cpu.export.hift.common import quantize_hift_weights_int8

        quantize_hift_weights_int8(src, dst)
    else:  # Recipe.validate() keeps other values out
        raise ValueError(f"no quantizer for {art.key}={precision}")
    for name in (art.file, *art.data):
        (work / name).unlink(missing_ok=True)
    return GraphArtifact.of(out, art.key, art.file, attrs, precision)


def gate_key(precisions: dict[str, str]) -> str:
    """The :data:`QUANT_TOLERANCE` key of a stage's quantized gate: ``field:precision`` of every non-fp32 field
    joined by ``+`` (``lm:fp32`` when only the embeddings changed)."""
    return "+".join(f"{f}:{p}" for f, p in precisions.items() if p != "fp32") or "lm:fp32"


CHECKPOINTS = {"lm": "llm.pt", "flow": "flow.pt", "hift": "hift.pt"}


def _openvino(
    module: Any, flow: Any, out: Path, work: Path, cfg: Any, arts: list[GraphArtifact], options: Any, step: Step
) -> tuple[GraphArtifact, list[GateResult]]:
    """The OpenVINO model of the flow's whole-sentence estimator (:mod:`cosyvoice_cpu.export.openvino_graphs`)."""
    from cosyvoice_cpu.export.openvino_graphs import export_openvino

    settings = {**export_family(cfg.family).flow_facts(cfg.flow), "mel": asdict(cfg.mel)}  # mel: the prompt mels
    for a in arts:
        settings.update(a.attrs)
    attrs = next(a.attrs for a in arts if a.key == "flow_estimator")
    return export_openvino(
        module.ESTIMATOR_GRAPH(flow.decoder.estimator),
        out,
        work,
        cfg.family,
        settings,
        attrs,
        options.openvino,
        options.seed,
        step,
        options.verify,
    )


def wants_openvino_lm(family: str, options: Any) -> bool:
    """Whether this export writes the stateful OpenVINO LM (``lm_ov``): ``--openvino`` given, ``--openvino-lm``
    not ``none``, and the family's LM is the Qwen2 LM
    (:attr:`~cosyvoice_cpu.export.families.ExportFamily.stateful_lm`)."""
    return options.openvino != "none" and options.openvino_lm != "none" and export_family(family).stateful_lm


def export_stage_files(
    src: Path, out: Path, cfg: Any, recipe: Recipe, options: Any, step: Step
) -> tuple[list[GraphArtifact], list[GateResult], dict[str, dict[str, Any]]]:
    """Write every stage's graphs and arrays into ``out``; return artifacts, gate results and manifest facts.

    Per stage: load the reference, write fp32 graphs, gate them, apply the recipe, gate the result again with
    :data:`QUANT_TOLERANCE`, free the reference. A failed gate raises :class:`ExportError` at once.
    """
    work = out / "_work"
    work.mkdir()
    graphs: list[GraphArtifact] = []
    gates: list[GateResult] = []
    try:
        for plan in export_family(cfg.family).plans:  # the family's graph module per stage
            module = plan.graphs()
            export, verify = getattr(module, f"export_{plan.ref}"), getattr(module, f"verify_{plan.ref}")
            step(f"{plan.name}: loading {CHECKPOINTS[plan.ref]}")
            model = getattr(load_reference(src, (plan.ref,)), plan.ref)
            step(f"{plan.name}: writing the fp32 graphs")
            arts = export(model, out, max_len=options.max_len) if plan.ref == "lm" else export(model, out)
            if options.verify:
                step(f"{plan.name}: numerics gate (fp32 vs PyTorch)")
                gates = _passed(gates, verify(model, out, seed=options.seed))
            if plan.ref == "flow" and options.openvino != "none":  # before quantizing: it calibrates on fp32 ONNX
                ov_art, ov_gates = _openvino(module, model, out, work, cfg, arts, options, step)
                gates = _passed(gates, ov_gates)
            precisions = plan.precisions(recipe)
            changed = any(p != "fp32" for p in precisions.values())
            if plan.ref == "lm" and recipe.embedding != "fp32":
                changed = True
                for table in sorted(out.glob("lm_*embedding.npy")):
                    convert_embedding(table, work / table.name, recipe.embedding)
                    shutil.move(str(work / table.name), str(table))
            arts = [
                _quantize(a, precisions[plan.quantized[a.key]], work, out) if a.key in plan.quantized else a
                for a in arts
            ]
            if changed and options.verify:
                others = [f"{f} {p}" for f, p in precisions.items() if f != plan.recipe_field and p != "fp32"]
                what = ", ".join([precisions[plan.recipe_field], *others])  # e.g. "int8, flow_encoder int8w"
                what += f", {recipe.embedding} embeddings" if plan.ref == "lm" else ""
                step(f"{plan.name}: numerics gate ({what} vs PyTorch)")
                key = gate_key(precisions)
                tol = getattr(module, "QUANT_TOLERANCE", {}).get(key) or QUANT_TOLERANCE[key]  # a family's own bounds
                checked = verify(model, out, seed=options.seed, tolerance=tol)
                for g in checked:
                    g.phase = what
                gates = _passed(gates, checked)
            if plan.ref == "lm" and wants_openvino_lm(cfg.family, options):  # after quantizing: agrees with lm.onnx
                from cosyvoice_cpu.export.openvino_lm import export_openvino_lm

                onnx_lm = next(a for a in arts if a.key == "lm")
                arts.append(
                    export_openvino_lm(model, out, onnx_lm, options.openvino_lm, options.seed, step, options.verify)
                )
            graphs += arts + ([ov_art] if plan.ref == "flow" and options.openvino != "none" else [])
            del model
            gc.collect()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for g in gates:
        logger.info("%s", g)
    return graphs, gates, {"lm": {"embedding_precision": recipe.embedding}}
