"""Per-stage export steps: fp32 graphs, their numerics gate, the recipe's quantization, the quantized gate.

One stage at a time is loaded in PyTorch and freed before the next, which keeps the export's peak memory near
the largest stage (the LM) instead of the whole model.
"""

from __future__ import annotations

import gc
import logging
import shutil
from collections.abc import Callable
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

logger = logging.getLogger(__name__)

Step = Callable[[str], None]

# Gate tolerances of quantized graphs (fp32 gates use each verifier's own, much tighter, defaults).
# Values are chosen from measurements on random-weight fixtures (docs/quantization.md) with a 2-3x margin.
QUANT_TOLERANCE: dict[str, dict[str, Any]] = {
    "lm:fp32": {"logp": 0.01},  # fp32 graph with fp16 embedding tables
    "lm:int8": {"logp": 0.05},
    "lm:int8w": {"logp": 0.05},
    "lm:int4": {"logp": 0.15},
    "flow_estimator:int8": {"estimator": 0.08, "mel": 0.08},
    "hift:int8w": {"decode": 0.02, "wave": 0.05},
}


def _passed(gates: list[GateResult], new: list[GateResult]) -> list[GateResult]:
    """Append ``new`` to ``gates``; raise :class:`ExportError` at once when one of them failed."""
    failed = [g for g in new if not g.passed]
    if failed:
        raise ExportError(
            "numerics gate failed, the export is discarded: " + "; ".join(str(g) for g in failed)
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
    lm, estimator, hift = art.key == "lm", art.key.startswith("flow_estimator"), art.key == "hift_decode"
    if lm and precision == "int8":
        quantize_int8_dynamic(src, dst, reduce_range=False)
    elif lm and precision in ("int4", "int8w"):
        quantize_nbits(src, dst, bits=4 if precision == "int4" else 8, block_size=32, accuracy_level=4)
    elif estimator and precision == "int8":
        # 7-bit weights: exact on every ISA (u8s8 products saturate on AVX2 without VNNI)
        quantize_int8_dynamic(src, dst, reduce_range=True)
    elif hift and precision == "int8w":
        from cosyvoice_cpu.export.hift_graph import quantize_hift_weights_int8

        quantize_hift_weights_int8(src, dst)
    else:  # Recipe.validate() keeps other values out
        raise ValueError(f"no quantizer for {art.key}={precision}")
    for name in (art.file, *art.data):
        (work / name).unlink(missing_ok=True)
    data = [f"{art.file}.data"] if (out / f"{art.file}.data").exists() else []
    return GraphArtifact(art.key, art.file, data, precision, art.inputs, art.outputs, art.attrs)


def export_stage_files(
    src: Path, out: Path, cfg: Any, recipe: Recipe, options: Any, step: Step
) -> tuple[list[GraphArtifact], list[GateResult], dict[str, dict[str, Any]]]:
    """Write every stage's graphs and arrays into ``out``; return artifacts, gate results and manifest facts."""
    from cosyvoice_cpu.reference.model_dir import load_reference

    work = out / "_work"
    work.mkdir()
    graphs: list[GraphArtifact] = []
    gates: list[GateResult] = []
    facts: dict[str, dict[str, Any]] = {}
    try:
        # ---------------------------------------------------------------- LM
        from cosyvoice_cpu.export.lm_graph import export_lm, verify_lm

        step("LM: loading llm.pt")
        lm = load_reference(src, ("lm",)).lm
        step("LM: writing the fp32 graph and embedding tables")
        arts = export_lm(lm, out, max_len=options.max_len)
        if options.verify:
            step("LM: numerics gate (fp32 vs PyTorch)")
            gates = _passed(gates, verify_lm(lm, out, seed=options.seed))
        if recipe.embedding != "fp32":
            for table in sorted(out.glob("lm_*embedding.npy")):
                convert_embedding(table, work / table.name, recipe.embedding)
                shutil.move(str(work / table.name), str(table))
        arts = [_quantize(a, recipe.lm, work, out) if a.key == "lm" else a for a in arts]
        if (recipe.lm, recipe.embedding) != ("fp32", "fp32") and options.verify:
            step(f"LM: numerics gate ({recipe.lm}, {recipe.embedding} embeddings vs PyTorch)")
            tol = QUANT_TOLERANCE[f"lm:{recipe.lm}"]
            gates = _passed(gates, verify_lm(lm, out, seed=options.seed, tolerance=tol))
        graphs += arts
        facts["lm"] = {"embedding_precision": recipe.embedding}
        del lm
        gc.collect()

        # ---------------------------------------------------------------- flow
        from cosyvoice_cpu.export.flow_graph import export_flow, verify_flow

        step("flow: loading flow.pt")
        flow = load_reference(src, ("flow",)).flow
        step("flow: writing the encoder and estimator graphs")
        arts = export_flow(flow, out)
        if options.verify:
            step("flow: numerics gate (fp32 vs PyTorch)")
            gates = _passed(gates, verify_flow(flow, out, seed=options.seed))
        prec = recipe.flow_estimator
        arts = [_quantize(a, prec, work, out) if a.key.startswith("flow_estimator") else a for a in arts]
        if prec != "fp32" and options.verify:
            step(f"flow: numerics gate (estimator {prec} vs PyTorch)")
            tol = QUANT_TOLERANCE[f"flow_estimator:{prec}"]
            gates = _passed(gates, verify_flow(flow, out, seed=options.seed, tolerance=tol))
        graphs += arts
        del flow
        gc.collect()

        # ---------------------------------------------------------------- HiFT
        from cosyvoice_cpu.export.hift_graph import export_hift, verify_hift

        step("HiFT: loading hift.pt")
        hift = load_reference(src, ("hift",)).hift
        step("HiFT: writing the vocoder graphs")
        arts = export_hift(hift, out)
        if options.verify:
            step("HiFT: numerics gate (fp32 vs PyTorch)")
            gates = _passed(gates, verify_hift(hift, out, seed=options.seed))
        arts = [_quantize(a, recipe.hift, work, out) if a.key == "hift_decode" else a for a in arts]
        if recipe.hift != "fp32" and options.verify:
            step(f"HiFT: numerics gate ({recipe.hift} vs PyTorch)")
            tol = QUANT_TOLERANCE[f"hift:{recipe.hift}"]
            gates = _passed(gates, verify_hift(hift, out, seed=options.seed, tolerance=tol))
        graphs += arts
        del hift
        gc.collect()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for g in gates:
        logger.info("%s", g)
    return graphs, gates, facts
