"""Export the CosyVoice2 LM (Qwen2 backbone + speech head) as one ONNX graph with an explicit, shared KV cache.

The graph is written node by node with ``onnx.helper`` from the reference weights (no tracing):

- per layer: ``SimplifiedLayerNormalization`` / ``com.microsoft.SkipSimplifiedLayerNormalization`` (RMSNorm, the
  residual add fused in), one fused q|k|v ``MatMul`` (D, (H + 2 Hkv) Dh) + bias ``Add``, ORT's
  ``com.microsoft.GroupQueryAttention`` (packed QKV, ``do_rotary=1`` with non-interleaved cos/sin caches of shape
  (max_len, Dh/2), past and present buffers of the full capacity (B, Hkv, max_len, Dh) so the runtime binds them
  to one buffer), ``o_proj`` ``MatMul``, and a SiLU MLP with one fused gate|up ``MatMul`` (D, 2F) and ``down``;
- after the last layer: the hidden state at position S-1 of each row, the final RMSNorm, the speech head
  ``MatMul`` (D, V) + bias (v3's head has none: no ``Add``, see :mod:`.lm_graph_v3`) and ``LogSoftmax``.

Every projection is a ``MatMul`` against an initializer of shape (K, N), so ``onnxruntime.quantization``
(``quantize_dynamic`` on MatMul, ``MatMulNBitsQuantizer``) quantizes it without changes; node names are
``layers.<i>.{qkv,o,gate_up,down}`` and ``head`` so recipes can pick or exclude them.
The embedding tables are *not* in the graph: they are written as ``.npy`` files that the runtime memory-maps
(see :mod:`cosyvoice_cpu.lm.session` for the full input/output contract).

:func:`verify_lm` runs a written graph through the runtime's :class:`~cosyvoice_cpu.lm.session.LMSession` against the
reference (prefill, cached decode, a ragged batch, greedy agreement, KL); :func:`compare_lm` teacher-forces a long
random token sequence for quantization reports.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import OPSET, GateResult, GraphArtifact, LMGate, io_specs, rel_err, save_onnx
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.lm.files import EMBEDDING_FILES, GRAPH_FILE, SPECIALS, TEXT_ENCODER_FILE
from cosyvoice_cpu.lm.kv_cache import past_names, present_names

logger = logging.getLogger(__name__)

IR_VERSION = 8  # opset 17's IR; keeps the graph loadable by older onnxruntime releases

IO_DOCS = {
    "inputs_embeds": "float32 (B, S, D): embeddings of the S new positions of each row",
    "seqlens_k": "int32 (B,): valid cache positions of each row after this call, minus one",
    "total_sequence_length": "int32 scalar: max over rows of seqlens_k + 1",
    "logp": "float32 (B, V): log-softmax of the speech head at position S-1 of each row",
    "past": "float32 (B, Hkv, max_len, Dh): layer cache before the call; bind the same buffer as the present",
    "present": "float32 (B, Hkv, max_len, Dh): layer cache after the call (the past buffer, updated in place)",
}


def lm_weights(lm: Any) -> dict[str, np.ndarray]:
    """The reference ``Qwen2LM``'s weights in graph layout: MatMul weights as (K, N) float32 arrays."""
    import torch

    def t(p: torch.Tensor) -> np.ndarray:
        return p.detach().to(torch.float32).cpu().numpy()

    w: dict[str, np.ndarray] = {}
    for i, layer in enumerate(lm.backbone.layers):
        a, m = layer.self_attn, layer.mlp
        w[f"layers.{i}.ln_in"] = t(layer.input_layernorm.weight)
        w[f"layers.{i}.ln_post"] = t(layer.post_attention_layernorm.weight)
        w[f"layers.{i}.qkv.weight"] = np.concatenate([t(a.q_proj.weight), t(a.k_proj.weight), t(a.v_proj.weight)]).T
        w[f"layers.{i}.qkv.bias"] = np.concatenate([t(a.q_proj.bias), t(a.k_proj.bias), t(a.v_proj.bias)])
        w[f"layers.{i}.o.weight"] = t(a.o_proj.weight).T
        w[f"layers.{i}.gate_up.weight"] = np.concatenate([t(m.gate_proj.weight), t(m.up_proj.weight)]).T
        w[f"layers.{i}.down.weight"] = t(m.down_proj.weight).T
    w["norm"] = t(lm.backbone.norm.weight)
    w["head.weight"] = t(lm.llm_decoder.weight).T
    if lm.llm_decoder.bias is not None:  # v3's head has no bias: no "head.bias", no Add in the graph
        w["head.bias"] = t(lm.llm_decoder.bias)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def rope_tables(lm: Any, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """GQA's cos/sin caches (max_len, Dh/2), computed exactly as the reference's RoPE (fp32 angles)."""
    import torch

    from cosyvoice_cpu.reference.qwen2 import rope_cos_sin

    cos, sin = rope_cos_sin(lm.cfg.qwen, torch.arange(max_len))
    half = lm.cfg.qwen.head_dim // 2
    return cos[:, :half].numpy().astype(np.float32), sin[:, :half].numpy().astype(np.float32)


def build_lm_model(weights: dict[str, np.ndarray], cos: np.ndarray, sin: np.ndarray, cfg: Any) -> Any:
    """The ``onnx.ModelProto`` of the LM graph for a ``Qwen2Config`` ``cfg``
    (contract: :mod:`cosyvoice_cpu.lm.session`)."""
    from onnx import TensorProto, helper, numpy_helper

    n_layers, d, eps = cfg.num_hidden_layers, cfg.hidden_size, float(cfg.rms_norm_eps)
    h, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    max_len, vocab = cos.shape[0], weights["head.weight"].shape[1]
    nodes: list[Any] = []
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    inits += [
        numpy_helper.from_array(cos, "rope.cos"),
        numpy_helper.from_array(sin, "rope.sin"),
        numpy_helper.from_array(np.array(-1, np.int64), "last_index"),
    ]

    def node(op: str, ins: list[str], outs: list[str], name: str, domain: str = "", **attrs: Any) -> None:
        nodes.append(helper.make_node(op, ins, outs, name=name, domain=domain, **attrs))

    def matmul(x: str, w: str, name: str) -> str:
        node("MatMul", [x, w], [f"{name}.out"], name)
        return f"{name}.out"

    x, residual = "inputs_embeds", "inputs_embeds"
    node(
        "SimplifiedLayerNormalization",
        [x, "layers.0.ln_in"],
        ["layers.0.ln_in.out"],
        "layers.0.ln_in",
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )
    normed = "layers.0.ln_in.out"
    for i in range(n_layers):
        p = f"layers.{i}"
        qkv = matmul(normed, f"{p}.qkv.weight", f"{p}.qkv")
        node("Add", [qkv, f"{p}.qkv.bias"], [f"{p}.qkv.biased"], f"{p}.qkv.bias_add")
        pk, pv = past_names(i)
        ok, ov = present_names(i)
        node(
            "GroupQueryAttention",
            [f"{p}.qkv.biased", "", "", pk, pv, "seqlens_k", "total_sequence_length", "rope.cos", "rope.sin"],
            [f"{p}.attn.out", ok, ov],
            f"{p}.attn",
            domain="com.microsoft",
            num_heads=h,
            kv_num_heads=hkv,
            do_rotary=1,
            rotary_interleaved=0,
        )
        attn = matmul(f"{p}.attn.out", f"{p}.o.weight", f"{p}.o")
        node(
            "SkipSimplifiedLayerNormalization",
            [attn, residual, f"{p}.ln_post"],
            [f"{p}.ln_post.out", "", "", f"{p}.resid_attn"],
            f"{p}.ln_post",
            domain="com.microsoft",
            epsilon=eps,
        )
        residual = f"{p}.resid_attn"
        gate_up = matmul(f"{p}.ln_post.out", f"{p}.gate_up.weight", f"{p}.gate_up")
        node("Split", [gate_up], [f"{p}.gate", f"{p}.up"], f"{p}.split", axis=-1)
        node("Sigmoid", [f"{p}.gate"], [f"{p}.gate.sigmoid"], f"{p}.sigmoid")
        node("Mul", [f"{p}.gate", f"{p}.gate.sigmoid"], [f"{p}.silu"], f"{p}.silu")
        node("Mul", [f"{p}.silu", f"{p}.up"], [f"{p}.act"], f"{p}.act")
        x = matmul(f"{p}.act", f"{p}.down.weight", f"{p}.down")
        if i + 1 < n_layers:
            q = f"layers.{i + 1}"
            node(
                "SkipSimplifiedLayerNormalization",
                [x, residual, f"{q}.ln_in"],
                [f"{q}.ln_in.out", "", "", f"{p}.resid_mlp"],
                f"{q}.ln_in",
                domain="com.microsoft",
                epsilon=eps,
            )
            normed, residual = f"{q}.ln_in.out", f"{p}.resid_mlp"
    node("Add", [x, residual], ["hidden"], "final_residual")
    node("Gather", ["hidden", "last_index"], ["hidden_last"], "last_position", axis=1)
    node(
        "SimplifiedLayerNormalization",
        ["hidden_last", "norm"],
        ["hidden_normed"],
        "norm",
        axis=-1,
        epsilon=eps,
        stash_type=1,
    )
    logits = matmul("hidden_normed", "head.weight", "head")
    if "head.bias" in weights:
        node("Add", [logits, "head.bias"], ["logits"], "head.bias_add")
        logits = "logits"
    node("LogSoftmax", [logits], ["logp"], "log_softmax", axis=-1)

    kv = ["batch", hkv, max_len, dh]
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("inputs_embeds", f32, ["batch", "seq", d], IO_DOCS["inputs_embeds"])]
    outputs = [helper.make_tensor_value_info("logp", f32, ["batch", vocab], IO_DOCS["logp"])]
    for i in range(n_layers):
        inputs += [helper.make_tensor_value_info(n, f32, kv, IO_DOCS["past"]) for n in past_names(i)]
        outputs += [helper.make_tensor_value_info(n, f32, kv, IO_DOCS["present"]) for n in present_names(i)]
    inputs.append(helper.make_tensor_value_info("seqlens_k", i32, ["batch"], IO_DOCS["seqlens_k"]))
    inputs.append(helper.make_tensor_value_info("total_sequence_length", i32, [], IO_DOCS["total_sequence_length"]))
    # onnx shape inference does not know the ORT-only ops, so every intermediate tensor gets its type here:
    # onnxruntime.quantization needs it to quantize the MatMuls behind them.
    known = {v.name for v in (*inputs, *outputs)}
    typed = [helper.make_tensor_value_info(o, f32, None) for n in nodes for o in n.output if o and o not in known]
    graph = helper.make_graph(nodes, "cosyvoice2_lm", inputs, outputs, initializer=inits, value_info=typed)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="cosyvoice-cpu",
    )
    model.ir_version = IR_VERSION
    return model


def lm_attrs(lm: Any, max_len: int) -> dict[str, Any]:
    """The ``attrs`` of the lm GraphArtifact (:class:`cosyvoice_cpu.lm.kv_cache.LMSpec` fields plus file names)."""
    q = lm.cfg.qwen
    return {
        "max_len": max_len,
        "num_layers": q.num_hidden_layers,
        "num_heads": q.num_attention_heads,
        "kv_heads": q.num_key_value_heads,
        "head_dim": q.head_dim,
        "hidden": q.hidden_size,
        "speech_vocab": lm.cfg.speech_token_size + 3,
        "text_vocab": q.vocab_size,
        "speech_token_size": lm.cfg.speech_token_size,
        "eos_id": lm.cfg.eos_id,
        "stop_ids": list(lm.cfg.stop_ids),
        "rope_theta": q.rope_theta,
        "embeddings": dict(EMBEDDING_FILES),
        "specials": dict(SPECIALS),
    }


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


# ---- verification ---------------------------------------------------------------------------------------------

# fp32 on the tiny and the full-size random fixtures: logp rel err ~2e-7 vs the reference, 0 batch vs single,
# KL ~1e-13, embeddings exact. Real checkpoints have larger activations, hence the margin.
FP32_TOLERANCES = {
    "embeddings": 0.0,  # rel err of the gathered prompt embeddings (an exact copy of the tables)
    "prefill_logp": 1e-4,  # rel err of logp after a 20-40 position prompt
    "decode_logp": 1e-4,  # max rel err of logp over 8 cached decode steps
    "batch_vs_single": 1e-5,  # rel err of a 2-row ragged batch vs the same rows run alone (graph vs graph)
    "greedy_mismatch": 0.0,  # fraction of the 9 teacher-forced steps whose argmax differs from the reference
    "decode_kl": 1e-6,  # mean KL(ref || graph) over those 9 steps, nats
}
# Any explicit ``tolerance`` starts from these (a quantized graph, perhaps fp16 tables): "not broken" bounds.
# Full-size random fixture, int8 dynamic / 4-bit MatMulNBits: logp 4.4e-3 / 2.8e-2, batch 4.7e-3 / 0 (dynamic
# int8 quantizes activations per tensor, so rows of a batch change each other), mismatch 0 / 0.11, KL 5e-5 / 2e-3.
LOOSE_TOLERANCES = {
    "embeddings": 1e-3,  # fp16 tables round at 2^-11
    "prefill_logp": 0.05,
    "decode_logp": 0.05,
    "batch_vs_single": 0.05,
    "greedy_mismatch": 0.5,  # random-weight distributions are flat, so argmax flips easily
    "decode_kl": 0.1,
}
LOGP_GATES = ("prefill_logp", "decode_logp", "batch_vs_single")
# CosyVoice-300M prompt embeddings pass through the text-encoder graph, so they are computed, not copied: fp32
# 1.1e-7 on the tiny fixture; a quantized text encoder (the LM recipe's precision) is bounded like the logp.
V1_EMBEDDINGS = {"fp32": 1e-5, "quantized": 0.05}
DECODE_STEPS = 8


def _tolerances(tolerance: float | Mapping[str, float] | None) -> dict[str, float]:
    """None: :data:`FP32_TOLERANCES`. A number or a mapping: :data:`LOOSE_TOLERANCES` overridden by it; a number
    (or the key ``logp``) sets the three logp gates, other keys set one gate each."""
    if tolerance is None:
        return dict(FP32_TOLERANCES)
    tol = dict(LOOSE_TOLERANCES)
    given = {"logp": float(tolerance)} if isinstance(tolerance, (int, float)) else dict(tolerance)
    unknown = sorted(set(given) - set(tol) - {"logp"})
    if unknown:
        raise ConfigError(f"unknown LM gate(s) {', '.join(unknown)}; known: logp, {', '.join(tol)}")
    if "logp" in given:
        tol.update(dict.fromkeys(LOGP_GATES, given.pop("logp")))
    tol.update(given)
    return tol


# The LM gate's view of the v2 graph (v1 and v3 give their own: lm_graph_v1.GATE, lm_graph_v3.GATE).
GATE = LMGate(facts("cosyvoice2"), lm_attrs, lambda lm: lm.cfg.qwen.vocab_size)


def _open(lm: Any, out_dir: Path, graph_file: str, gate: LMGate = GATE) -> tuple[Any, Any]:
    """The runtime session on a written graph and its prompt builder ``(text ids, speech ids, speaker) -> (T, D)``."""
    from cosyvoice_cpu.lm.prompt import TextEncoder, assemble
    from cosyvoice_cpu.lm.session import LMSession

    inputs, _ = io_specs(Path(out_dir) / graph_file)
    max_len = next(int(s.shape[2]) for s in inputs if s.name == past_names(0)[0])
    sess = LMSession.from_dir(out_dir, gate.attrs(lm, max_len), graph_file=graph_file, threads=2)
    if gate.text_encoder:
        encoder = TextEncoder(Path(out_dir) / TEXT_ENCODER_FILE, (sess.spec.text_dim, sess.spec.hidden), 2)
        return sess, partial(assemble, sess, encoder=encoder)
    return sess, partial(assemble, sess)


def _prompt(lm: Any, build: Any, rng: np.random.Generator, gate: LMGate = GATE) -> tuple[Any, np.ndarray]:
    """A random 20-40 position prompt: the reference's embeddings (1, T, D) and the runtime's (T, D) (with a
    random speaker row where the family's LM takes the x-vector: v1)."""
    import torch

    speaker_row = gate.facts.lm_speaker
    total = int(rng.integers(20, 41)) - speaker_row
    n_text = int(rng.integers(4, total - 6))
    text = rng.integers(0, gate.text_vocab(lm), n_text)
    speech = rng.integers(0, lm.cfg.speech_token_size, total - 2 - n_text)
    args = [torch.from_numpy(text)[None], torch.zeros(1, 0, dtype=torch.long), torch.from_numpy(speech)[None]]
    speaker = rng.standard_normal(192).astype(np.float32) if speaker_row else None
    ref = lm.prompt_embeddings(*args, *([torch.from_numpy(speaker)[None]] if speaker_row else []))
    return ref.detach(), build(text, speech, speaker=speaker)


def _kl(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(ref || ours) per row of log-probabilities (..., V), nats (both renormalised in float64 first)."""

    def norm(lp: np.ndarray) -> np.ndarray:
        lp = np.asarray(lp, np.float64)
        m = lp.max(-1, keepdims=True)
        return lp - m - np.log(np.sum(np.exp(lp - m), axis=-1, keepdims=True))

    ref, ours = norm(ref), norm(ours)
    return np.sum(np.exp(ref) * (ref - ours), axis=-1)


def verify_lm(
    lm: Any,
    out_dir: Path,
    seed: int = 0,
    graph_file: str = GRAPH_FILE,
    tolerance: float | Mapping[str, float] | None = None,
    gate: LMGate = GATE,
) -> list[GateResult]:
    """Check a written LM graph (fp32 or quantized) through :class:`~cosyvoice_cpu.lm.session.LMSession`
    (``gate``: :data:`GATE`, or the family's own from :mod:`.lm_graph_v1` / :mod:`.lm_graph_v3`).

    Gates (names and fp32 defaults in :data:`FP32_TOLERANCES`): prompt embeddings, prefill logp, 8 decode steps
    fed the reference's greedy tokens, argmax mismatch and mean KL over those 9 distributions, and a 2-row batch of
    different lengths vs the rows run alone. For a quantized graph pass ``tolerance``: a number or
    ``{"logp": x}`` for the logp gates, or gate names; the rest then come from :data:`LOOSE_TOLERANCES`.
    """
    tol = _tolerances(tolerance)
    if gate.text_encoder:  # computed prompt embeddings, not copied rows
        tol["embeddings"] = max(tol["embeddings"], V1_EMBEDDINGS["fp32" if tolerance is None else "quantized"])
    rng = np.random.default_rng(seed)
    sess, build = _open(lm, out_dir, graph_file, gate)
    ref_emb, emb = _prompt(lm, build, rng, gate)
    total = emb.shape[0]
    ref = [lm.prefill(ref_emb, total + DECODE_STEPS + 1).numpy()]
    tokens = []
    for k in range(DECODE_STEPS):  # greedy over the rows that can be fed back (v3/v1: not the stop ids)
        tokens.append(int(ref[-1][: sess.spec.speech_rows].argmax()))
        ref.append(lm.decode_step(tokens[-1], total + k).numpy())
    # the same prompt and tokens alone (row 0 of a 1-row cache), then with a shorter second prompt in a batch
    emb2 = _prompt(lm, build, rng, gate)[1][: max(2, total - 7)]
    tokens2 = [int(t) for t in rng.integers(0, lm.cfg.speech_token_size, DECODE_STEPS)]
    single: list[list[np.ndarray]] = []
    for e, toks in ((emb, tokens), (emb2, tokens2)):
        cache = sess.new_cache(1)
        single.append([sess.prefill(cache, 0, e)] + [sess.decode(cache, [0], [t])[0] for t in toks])
    cache = sess.new_cache(2)
    batch = [np.stack([sess.prefill(cache, 0, emb), sess.prefill(cache, 1, emb2)])]
    batch += [sess.decode(cache, [0, 1], [a, b]) for a, b in zip(tokens, tokens2)]
    ours, ref = np.stack(single[0]), np.stack(ref)
    name = Path(graph_file).stem
    values = {
        "embeddings": (rel_err(emb, ref_emb[0].numpy()), f"{total} positions"),
        "prefill_logp": (rel_err(ours[0], ref[0]), f"prompt of {total} positions"),
        "decode_logp": (max(rel_err(o, r) for o, r in zip(ours[1:], ref[1:])), f"{DECODE_STEPS} steps"),
        "batch_vs_single": (rel_err(np.stack(batch), np.stack(single, 1)), f"rows of {total}, {len(emb2)}"),
        "greedy_mismatch": (float(np.mean(ours.argmax(-1) != ref.argmax(-1))), f"{len(ref)} steps"),
        "decode_kl": (float(np.mean(_kl(ref, ours))), "mean nats"),
    }
    return [GateResult(name, check, v, tol[check], detail) for check, (v, detail) in values.items()]


def compare_lm(
    lm: Any, out_dir: Path, graph_file: str = GRAPH_FILE, steps: int = 200, seed: int = 0, gate: LMGate = GATE
) -> dict:
    """Teacher-force ``steps`` next-token predictions of a graph (``gate``: see :func:`verify_lm`) against the
    reference.

    A random 20-40 position prompt is prefilled, then steps - 1 random speech tokens are decoded one at a time;
    the reference scores the same sequence in one uncached ``forward_full``. Returns a dict with ``steps``,
    ``agreement`` (fraction of equal argmax), ``mean_kl`` / ``max_kl`` (KL(ref || graph), nats) and
    ``max_rel_err`` (of logp).
    """
    import torch

    if steps <= 0:
        raise ConfigError(f"steps must be positive, got {steps}")
    rng = np.random.default_rng(seed)
    sess, build = _open(lm, out_dir, graph_file, gate)
    ref_emb, emb = _prompt(lm, build, rng, gate)
    tokens = [int(t) for t in rng.integers(0, lm.cfg.speech_token_size, steps - 1)]
    cache = sess.new_cache(1)
    ours = [sess.prefill(cache, 0, emb)] + [sess.decode(cache, [0], [t])[0] for t in tokens]
    seq = torch.cat([ref_emb, lm.speech_embedding.weight[torch.tensor(tokens, dtype=torch.long)][None]], dim=1)
    ref = lm.forward_full(seq)[0, emb.shape[0] - 1 :].numpy()
    ours = np.stack(ours)
    kl = _kl(ref, ours)
    return {
        "graph": graph_file,
        "steps": steps,
        "agreement": float(np.mean(ours.argmax(-1) == ref.argmax(-1))),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "max_rel_err": float(max(rel_err(o, r) for o, r in zip(ours, ref))),
    }
