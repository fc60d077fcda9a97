"""The Qwen2 LM (CosyVoice2 / Fun-CosyVoice3) as an OpenVINO *stateful* model: the KV cache lives in the model's
state (``ReadValue`` / ``Assign`` pairs), as ``optimum-intel`` and ``openvino-genai`` export Qwen2, with int8 or int4
weight compression by NNCF (``nncf.compress_weights``). Export side only (torch, openvino, nncf).

Model contract (B rows, S new positions, P positions already in the state, D hidden, V speech vocab):

- inputs: ``inputs_embeds`` float32 (B, S, D); ``attention_mask`` int64 (B, P + S): 1 where a state slot or new
  position of the row is real, 0 where it is padding; ``position_ids`` int64 (B, S): the RoPE positions of the S new
  positions of each row (its count of real slots before them, so rows of different lengths share one state);
  ``beam_idx`` int32 (B,): which row of the state each row continues (``arange(B)`` to keep them; a subset drops
  rows, a repeat copies one: a ``Gather`` on the batch axis of every state before the call).
- output: ``logp`` float32 (B, V): log-softmax of the speech head at position S-1 of each row.
- state: per layer i, ``past_key_<i>`` / ``past_value_<i>`` (B, Hkv, P, Dh), appended S positions per call
  (every row: a row with nothing to feed gets a padding position, ``attention_mask`` 0). ``reset_state()`` empties
  them; ``query_state()`` reads or writes them (a prefix cache's copy in or out).

The graph is converted from a torch module that reads the reference weights (:class:`StatefulLMGraph`): attention as
``scaled_dot_product_attention`` over ``Concat(past, new)`` with the grouped KV heads broadcast, the form the CPU
plugin's stateful-SDPA fusion turns into one node that keeps the cache inside (so nothing is copied per step). The
projections that read one input are one weight layer each, as in the ONNX graph: query, key and value one, gate and up
one (their weights stacked on the output axis, split after), so a decode step runs 4 products per layer instead of 7.
NNCF compresses per output channel (int8) or in groups along the input axis (int4), so the stacked layer's weights
compress to the same values as the separate ones (measured on the full-size int4 LM: the same logp to the bit with
OpenVINO's activation quantization off, the same sampled tokens with it on; docs/backends.md, "The LM on OpenVINO"). The
embedding tables stay outside, as for the ONNX graph (:mod:`cosyvoice_cpu.export.lm.qwen2`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.openvino import import_openvino
from cosyvoice_cpu.errors import ConfigError, MissingExtraError
from cosyvoice_cpu.lm.kv_spec import past_names, present_names

logger = logging.getLogger(__name__)

OV_LM_FILE = "lm.ov.xml"  # + lm.ov.bin
WEIGHTS = ("none", "int8", "int4")  # none: fp32 weights (the parity form); int8: INT8_ASYM per channel; int4 below
# NNCF INT4_SYM group size (its default; every input width of the full-size LM is a multiple); NNCF keeps the
# speech head in int8 (all_layers False). A smaller LM (the tiny fixture: width 64) gets the largest power of two
# that divides its widths (:func:`int4_group`).
INT4_GROUP = 128
INPUTS = ("inputs_embeds", "attention_mask", "position_ids")


def _module_class() -> Any:
    """:class:`StatefulLMGraph`, defined on first use (torch is imported only then)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class StatefulLMGraph(nn.Module):
        """The reference ``QwenLM``'s backbone and speech head with the KV cache as explicit inputs/outputs.

        forward(inputs_embeds (B, S, D), attention_mask (B, P+S), position_ids (B, S), past_key_0, past_value_0,
        ..., each (B, Hkv, P, Dh)) -> (logp (B, V), present_key_0, present_value_0, ..., each (B, Hkv, P+S, Dh)).
        The layers are the reference's own modules; the attention and the MLP are written out here (RoPE from
        explicit positions, padding-aware causal mask, grouped heads broadcast as transformers' ``repeat_kv`` does),
        with query/key/value and gate/up each one stacked weight layer (:func:`_stacked`).
        """

        def __init__(self, lm: Any) -> None:
            super().__init__()
            q = lm.cfg.qwen
            self.layers, self.norm, self.head = lm.backbone.layers, lm.backbone.norm, lm.llm_decoder
            self.h, self.hkv, self.dh = q.num_attention_heads, q.num_key_value_heads, q.head_dim
            self.inter = q.intermediate_size
            attn = [layer.self_attn for layer in self.layers]
            self.qkv = nn.ModuleList(_stacked([a.q_proj, a.k_proj, a.v_proj]) for a in attn)
            self.gate_up = nn.ModuleList(_stacked([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in self.layers)
            exps = torch.arange(0, self.dh, 2, dtype=torch.int64).float() / self.dh
            self.register_buffer("inv_freq", 1.0 / (q.rope_theta**exps), persistent=False)  # as rope_cos_sin

        def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            half = self.dh // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

        def forward(
            self, embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            b, s, _ = embeds.shape
            total = attention_mask.shape[1]
            freqs = position_ids[..., None].float() * self.inv_freq  # (B, S, Dh/2)
            angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, S, Dh)
            cos, sin = angles.cos(), angles.sin()
            slots = torch.arange(total)
            causal = slots[None, :] <= (torch.arange(s) + (total - s))[:, None]  # (S, P+S)
            mask = causal[None, None] & (attention_mask[:, None, None, :] > 0)  # (B, 1, S, P+S)
            x, presents = embeds, []
            for i, layer in enumerate(self.layers):
                a, hn = layer.self_attn, layer.input_layernorm(x)
                qh, k, v = self.qkv[i](hn).split([self.h * self.dh, self.hkv * self.dh, self.hkv * self.dh], -1)
                qh = qh.view(b, s, self.h, self.dh).transpose(1, 2)
                k = k.view(b, s, self.hkv, self.dh).transpose(1, 2)
                v = v.view(b, s, self.hkv, self.dh).transpose(1, 2)
                qh, k = self._rotate(qh, cos, sin), self._rotate(k, cos, sin)
                k, v = torch.cat([past[2 * i], k], dim=2), torch.cat([past[2 * i + 1], v], dim=2)
                presents += [k, v]
                rep = self.h // self.hkv
                kk = k[:, :, None].expand(b, self.hkv, rep, total, self.dh).reshape(b, self.h, total, self.dh)
                vv = v[:, :, None].expand(b, self.hkv, rep, total, self.dh).reshape(b, self.h, total, self.dh)
                out = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=mask)
                x = x + a.o_proj(out.transpose(1, 2).reshape(b, s, self.h * self.dh))
                gate, up = self.gate_up[i](layer.post_attention_layernorm(x)).split([self.inter, self.inter], -1)
                x = x + layer.mlp.down_proj(F.silu(gate) * up)  # the reference MLP's down(silu(gate(x)) * up(x))
            logp = F.log_softmax(self.head(self.norm(x[:, -1])), dim=-1)
            return (logp, *presents)

    def _stacked(parts: list[nn.Linear]) -> nn.Linear:
        """One ``Linear`` computing ``parts`` (same input) side by side: weights and biases stacked on the output
        axis, in order, so ``split`` by their widths gives each part's output."""
        weight = torch.cat([p.weight.detach() for p in parts])
        biased = any(p.bias is not None for p in parts)  # a part without a bias adds zeros
        out = torch.nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=biased)  # no random init
        with torch.no_grad():
            out.weight.copy_(weight)
            if biased:
                out.bias.copy_(torch.cat([torch.zeros(p.out_features) if p.bias is None else p.bias for p in parts]))
        return out.requires_grad_(False)

    return StatefulLMGraph


def stateful_graph(lm: Any) -> Any:
    """The torch module :func:`convert_stateful` converts (see :class:`StatefulLMGraph` in :func:`_module_class`)."""
    return _module_class()(lm).eval()


def check_extra(weights: str) -> None:
    import importlib.util

    if weights not in WEIGHTS:
        raise ConfigError(f"unknown OpenVINO LM weights {weights!r}; choose from {', '.join(WEIGHTS)}")
    need = ["openvino"] + (["nncf"] if weights != "none" else [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"the OpenVINO stateful LM needs {', '.join(missing)}: pip install 'cosyvoice-cpu[openvino-export]'"
        )


def convert_stateful(lm: Any) -> Any:
    """The reference LM as a stateful ``openvino.Model`` (fp32 weights; contract in the module docstring)."""
    import torch

    ov = import_openvino()
    from openvino import opset13 as ops
    from openvino.passes import MakeStateful, Manager

    q = lm.cfg.qwen
    n, d, hkv, dh = q.num_hidden_layers, q.hidden_size, q.num_key_value_heads, q.head_dim
    b, p, s = 2, 3, 2  # example shapes only: every axis but D, Hkv and Dh is dynamic
    example = (
        torch.zeros(b, s, d),
        torch.ones(b, p + s, dtype=torch.int64),
        torch.arange(p, p + s).repeat(b, 1),
        *[torch.zeros(b, hkv, p, dh) for _ in range(2 * n)],
    )
    shapes = [([-1, -1, d], ov.Type.f32), ([-1, -1], ov.Type.i64), ([-1, -1], ov.Type.i64)]
    shapes += [([-1, hkv, -1, dh], ov.Type.f32)] * (2 * n)
    with torch.no_grad():
        model = ov.convert_model(stateful_graph(lm), example_input=example, input=shapes)
    kv_in = [name for i in range(n) for name in past_names(i)]
    kv_out = [name for i in range(n) for name in present_names(i)]
    for port, name in zip(model.inputs, [*INPUTS, *kv_in]):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, ["logp", *kv_out]):
        port.get_tensor().set_names({name})

    # beam_idx: a Gather on the batch axis of every past tensor, so the caller picks rows without touching state
    beam_idx = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    model.add_parameters([beam_idx])
    for name in kv_in:
        port = model.input(name)
        consumers = port.get_target_inputs()
        gathered = ops.gather(port, beam_idx, ops.constant(np.int64(0)))
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    model.validate_nodes_and_infer_types()

    manager = Manager()
    manager.register_pass(MakeStateful(dict(zip(kv_in, kv_out))))
    manager.run_passes(model)
    # an empty state of the call's batch: ReadValue initialised by zeros of shape (B, Hkv, 0, Dh)
    batch = ops.gather(ops.shape_of(model.input("inputs_embeds"), "i64"), ops.constant([0]), ops.constant(0))
    zero_len = ops.constant(np.array([hkv, 0, dh], np.int64))
    init = ops.broadcast(ops.constant(np.float32(0)), ops.concat([batch, zero_len], 0))
    reads = [op for op in model.get_ops() if op.get_type_name() == "ReadValue"]
    if len(reads) != 2 * n:
        raise RuntimeError(f"MakeStateful made {len(reads)} states, expected {2 * n}")
    for op in reads:
        op.set_arguments([init])
    model.validate_nodes_and_infer_types()
    return model


def int4_group(lm: Any) -> int:
    """The int4 group size for ``lm``: :data:`INT4_GROUP`, or the largest power of two below it that divides every
    matrix's input width (hidden, heads x head_dim, intermediate)."""
    q = lm.cfg.qwen
    widths = (q.hidden_size, q.num_attention_heads * q.head_dim, q.intermediate_size)
    group = INT4_GROUP
    while group > 8 and any(w % group for w in widths):
        group //= 2
    return group


def compress(model: Any, weights: str, group: int = INT4_GROUP) -> Any:
    """``model`` with NNCF weight compression ``weights`` (``int8``: INT8_ASYM per output channel; ``int4``:
    INT4_SYM in groups of ``group`` (:func:`int4_group`), the head kept int8 by NNCF); ``none`` returns it as it
    is."""
    check_extra(weights)
    if weights == "none":
        return model
    import nncf

    if weights == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=group, ratio=1.0)


def export_stateful_lm(lm: Any, out_dir: str | Path, weights: str = "int8", file: str = OV_LM_FILE) -> Path:
    """Write the stateful OpenVINO LM (``file`` + its ``.bin``) into ``out_dir``; return the ``.xml`` path.

    Args:
        lm: the reference ``Qwen2LM`` / ``CosyVoice3LM`` (fp32, eval).
        out_dir: the model directory (the embedding tables of the ONNX export are shared, not written again).
        weights: ``none`` (fp32), ``int8`` or ``int4`` (:func:`compress`).
    """
    check_extra(weights)
    ov = import_openvino()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = compress(convert_stateful(lm), weights, int4_group(lm))
    model.set_rt_info(weights, ["cosyvoice_cpu", "weights"])
    path = out / file
    ov.save_model(model, path, compress_to_fp16=False)
    logger.info("wrote %s (stateful, %s weights)", path, weights)
    return path
