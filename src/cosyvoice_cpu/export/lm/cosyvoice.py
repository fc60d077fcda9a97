"""Export the CosyVoice-300M (v1) LM: a text-encoder graph and a decoder graph with the v2 KV-cache contract.

``lm_text_encoder.onnx`` (batch 1, traced from the reference)
    text_embeds (1, T, Dt) float32: rows of ``lm_text_embedding.npy`` for prompt transcript ⊕ text
    embedding (1, 192) float32: raw x-vector (L2-normalised in the graph)
    -> text (1, T, D): causal Conformer, ``after_norm``, ``text_encoder_affine_layer``;
       speaker (1, D): ``spk_embed_affine_layer(normalize(embedding))``
``lm.onnx`` (written node by node, the contract of :mod:`cosyvoice_cpu.lm.bound_graph`: ``inputs_embeds``, per-layer
``past_/present_key|value_<i>`` of the full capacity bound to one buffer, ``seqlens_k``,
``total_sequence_length`` -> ``logp`` (B, 4097))
    ``embed`` (Linear, LayerNorm, ReLU, x sqrt(D)), then per layer: LayerNorm, one fused q|k|v ``MatMul``,
    ORT's ``GroupQueryAttention`` (H = Hkv, no rotary) fed ``q + pos_bias_u`` as the query and the
    Transformer-XL position term as ``attention_bias``, ``linear_out``, LayerNorm, ReLU FFN; ``after_norm`` at
    position S-1, ``llm_decoder`` and ``LogSoftmax``.

The position term: score(i, j) adds ``(q_i + pos_bias_v) · P[i - j] / sqrt(Dh)`` where ``P[r] = linear_pos(pe(r))``
depends only on the relative position r >= 0 (the LM is causal), so ``P`` is a per-layer table (max_len, H, Dh)
in the graph. Its rows ``0 .. total-1`` are sliced (only those pages are read), one ``MatMul`` scores every query
against them and a ``GatherElements`` with the indices ``i - j`` (clamped at 0; those keys are masked by the causal
attention anyway) picks the term of each key. Query positions come from ``seqlens_k``: row b's S new positions
are ``seqlens_k[b] + 1 - S ... seqlens_k[b]``.

Embedding tables stay outside as ``.npy``: text (51866, Dt), speech (4096, D), special (2, D: sos, task_id).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import OPSET, GraphArtifact, LMGate, save_onnx, torch_export
from cosyvoice_cpu.export.lm import common
from cosyvoice_cpu.export.lm.common import IO_DOCS, IR_VERSION
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.lm.kv_spec import past_names, present_names
from cosyvoice_cpu.lm_files import EMBEDDING_FILES, GRAPH_FILE, SPECIALS, TEXT_ENCODER_FILE

logger = logging.getLogger(__name__)


def _np(p: Any) -> np.ndarray:
    import torch

    return np.ascontiguousarray(p.detach().to(torch.float32).cpu().numpy())


def position_tables(lm: Any, max_len: int) -> list[np.ndarray]:
    """Per layer ``linear_pos(pe(r))`` for r = 0 .. max_len-1 as (max_len, H, Dh): row r is one contiguous block,
    so a call reads (and keeps resident) only the rows 0 .. total-1 it uses, not the whole memory-mapped table."""
    import torch

    from cosyvoice_cpu.reference.espnet import sinusoid_rows

    d, heads = lm.cfg.llm.output_size, lm.cfg.llm.attention_heads
    rows = sinusoid_rows(torch.arange(max_len), d)
    out = []
    with torch.inference_mode():
        for layer in lm.llm.encoders:
            p = layer.self_attn.linear_pos(rows)  # (max_len, D)
            out.append(_np(p.view(max_len, heads, d // heads)))
    return out


def decoder_weights(lm: Any) -> dict[str, np.ndarray]:
    """The reference decoder's weights in graph layout: MatMul weights (K, N), pos biases flattened to (D,)."""
    st = lm.llm
    w = {
        "embed.weight": _np(st.embed.out[0].weight).T,
        "embed.bias": _np(st.embed.out[0].bias),
        "embed.ln.weight": _np(st.embed.out[1].weight),
        "embed.ln.bias": _np(st.embed.out[1].bias),
        "after_norm.weight": _np(st.after_norm.weight),
        "after_norm.bias": _np(st.after_norm.bias),
        "head.weight": _np(lm.llm_decoder.weight).T,
        "head.bias": _np(lm.llm_decoder.bias),
    }
    for i, layer in enumerate(st.encoders):
        a, f, p = layer.self_attn, layer.feed_forward, f"layers.{i}"
        w[f"{p}.qkv.weight"] = np.concatenate(
            [_np(a.linear_q.weight), _np(a.linear_k.weight), _np(a.linear_v.weight)]
        ).T
        w[f"{p}.qkv.bias"] = np.concatenate([_np(a.linear_q.bias), _np(a.linear_k.bias), _np(a.linear_v.bias)])
        w[f"{p}.pos_bias_u"] = _np(a.pos_bias_u).reshape(-1)
        w[f"{p}.pos_bias_v"] = _np(a.pos_bias_v).reshape(-1)
        w[f"{p}.o.weight"], w[f"{p}.o.bias"] = _np(a.linear_out.weight).T, _np(a.linear_out.bias)
        w[f"{p}.w1.weight"], w[f"{p}.w1.bias"] = _np(f.w_1.weight).T, _np(f.w_1.bias)
        w[f"{p}.w2.weight"], w[f"{p}.w2.bias"] = _np(f.w_2.weight).T, _np(f.w_2.bias)
        for norm in ("norm1", "norm2"):
            w[f"{p}.{norm}.weight"] = _np(getattr(layer, norm).weight)
            w[f"{p}.{norm}.bias"] = _np(getattr(layer, norm).bias)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def build_decoder_model(weights: dict[str, np.ndarray], pos: list[np.ndarray], heads: int) -> Any:
    """The ``onnx.ModelProto`` of ``lm.onnx`` for v1 (contract in :mod:`cosyvoice_cpu.lm.bound_graph`)."""
    from onnx import TensorProto, helper, numpy_helper

    n_layers, (d, vocab) = len(pos), weights["head.weight"].shape
    dh, max_len = d // heads, pos[0].shape[0]
    nodes: list[Any] = []
    consts = {
        "c.scale": np.array(math.sqrt(d), np.float32),
        "c.inv_sqrt_dh": np.array(1 / math.sqrt(dh), np.float32),
        "c.zero": np.array(0, np.int64),
        "c.one": np.array(1, np.int64),
        "c.zero_1d": np.array([0], np.int64),
        "c.axis1": np.array([1], np.int64),
        "c.axis2": np.array([2], np.int64),
        "c.last_index": np.array(-1, np.int64),
        "c.heads_shape": np.array([1, heads, 1, 1], np.int64),
        "c.split_sizes": np.array([d, d, d], np.int64),
        "c.heads_view": np.array([0, 0, heads, dh], np.int64),
    }
    inits = [numpy_helper.from_array(v, k) for k, v in {**weights, **consts}.items()]
    inits += [numpy_helper.from_array(p, f"layers.{i}.pos_table") for i, p in enumerate(pos)]

    def node(
        op: str, ins: list[str], outs: list[str] | str, name: str | None = None, domain: str = "", **attrs: Any
    ) -> str:
        outs = [outs] if isinstance(outs, str) else outs
        nodes.append(helper.make_node(op, ins, outs, name=name or outs[0], domain=domain, **attrs))
        return outs[0]

    def linear(x: str, p: str, name: str) -> str:
        node("MatMul", [x, f"{p}.weight"], f"{name}.mm", name)
        return node("Add", [f"{name}.mm", f"{p}.bias"], f"{name}.out")

    def layer_norm(x: str, p: str, eps: float) -> str:
        return node("LayerNormalization", [x, f"{p}.weight", f"{p}.bias"], f"{p}.out", p, axis=-1, epsilon=eps)

    # relative-position gather indices, shared by all layers: idx[b, 0, s, j] = max(pos[b, s] - j, 0)
    node("Shape", ["inputs_embeds"], "shape")
    node("Gather", ["shape", "c.one"], "seq", axis=0)
    node("Cast", ["total_sequence_length"], "total", to=TensorProto.INT64)
    node("Range", ["c.zero", "seq", "c.one"], "q_offsets")  # (S,)
    node("Range", ["c.zero", "total", "c.one"], "key_pos")  # (T,)
    node("Cast", ["seqlens_k"], "ends", to=TensorProto.INT64)
    node("Sub", ["ends", "seq"], "starts_m1")  # seqlens_k - S = first new position - 1
    node("Add", ["starts_m1", "c.one"], "starts")
    node("Unsqueeze", ["starts", "c.axis1"], "starts_col")  # (B, 1)
    node("Add", ["starts_col", "q_offsets"], "q_pos")  # (B, S)
    node("Unsqueeze", ["q_pos", "c.axis2"], "q_pos3")  # (B, S, 1)
    node("Sub", ["q_pos3", "key_pos"], "rel")  # (B, S, T)
    node("Max", ["rel", "c.zero"], "rel_clamped")
    node("Unsqueeze", ["rel_clamped", "c.axis1"], "rel4")  # (B, 1, S, T)
    node("Shape", ["rel4"], "rel_shape")
    node("Mul", ["rel_shape", "c.heads_shape"], "bias_shape_h")  # (B, H, S, T) as B*1, 1*H, S*1, T*1
    node("Expand", ["rel4", "bias_shape_h"], "rel_index")
    node("Unsqueeze", ["total", "c.zero_1d"], "total_1d")

    h = linear("inputs_embeds", "embed", "embed")
    h = layer_norm(h, "embed.ln", 1e-5)
    node("Relu", [h], "embed.relu")
    x = node("Mul", ["embed.relu", "c.scale"], "embed.scaled")
    for i in range(n_layers):
        p = f"layers.{i}"
        normed = layer_norm(x, f"{p}.norm1", 1e-12)
        qkv = linear(normed, f"{p}.qkv", f"{p}.qkv")
        node("Split", [qkv, "c.split_sizes"], [f"{p}.q", f"{p}.k", f"{p}.v"], f"{p}.split", axis=-1)
        q_u = node("Add", [f"{p}.q", f"{p}.pos_bias_u"], f"{p}.q_u")
        node("Add", [f"{p}.q", f"{p}.pos_bias_v"], f"{p}.q_v")
        node("Reshape", [f"{p}.q_v", "c.heads_view"], f"{p}.q_v.heads")  # (B, S, H, Dh)
        node("Transpose", [f"{p}.q_v.heads"], f"{p}.q_v.bhsd", perm=[0, 2, 1, 3])
        node("Slice", [f"{p}.pos_table", "c.zero_1d", "total_1d", "c.zero_1d"], f"{p}.pos_rows")  # (T, H, Dh)
        node("Transpose", [f"{p}.pos_rows"], f"{p}.pos_rows.hdt", perm=[1, 2, 0])  # (H, Dh, T)
        node("MatMul", [f"{p}.q_v.bhsd", f"{p}.pos_rows.hdt"], f"{p}.by_rel")  # (B, H, S, T): column r = rel pos r
        node("GatherElements", [f"{p}.by_rel", "rel_index"], f"{p}.position", axis=3)
        bias = node("Mul", [f"{p}.position", "c.inv_sqrt_dh"], f"{p}.attn_bias")
        pk, pv = past_names(i)
        ok, ov = present_names(i)
        node(
            "GroupQueryAttention",
            [q_u, f"{p}.k", f"{p}.v", pk, pv, "seqlens_k", "total_sequence_length", "", "", "", bias],
            [f"{p}.attn.out", ok, ov],
            f"{p}.attn",
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=heads,
        )
        attn = linear(f"{p}.attn.out", f"{p}.o", f"{p}.o")
        x = node("Add", [x, attn], f"{p}.resid_attn")
        ff = linear(layer_norm(x, f"{p}.norm2", 1e-12), f"{p}.w1", f"{p}.w1")
        ff = linear(node("Relu", [ff], f"{p}.relu"), f"{p}.w2", f"{p}.w2")
        x = node("Add", [x, ff], f"{p}.resid_ff")
    node("Gather", [x, "c.last_index"], "hidden_last", axis=1)
    logits = linear(layer_norm("hidden_last", "after_norm", 1e-5), "head", "head")
    node("LogSoftmax", [logits], "logp", "log_softmax", axis=-1)

    kv = ["batch", heads, max_len, dh]
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("inputs_embeds", f32, ["batch", "seq", d], IO_DOCS["inputs_embeds"])]
    outputs = [helper.make_tensor_value_info("logp", f32, ["batch", vocab], IO_DOCS["logp"])]
    for i in range(n_layers):
        inputs += [helper.make_tensor_value_info(n, f32, kv, IO_DOCS["past"]) for n in past_names(i)]
        outputs += [helper.make_tensor_value_info(n, f32, kv, IO_DOCS["present"]) for n in present_names(i)]
    inputs.append(helper.make_tensor_value_info("seqlens_k", i32, ["batch"], IO_DOCS["seqlens_k"]))
    inputs.append(helper.make_tensor_value_info("total_sequence_length", i32, [], IO_DOCS["total_sequence_length"]))
    graph = helper.make_graph(nodes, "cosyvoice_v1_lm", inputs, outputs, initializer=inits)

    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="cosyvoice-cpu",
    )
    model.ir_version = IR_VERSION
    # onnx shape inference types the index arithmetic but stops at the ORT-only GroupQueryAttention; every tensor
    # it leaves untyped is float (the quantizers need every MatMul input typed)
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
    known = {v.name for v in (*inputs, *outputs, *inferred)}
    model.graph.value_info.extend(inferred)
    model.graph.value_info.extend(
        helper.make_tensor_value_info(o, f32, None) for n in nodes for o in n.output if o and o not in known
    )
    return model


class _TextEncoderGraph:
    """Factory of the traced ``lm_text_encoder.onnx`` module (built lazily: torch is an export-time import)."""

    @staticmethod
    def module(lm: Any) -> Any:
        import torch
        import torch.nn.functional as F

        from cosyvoice_cpu.export.flow.common import chunk_visibility, rel_position_encoding

        class TextEncoderGraph(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lm = lm

            def forward(self, text_embeds: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, ...]:
                enc = self.lm.text_encoder
                size = text_embeds.size(1)
                xs = enc.embed(text_embeds)
                mask = chunk_visibility(size, torch.tensor(1)).unsqueeze(0)  # causal (decoding chunk 1)
                pos_emb = rel_position_encoding(size, enc.output_size)
                for layer in enc.encoders:
                    xs = layer(xs, mask, pos_emb)
                text = self.lm.text_encoder_affine_layer(enc.after_norm(xs))
                speaker = self.lm.spk_embed_affine_layer(F.normalize(embedding, dim=1))
                return text, speaker

        return TextEncoderGraph().eval()


def lm_attrs_v1(lm: Any, max_len: int) -> dict[str, Any]:
    """The ``attrs`` of the v1 ``lm`` artifact (:class:`cosyvoice_cpu.lm.kv_cache.LMSpec` fields plus facts)."""
    c = lm.cfg
    return {
        "max_len": max_len,
        "num_layers": c.llm.num_blocks,
        "num_heads": c.llm.attention_heads,
        "kv_heads": c.llm.attention_heads,
        "head_dim": c.llm.output_size // c.llm.attention_heads,
        "hidden": c.llm_input_size,
        "speech_vocab": c.speech_token_size + 1,
        "speech_rows": c.speech_token_size,
        "text_vocab": c.text_token_size,
        "text_dim": c.text_encoder_input_size,
        "speech_token_size": c.speech_token_size,
        "eos_id": c.eos_id,
        "stop_ids": list(c.stop_ids),
        "embeddings": dict(EMBEDDING_FILES),
        "specials": dict(SPECIALS),
        "text_encoder": TEXT_ENCODER_FILE,
    }


# The LM gate's view of the v1 graph: x-vector row, the transformer's own text table, the text-encoder graph.
GATE = LMGate(facts("cosyvoice"), lm_attrs_v1, lambda lm: lm.cfg.text_token_size, text_encoder=True)


def export_lm(lm: Any, out_dir: Path, max_len: int = 2048) -> list[GraphArtifact]:
    """Write ``lm.onnx``, ``lm_text_encoder.onnx`` (+ ``.data``) and the embedding tables into ``out_dir``."""
    import torch

    if max_len <= 0:
        raise ConfigError(f"max_len must be positive, got {max_len}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {
        "text": lm.text_embedding.weight,
        "speech": lm.speech_embedding.weight,
        "special": lm.llm_embedding.weight,
    }
    for key, weight in tables.items():
        np.save(out_dir / EMBEDDING_FILES[key], _np(weight))
    model = build_decoder_model(decoder_weights(lm), position_tables(lm, max_len), lm.cfg.llm.attention_heads)
    save_onnx(model, out_dir / GRAPH_FILE)
    del model
    c = lm.cfg
    args = (torch.zeros(1, 7, c.text_encoder_input_size), torch.randn(1, c.spk_embed_dim))
    torch_export(
        _TextEncoderGraph.module(lm),
        args,
        out_dir / TEXT_ENCODER_FILE,
        input_names=["text_embeds", "embedding"],
        output_names=["text", "speaker"],
        dynamic_axes={"text_embeds": {1: "seq"}, "text": {1: "seq"}},
    )
    logger.info("wrote the v1 LM (%d layers, max_len %d) and its text encoder", c.llm.num_blocks, max_len)
    attrs = lm_attrs_v1(lm, max_len)
    return [
        GraphArtifact.of(out_dir, "lm", GRAPH_FILE, attrs),
        GraphArtifact.of(out_dir, "lm_text_encoder", TEXT_ENCODER_FILE, {}),
    ]


def verify_lm(lm: Any, out_dir: Path, seed: int = 0, tolerance: Any = None) -> list[Any]:
    """:func:`cosyvoice_cpu.export.lm.common.verify_lm` with this family's :data:`GATE`."""
    return common.verify_lm(lm, out_dir, GATE, seed=seed, tolerance=tolerance)
