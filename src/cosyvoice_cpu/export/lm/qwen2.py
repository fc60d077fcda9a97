"""The Qwen2 LM graph CosyVoice2 and Fun-CosyVoice3 share, written node by node with ``onnx.helper`` from the
reference weights (no tracing); the layout is described in :mod:`cosyvoice_cpu.export.lm.cosyvoice2`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from cosyvoice_cpu.export.common import OPSET
from cosyvoice_cpu.export.lm.common import IO_DOCS, IR_VERSION
from cosyvoice_cpu.lm.kv_spec import past_names, present_names
from cosyvoice_cpu.lm_files import EMBEDDING_FILES, SPECIALS

logger = logging.getLogger(__name__)


def text_vocab(lm: Any) -> int:
    """The rows of a Qwen2 LM's text table (the LM gate draws its random text ids below it)."""
    return lm.cfg.qwen.vocab_size


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

    from cosyvoice_cpu.reference.lm.qwen2 import rope_cos_sin

    cos, sin = rope_cos_sin(lm.cfg.qwen, torch.arange(max_len))
    half = lm.cfg.qwen.head_dim // 2
    return cos[:, :half].numpy().astype(np.float32), sin[:, :half].numpy().astype(np.float32)


def build_lm_model(weights: dict[str, np.ndarray], cos: np.ndarray, sin: np.ndarray, cfg: Any) -> Any:
    """The ``onnx.ModelProto`` of the LM graph for a ``Qwen2Config`` ``cfg``
    (contract: :mod:`cosyvoice_cpu.lm.bound_graph`)."""
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
