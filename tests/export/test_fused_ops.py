"""The export-time forms (fused attention, one-Exp Mish) equal the reference and reach the graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.onnxruntime import make_session
from cosyvoice_cpu.export.common import torch_export
from cosyvoice_cpu.export.fused_ops import (
    ExpMish,
    FastGelu,
    KeyMaskedAttention,
    attention,
    export_forms,
    unbiased_when_zero,
    unmasked_when_unpadded,
)
from cosyvoice_cpu.reference.flow.causal_unet import MASK_BIAS, SelfAttention, TransformerBlock


def test_exp_mish_equals_mish_everywhere() -> None:
    x = torch.cat([torch.linspace(-120, 120, 20001), torch.tensor([0.0, -1e-30, 1e-30, 19.99, 20.0, 20.01, 1e4])])
    ref, ours = F.mish(x.double()), ExpMish()(x)
    assert torch.isfinite(ours).all()
    assert float((ours.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert float(((ours.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()) < 1e-5  # relative, pointwise


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, add: torch.Tensor | None) -> torch.Tensor:
    b, size, _ = q.shape

    def split(h: torch.Tensor) -> torch.Tensor:
        return h.view(b, h.size(1), heads, -1).transpose(1, 2)

    scores = split(q) @ split(k).transpose(2, 3) * (q.size(-1) // heads) ** -0.5
    scores = scores if add is None else scores + add
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, size, -1)


class _Probe(nn.Module):
    def __init__(self, heads: int, mode: str) -> None:
        super().__init__()
        self.heads, self.mode = heads, mode

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, bias: torch.Tensor):
        scale = 16**-0.5  # a Python float, as the estimators' module attributes give
        key_mask = m if self.mode in ("mask", "both") else None
        add = bias if self.mode in ("bias", "both") else None
        return attention(q, k, v, self.heads, scale, key_mask=key_mask, bias=add)


@pytest.mark.parametrize("mode", ["none", "mask", "bias", "both"])
def test_attention_graph_is_one_fused_node_equal_to_the_math(mode: str, tmp_path: Path) -> None:
    heads, b, size, keys = 4, 2, 9, 13  # keys != queries: a chunk on cached past keys
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, heads * 16, generator=g) for n in (size, keys, keys))
    m = torch.ones(b, keys)
    m[1, 10:] = 0  # row 1: its last 3 keys are padding
    bias = torch.where(torch.rand(1, 1, size, keys, generator=g) < 0.3, MASK_BIAS, 0.0)
    bias[..., 0] = 0.0  # every query sees at least one key
    add = None
    if mode in ("mask", "both"):
        add = ((1 - m) * MASK_BIAS)[:, None, None, :]
    if mode in ("bias", "both"):
        add = bias if add is None else add + bias
    ref = _reference(q, k, v, heads, add)
    probe = _Probe(heads, mode)
    assert torch.allclose(probe(q, k, v, m, bias), ref, atol=1e-5)

    path = tmp_path / "attn.onnx"
    names = ["q", "k", "v", "m", "bias"]
    torch_export(probe, (q, k, v, m, bias), path, input_names=names, output_names=["out"],
                 dynamic_axes={"q": {1: "t"}, "k": {1: "s"}, "v": {1: "s"}, "m": {1: "s"}})  # fmt: skip
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("MultiHeadAttention") == 1 and "Softmax" not in ops and "MatMul" not in ops
    sess = make_session(path, SessionConfig(threads=1))
    wanted = {i.name for i in sess.get_inputs()}
    feeds = {n: t.numpy() for n, t in zip(names, (q, k, v, m, bias)) if n in wanted}
    out = sess.run(None, feeds)[0]
    assert np.abs(out - ref.numpy()).max() < 1e-5


def test_export_forms_swaps_and_restores_even_on_error() -> None:
    block = TransformerBlock(32, 2, 16)
    mish = nn.Sequential(nn.Linear(4, 4), nn.Mish())
    model = nn.ModuleList([block, mish])
    attn, act = block.attn1, mish[1]
    x, bias = torch.randn(2, 7, 32), torch.zeros(2, 1, 7)
    bias[1, 0, 5:] = MASK_BIAS
    with torch.no_grad():
        want = block(x, bias)
        with export_forms(model):
            assert isinstance(block.attn1, KeyMaskedAttention) and block.attn1.inner is attn
            assert isinstance(mish[1], ExpMish)
            got = block(x, bias)
    assert block.attn1 is attn and mish[1] is act
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(RuntimeError, match="boom"), export_forms(model):
        raise RuntimeError("boom")
    assert block.attn1 is attn and mish[1] is act
    assert isinstance(attn, SelfAttention)


def test_key_masked_attention_refuses_a_full_bias() -> None:
    attn = KeyMaskedAttention(SelfAttention(32, 2, 16))
    with pytest.raises(ValueError, match=r"\(B, 1, T\) key-padding bias"):
        attn(torch.randn(1, 5, 32), torch.zeros(1, 5, 5))


def test_masked_attention_takes_the_unmasked_kernel_only_when_nothing_is_padded(tmp_path: Path) -> None:
    heads, b, size = 2, 2, 11
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, size, heads * 16, generator=g) for _ in range(3))
    probe, path = _Probe(heads, "mask"), tmp_path / "attn.onnx"
    torch_export(probe, (q, k, v, torch.ones(b, size), torch.zeros(1, 1, size, size)), path,
                 input_names=["q", "k", "v", "m", "bias"], output_names=["out"])  # fmt: skip
    assert unmasked_when_unpadded(path) == 1
    graph = onnx.load(str(path)).graph
    ifs = [n for n in graph.node if n.op_type == "If"]
    assert len(ifs) == 1 and "MultiHeadAttention" not in [n.op_type for n in graph.node]
    branches = {a.name: [(n.op_type, len(n.input)) for n in a.g.node] for a in ifs[0].attribute}
    assert branches == {"then_branch": [("MultiHeadAttention", 3)], "else_branch": [("MultiHeadAttention", 5)]}
    sess = make_session(path, SessionConfig(threads=1))
    for padded in (0, 4):
        m = torch.ones(b, size)
        m[1, size - padded :] = 0
        ref = _reference(q, k, v, heads, ((1 - m) * MASK_BIAS)[:, None, None, :])
        out = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "m": m.numpy()})[0]
        assert np.abs(out - ref.numpy()).max() < 1e-5, padded


def test_biased_attention_takes_the_flash_kernel_only_when_the_bias_is_zero(tmp_path: Path) -> None:
    """The v3 stream DiT's form: a (1, 1, T, S) chunk-causal bias; an all-zero bias takes the bias-free node."""
    heads, b, size, keys = 2, 2, 9, 13
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, n, heads * 16, generator=g) for n in (size, keys, keys))
    probe, path = _Probe(heads, "bias"), tmp_path / "attn.onnx"
    torch_export(probe, (q, k, v, torch.ones(b, keys), torch.zeros(1, 1, size, keys)), path,
                 input_names=["q", "k", "v", "m", "bias"], output_names=["out"],
                 dynamic_axes={"q": {1: "t"}, "k": {1: "s"}, "v": {1: "s"}, "bias": {2: "t", 3: "s"}})  # fmt: skip
    assert unmasked_when_unpadded(path) == 0 and unbiased_when_zero(path) == 1
    graph = onnx.load(str(path)).graph
    ifs = [n for n in graph.node if n.op_type == "If"]
    assert len(ifs) == 1 and "MultiHeadAttention" not in [n.op_type for n in graph.node]
    branches = {a.name: [(n.op_type, len(n.input)) for n in a.g.node] for a in ifs[0].attribute}
    assert branches == {"then_branch": [("MultiHeadAttention", 3)], "else_branch": [("MultiHeadAttention", 6)]}
    sess = make_session(path, SessionConfig(threads=1))
    causal = torch.where(torch.arange(keys)[None] <= torch.arange(size)[:, None] + 4, 0.0, MASK_BIAS)[None, None]
    for bias in (torch.zeros(1, 1, size, keys), causal):
        ref = _reference(q, k, v, heads, bias)
        out = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "bias": bias.numpy()})[0]
        assert np.abs(out - ref.numpy()).max() < 1e-5


def test_sort_nodes_counts_what_if_branches_read(tmp_path: Path) -> None:
    """ORT's quantizer can put an ``If`` before the producer of a value its branches read; ``sort_nodes`` restores
    an order the ONNX checker accepts, keeping the original order among ready nodes."""
    from onnx import TensorProto, helper

    from cosyvoice_cpu.export.quantize import sort_nodes

    def branch(name: str, op: str) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [3])
        return helper.make_graph([helper.make_node(op, ["y"], [f"{name}_out"])], name, [], [out])

    nodes = [
        helper.make_node(
            "If", ["c"], ["z"], "if", then_branch=branch("then", "Identity"), else_branch=branch("else", "Neg")
        ),
        helper.make_node("Relu", ["x"], ["r"], "relu"),
        helper.make_node("ReduceMin", ["x"], ["m"], "min", keepdims=0),
        helper.make_node("Exp", ["r"], ["y"], "exp"),
        helper.make_node("Greater", ["m", "zero"], ["c"], "cond"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [3])
    graph = helper.make_graph(nodes, "g", [x], [z], [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model)
    sort_nodes(model.graph)
    assert [n.name for n in model.graph.node] == ["relu", "min", "exp", "cond", "if"]
    onnx.checker.check_model(model)
    path = tmp_path / "sorted.onnx"
    onnx.save(model, str(path))
    out = make_session(path, SessionConfig(threads=1)).run(None, {"x": np.array([1.0, 2.0, 3.0], np.float32)})[0]
    assert np.allclose(out, np.exp([1.0, 2.0, 3.0]))


def test_fast_gelu_is_one_node_equal_to_tanh_gelu(tmp_path: Path) -> None:
    x = torch.linspace(-12, 12, 4001).reshape(1, 1, -1)
    want = F.gelu(x, approximate="tanh")
    model = nn.Sequential(nn.GELU(approximate="tanh"))
    path = tmp_path / "gelu.onnx"
    with export_forms(model):
        assert isinstance(model[0], FastGelu)
        assert torch.equal(model(x), want)
        torch_export(model, (x,), path, input_names=["x"], output_names=["y"], dynamic_axes={"x": {2: "t"}})
    assert isinstance(model[0], nn.GELU)
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["FastGelu"]
    out = make_session(path, SessionConfig(threads=1)).run(None, {"x": x.numpy()})[0]
    assert np.abs(out - want.numpy()).max() < 1e-5
    exact = nn.Sequential(nn.GELU())  # the erf GELU (CosyVoice2's FFN) is left alone
    with export_forms(exact):
        assert isinstance(exact[0], nn.GELU)
