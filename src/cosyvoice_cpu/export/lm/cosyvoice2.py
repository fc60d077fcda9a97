"""Export the CosyVoice2 LM (Qwen2 backbone + speech head) as one ONNX graph with an explicit, shared KV cache.

The graph is written node by node with ``onnx.helper`` from the reference weights (no tracing):

- per layer: ``SimplifiedLayerNormalization`` / ``com.microsoft.SkipSimplifiedLayerNormalization`` (RMSNorm, the
  residual add fused in), one fused q|k|v ``MatMul`` (D, (H + 2 Hkv) Dh) + bias ``Add``, ORT's
  ``com.microsoft.GroupQueryAttention`` (packed QKV, ``do_rotary=1`` with non-interleaved cos/sin caches of shape
  (max_len, Dh/2), past and present buffers of the full capacity (B, Hkv, max_len, Dh) so the runtime binds them
  to one buffer), ``o_proj`` ``MatMul``, and a SiLU MLP with one fused gate|up ``MatMul`` (D, 2F) and ``down``;
- after the last layer: the hidden state at position S-1 of each row, the final RMSNorm, the speech head
  ``MatMul`` (D, V) + bias (v3's head has none: no ``Add``, see :mod:`.cosyvoice3`) and ``LogSoftmax``.

Every projection is a ``MatMul`` against an initializer of shape (K, N), so ``onnxruntime.quantization``
(``quantize_dynamic`` on MatMul, ``MatMulNBitsQuantizer``) quantizes it without changes; node names are
``layers.<i>.{qkv,o,gate_up,down}`` and ``head`` so recipes can pick or exclude them.
The embedding tables are *not* in the graph: they are written as ``.npy`` files that the runtime memory-maps
(see :mod:`cosyvoice_cpu.lm.bound_graph` for the full input/output contract).

The graph itself is :mod:`.qwen2`'s (Fun-CosyVoice3 shares it); :func:`verify_lm` and :func:`compare_lm` are
:mod:`.common`'s, given this family's :data:`GATE`.
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
from cosyvoice_cpu.lm_files import EMBEDDING_FILES, GRAPH_FILE

logger = logging.getLogger(__name__)

# The LM gate's view of the CosyVoice2 graph (each family's graph module gives its own).
GATE = LMGate(facts("cosyvoice2"), lm_attrs, text_vocab)


def export_lm(lm: Any, out_dir: Path, max_len: int = 2048) -> list[GraphArtifact]:
    """Write ``lm.onnx`` (+ ``lm.onnx.data``) and the three embedding ``.npy`` tables into ``out_dir``.

    Args:
        lm: the reference ``Qwen2LM`` (fp32, eval).
        out_dir: the deployable model directory (created if missing).
        max_len: KV cache capacity in positions (prompt + generated tokens of one request).
    Returns:
        one GraphArtifact ``lm`` whose ``attrs`` hold the runtime facts (see :func:`lm_attrs`).
    """
    if max_len <= 0:
        raise ConfigError(f"max_len must be positive, got {max_len}")
    if max_len > (limit := lm.cfg.qwen.max_position_embeddings):
        raise ConfigError(f"max_len {max_len} exceeds the model's max_position_embeddings {limit}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {
        "text": lm.backbone.embed_tokens.weight,
        "speech": lm.speech_embedding.weight,
        "special": lm.llm_embedding.weight,
    }
    for key, weight in tables.items():
        np.save(out_dir / EMBEDDING_FILES[key], weight.detach().float().cpu().numpy())
    cos, sin = rope_tables(lm, max_len)
    model = build_lm_model(lm_weights(lm), cos, sin, lm.cfg.qwen)
    save_onnx(model, out_dir / GRAPH_FILE)
    del model
    logger.info(
        "wrote %s (%d layers, max_len %d) and embedding tables",
        out_dir / GRAPH_FILE,
        lm.cfg.qwen.num_hidden_layers,
        max_len,
    )
    # inputs/outputs (with their docs, IO_DOCS) are read back from the graph
    return [GraphArtifact.of(out_dir, "lm", GRAPH_FILE, lm_attrs(lm, max_len))]


def verify_lm(
    lm: Any,
    out_dir: Path,
    seed: int = 0,
    graph_file: str = GRAPH_FILE,
    tolerance: float | Mapping[str, float] | None = None,
) -> list[GateResult]:
    """:func:`cosyvoice_cpu.export.lm.common.verify_lm` with this family's :data:`GATE`."""
    return common.verify_lm(lm, out_dir, GATE, seed=seed, graph_file=graph_file, tolerance=tolerance)


def compare_lm(lm: Any, out_dir: Path, graph_file: str = GRAPH_FILE, steps: int = 200, seed: int = 0) -> dict:
    """:func:`cosyvoice_cpu.export.lm.common.compare_lm` with this family's :data:`GATE`."""
    return common.compare_lm(lm, out_dir, GATE, graph_file=graph_file, steps=steps, seed=seed)
