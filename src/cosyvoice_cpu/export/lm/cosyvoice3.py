"""Export the Fun-CosyVoice3 (v3) LM with the CosyVoice2 ``lm.onnx`` contract, so the v2 runtime runs it unchanged.

The backbone is CosyVoice2's Qwen2, so the graph is the one :func:`cosyvoice_cpu.export.lm.qwen2.build_lm_model`
writes node by node (GroupQueryAttention, fused qkv/gate_up MatMuls named ``layers.<i>.{qkv,o,gate_up,down}`` and
``head``, so the recipe's quantizers act on it as on v2). What differs is at the ends:

- ``speech_embedding`` (S + 200, D), S = 6561, holds the specials: sos = row S, eos = S + 1, task_id = S + 2.
  The tables are cut to the v2 layout so :func:`cosyvoice_cpu.lm.prompt.assemble` needs no v3 branch:

  ``lm_text_embedding.npy``    (151936, D) Qwen2 ``embed_tokens``
  ``lm_speech_embedding.npy``  (S, D)      rows 0 .. S-1 (the only ids the runtime feeds back)
  ``lm_special_embedding.npy`` (2, D)      [speech_embedding[S] (sos), speech_embedding[S + 2] (task_id)]

- the head ``llm_decoder`` is a bias-free Linear(D, S + 200): ``head`` MatMul (D, S + 200), no bias Add, then the
  log-softmax -> ``logp`` (B, S + 200);
- every id >= S stops decoding (``stop_ids`` = S .. S + 199, ``eos_id`` S + 1), and below ``min_len`` the official
  code masks id S (sos), not eos (``min_len_masked_id``); ``prompt_text ⊕ text`` must hold ``<|endofprompt|>``
  (``endofprompt_id`` 151646). :func:`lm_facts_v3` gives those facts for the manifest's ``lm`` section;
  :class:`cosyvoice_cpu.lm.generate.LMFacts` reads them.

:func:`verify_lm` and :func:`compare_lm` are :mod:`.common`'s (given :data:`GATE`): prefill,
cached decode, ragged batch, greedy agreement and KL gates through the runtime's ``LMSession``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, LMGate, save_onnx
from cosyvoice_cpu.export.lm import common
from cosyvoice_cpu.export.lm.qwen2 import build_lm_model, lm_attrs, lm_weights, rope_tables, text_vocab
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.lm_files import EMBEDDING_FILES, GRAPH_FILE, SPECIALS

logger = logging.getLogger(__name__)

__all__ = ["QUANT_TOLERANCE", "compare_lm", "export_lm", "lm_attrs_v3", "lm_facts_v3", "lm_tables_v3", "verify_lm"]

# Gate tolerances of quantized v3 graphs (the stage planner's are v2's). The v3 fixtures' head is larger than v2's,
# so their distributions are sharp (logit std 3 vs 0.6, entropy ~5 nats vs 8.6), as real ones are, and the same
# weight error moves the KL far more. Measured (verify seeds 0-2 full size, 0-7 tiny), int8 / int8w / int4:
#   full-size random v3 LM: logp rel err 3.5e-2..4.0e-2 / 1.6e-2..2.1e-2 / 0.16..0.22, KL 1.8e-2 / 4.3e-3..5.3e-3 /
#     0.47..0.60 nats, greedy mismatch <= 2/9 / 3/9 / 6/9, batch 2.5e-2..2.8e-2 / 0 / 0;
#   tiny: logp 9e-3..1.5e-2 / 6e-3..1.1e-2 / 6.7e-2..0.11, KL 9.6e-4..1.7e-3 / 7.5e-4..1.1e-3 / 8.9e-2..0.14.
# fp16 tables alone (tiny): logp 1.9e-4, KL 3e-7. Bounds: ~3x the full-size values ("not broken", as for v2).
QUANT_TOLERANCE: dict[str, dict[str, float]] = {
    "lm:fp32": {"logp": 0.01, "greedy_mismatch": 0.23, "decode_kl": 1e-4},  # fp32 graph, fp16 tables
    "lm:int8": {"logp": 0.12, "batch_vs_single": 0.1, "greedy_mismatch": 0.56, "decode_kl": 0.06},
    "lm:int8w": {"logp": 0.06, "batch_vs_single": 1e-5, "greedy_mismatch": 0.56, "decode_kl": 0.02},
    "lm:int8w-b128": {"logp": 0.06, "batch_vs_single": 1e-5, "greedy_mismatch": 0.56, "decode_kl": 0.02},
    "lm:int4": {"logp": 0.6, "batch_vs_single": 1e-5, "greedy_mismatch": 0.89, "decode_kl": 2.0},
}


def _check_v3(lm: Any) -> None:
    """Raise ConfigError unless ``lm`` is the reference ``CosyVoice3LM`` (its config type, a bias-free head)."""
    from cosyvoice_cpu.reference.lm.cosyvoice3 import CosyVoice3LMConfig

    if not isinstance(lm.cfg, CosyVoice3LMConfig) or getattr(lm.llm_decoder, "bias", None) is not None:
        raise ConfigError(
            f"{type(lm).__name__} is not a Fun-CosyVoice3 LM (CosyVoice3LM); export CosyVoice2 with "
            "cosyvoice_cpu.export.lm.cosyvoice2 and CosyVoice-300M with cosyvoice_cpu.export.lm.cosyvoice"
        )


def lm_attrs_v3(lm: Any, max_len: int) -> dict[str, Any]:
    """The ``attrs`` of the v3 ``lm`` artifact: :func:`.qwen2.lm_attrs` with the v3 head and stop facts.

    ``speech_vocab`` S + 200 (head outputs), ``speech_rows`` S (speech table rows), ``eos_id`` S + 1, ``stop_ids``
    S .. S + 199, ``min_len_masked_id`` S, ``endofprompt_id`` 151646.
    """
    c = lm.cfg
    return {
        **lm_attrs(lm, max_len),
        "speech_vocab": c.n_outputs,
        "speech_rows": c.speech_token_size,
        "eos_id": c.eos_id,
        "stop_ids": list(c.stop_ids),
        "min_len_masked_id": c.min_len_masked_id,
        "endofprompt_id": c.endofprompt_id,
    }


# The LM gate's view of the v3 graph: v2's prompt (Qwen2 text table), v3's head and stop facts.
GATE = LMGate(facts("cosyvoice3"), lm_attrs_v3, text_vocab)


def lm_facts_v3(lm: Any) -> dict[str, Any]:
    """The manifest ``lm`` section of a v3 model directory (the exporter adds ``sos_row``, ``task_id_row`` and
    ``embedding_precision`` as for v2)."""
    c = lm.cfg
    return {
        "speech_token_size": c.speech_token_size,
        "eos_id": c.eos_id,
        "stop_ids": list(c.stop_ids),
        "min_len_masked_id": c.min_len_masked_id,
        "endofprompt_id": c.endofprompt_id,
        "min_token_text_ratio": c.min_token_text_ratio,
        "max_token_text_ratio": c.max_token_text_ratio,
    }


def lm_tables_v3(lm: Any) -> dict[str, np.ndarray]:
    """The three embedding tables (float32) keyed like :data:`cosyvoice_cpu.lm_files.EMBEDDING_FILES`."""
    import torch

    c = lm.cfg
    with torch.no_grad():
        speech = lm.speech_embedding.weight.detach().float().cpu()
        special = torch.zeros(len(SPECIALS), speech.shape[1])
        special[SPECIALS["sos"]] = speech[c.sos_id]
        special[SPECIALS["task_id"]] = speech[c.task_id]
        text = lm.backbone.embed_tokens.weight.detach().float().cpu()
        return {
            "text": text.numpy(),
            "speech": speech[: c.speech_token_size].numpy().copy(),
            "special": special.numpy(),
        }


def export_lm(lm: Any, out_dir: Path, max_len: int = 2048) -> list[GraphArtifact]:
    """Write ``lm.onnx`` (+ ``lm.onnx.data``) and the three embedding ``.npy`` tables of a v3 LM into ``out_dir``.

    Args:
        lm: the reference ``CosyVoice3LM`` (fp32, eval).
        out_dir: the deployable model directory (created if missing).
        max_len: KV cache capacity in positions (prompt + generated tokens of one request).
    Returns:
        one GraphArtifact ``lm`` whose ``attrs`` are :func:`lm_attrs_v3`.
    """
    _check_v3(lm)
    q = lm.cfg.qwen
    if max_len <= 0:
        raise ConfigError(f"max_len must be positive, got {max_len}")
    if max_len > q.max_position_embeddings:
        raise ConfigError(f"max_len {max_len} exceeds the model's max_position_embeddings {q.max_position_embeddings}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for key, table in lm_tables_v3(lm).items():
        np.save(out_dir / EMBEDDING_FILES[key], table)
    cos, sin = rope_tables(lm, max_len)
    model = build_lm_model(lm_weights(lm), cos, sin, q)  # bias-free head (_check_v3): no Add after ``head``
    model.graph.name = "cosyvoice3_lm"
    save_onnx(model, out_dir / GRAPH_FILE)
    del model
    logger.info(
        "wrote %s (v3: %d layers, %d-way head, max_len %d) and embedding tables",
        out_dir / GRAPH_FILE,
        q.num_hidden_layers,
        lm.cfg.n_outputs,
        max_len,
    )
    return [GraphArtifact.of(out_dir, "lm", GRAPH_FILE, lm_attrs_v3(lm, max_len))]


def verify_lm(
    lm: Any,
    out_dir: Path,
    seed: int = 0,
    graph_file: str = GRAPH_FILE,
    tolerance: float | Mapping[str, float] | None = None,
) -> list[GateResult]:
    """The numerics gates of :func:`cosyvoice_cpu.export.lm.common.verify_lm` on a v3 graph (fp32 or quantized).

    The prompt gate covers the special rows (sos and task_id come from the cut special table); the greedy tokens
    fed back are the argmax over the S speech rows (a stop id is never fed back).
    """
    _check_v3(lm)
    return common.verify_lm(lm, out_dir, GATE, seed=seed, graph_file=graph_file, tolerance=tolerance)


def compare_lm(lm: Any, out_dir: Path, graph_file: str = GRAPH_FILE, steps: int = 200, seed: int = 0) -> dict:
    """Teacher-forced comparison of a v3 graph against the reference (:func:`.common.compare_lm`)."""
    _check_v3(lm)
    return common.compare_lm(lm, out_dir, GATE, graph_file=graph_file, steps=steps, seed=seed)
