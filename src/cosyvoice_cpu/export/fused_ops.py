"""Export-time forms of estimator pieces that ONNX Runtime runs faster, equal to the reference in fp32.

Profiled on the full-size CosyVoice2 estimator (650 frames, CFG batch 2, 2 threads, ``int8w``), the unfused
attention (``MatMul -> Mul -> Add(mask) -> Softmax -> MatMul`` plus four ``Transpose`` per block) and ``Mish``
(ORT's ``Softplus`` is scalar code) were ~65 % of a 677 ms call; with these forms a call takes 524-557 ms
(docs/benchmarks.md). Measured on this machine:

- **attention** as ``com.microsoft.MultiHeadAttention`` (:func:`attention`): ORT loops over (batch, head) with a
  score tile that stays in cache and applies the key mask inside the loop, instead of streaming the whole
  (B, H, T, T) score tensor through memory four times: 5.7 ms per block with a key mask, 4.9 ms without (its
  flash-attention kernel, which :func:`unmasked_when_unpadded` selects whenever no key is padded), against ~7.1 ms.
- **Mish** as ``x * m / (m + 2)`` with ``m = e (e + 2)``, ``e = exp(min(x, 20))`` (:class:`ExpMish`):
  ``tanh(softplus(x)) = ((1+e)^2 - 1) / ((1+e)^2 + 1)`` rewritten so that only one ``Exp`` is needed; from
  x = 20 on, the ratio is 1 in fp32, so clamping the exponent changes nothing. 0.36 ms vs 1.86 ms on
  (2, 256, 650), max relative difference 1.3e-6.
- **tanh GELU** (the Fun-CosyVoice3 DiT's FFN) as one ``com.microsoft.FastGelu`` (:class:`FastGelu`).

:func:`export_forms` swaps these into a module tree for the duration of an export; eager PyTorch computes the
same numbers, and the numerics gates compare the graphs against the unswapped reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.reference.flow.causal_unet import MASK_BIAS, SelfAttention


class _MultiHeadAttention(torch.autograd.Function):
    """Eager: scaled dot-product attention. ONNX: one ``com.microsoft.MultiHeadAttention`` node."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        heads: int,
        scale: float,
    ) -> torch.Tensor:
        b, size, _ = q.shape

        def split(h: torch.Tensor) -> torch.Tensor:
            return h.reshape(b, h.size(1), heads, -1).transpose(1, 2)

        add = bias
        if key_mask is not None:
            keys = (1.0 - key_mask.to(q.dtype)) * MASK_BIAS
            add = keys[:, None, None, :] if add is None else add + keys[:, None, None, :]
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=add, scale=scale)
        return out.transpose(1, 2).reshape(b, size, -1)

    @staticmethod
    def symbolic(g: Any, q: Any, k: Any, v: Any, key_mask: Any, bias: Any, heads: int, scale: float) -> Any:
        def none() -> Any:
            return g.op("prim::Constant").setType(torch._C.OptionalType.ofTensor())

        inputs = [q, k, v, none()]
        if key_mask is not None or bias is not None:
            mask = none() if key_mask is None else g.op("Cast", key_mask, to_i=6)  # int32, 1 = visible
            inputs.append(mask)
        if bias is not None:
            inputs.append(bias)
        out = g.op(
            "com.microsoft::MultiHeadAttention",
            *inputs,
            num_heads_i=heads,
            scale_f=scale,
            mask_filter_value_f=MASK_BIAS,
        )
        return out.setType(q.type())


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: int,
    scale: float,
    key_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head attention on packed heads, exported as ``com.microsoft.MultiHeadAttention``.

    Args:
        q: (B, T, H*D) queries; k, v: (B, S, H*D) keys and values (S may differ from T).
        heads: H; scale: the score scale (``D ** -0.5`` in every CosyVoice estimator).
        key_mask: (B, S) float 0/1, 1 = visible (a padded key gets the official ``-1e10`` bias), or None.
        bias: (1|B, 1, T, S) additive float bias (e.g. a chunk-causal window), or None.
    Returns:
        (B, T, H*D).
    """
    return _MultiHeadAttention.apply(q, k, v, key_mask, bias, heads, scale)


def self_attention(
    a: nn.Module, x: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """A :class:`SelfAttention`'s weights (or a :class:`KeyMaskedAttention` wrapping them) on queries from ``x``
    (B, T, C) and keys/values from ``keys`` (B, S, C), through :func:`attention` -> (B, T, C)."""
    a = a.inner if isinstance(a, KeyMaskedAttention) else a
    scale = (a.to_q.out_features // a.heads) ** -0.5
    return a.to_out[0](attention(a.to_q(x), a.to_k(keys), a.to_v(keys), a.heads, scale, key_mask=key_mask))


class KeyMaskedAttention(nn.Module):
    """:class:`SelfAttention` with the same weights, its key-padding bias (B, 1, T) run by :func:`attention`."""

    def __init__(self, inner: SelfAttention) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (B, T, C), bias (B, 1, T) additive key bias (0 visible, -1e10 padded) -> (B, T, C)."""
        if bias.dim() != 3 or bias.size(1) != 1:
            raise ValueError(f"KeyMaskedAttention takes a (B, 1, T) key-padding bias, got {tuple(bias.shape)}")
        return self_attention(self.inner, x, x, key_mask=(bias[:, 0] == 0))


class _FastGelu(torch.autograd.Function):
    """Eager: tanh-approximated GELU. ONNX: one ``com.microsoft.FastGelu`` node (the same formula, vectorized)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def symbolic(g: Any, x: Any) -> Any:
        return g.op("com.microsoft::FastGelu", x).setType(x.type())


class FastGelu(nn.Module):
    """``nn.GELU(approximate="tanh")`` (the Fun-CosyVoice3 DiT's FFN) as one ORT node instead of the ~8
    elementwise nodes the tracer writes (6 ``Mul`` + ``Tanh`` + ``Add`` over (B, T, 2048) per block)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FastGelu.apply(x)


class ExpMish(nn.Module):
    """``x * tanh(softplus(x))`` with a single ``Exp`` (formula in the module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(torch.clamp(x, max=20.0))
        m = e * (e + 2.0)
        return x * m / (m + 2.0)


@contextlib.contextmanager
def export_forms(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every ``nn.Mish`` of ``module`` is an :class:`ExpMish`, every tanh ``nn.GELU`` a
    :class:`FastGelu` and every :class:`SelfAttention` a :class:`KeyMaskedAttention` (same parameters, nothing
    copied); the originals are put back on exit."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Mish):
                new: nn.Module = ExpMish()
            elif isinstance(child, nn.GELU) and child.approximate == "tanh":
                new = FastGelu()
            elif isinstance(child, SelfAttention):
                new = KeyMaskedAttention(child)
            else:
                continue
            setattr(parent, name, new)
            swapped.append((parent, name, child))
    try:
        yield module
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def unmasked_when_unpadded(path: Path) -> int:
    """Rewrite every key-masked ``MultiHeadAttention`` of the graph at ``path`` as ``If(no key is padded)``: then
    the same node without the mask, else the node as it was. Returns the number of nodes rewritten.

    ORT runs an unmasked ``MultiHeadAttention`` with its flash-attention kernel and a masked one with the
    classic per-head kernel (score tile + mask + softmax): 4.9 vs 6.5 ms per CosyVoice2 block at 650 frames, CFG
    batch 2. The runtime pads nothing in a whole-sentence call, so it always takes the first branch; a padded
    batch (the official contract allows one) takes the second. The branches hold no weights. The test is written
    once per distinct mask tensor; blocks that each derive the same mask get one each, and ORT's common
    subexpression elimination folds those into a single ``ReduceMin`` over the (B, T) mask per call (checked on
    the demo model's optimized graph). Weights stay in their external file.
    """
    from onnx import TensorProto

    return _fast_branch_when(path, 4, TensorProto.INT32, 1, "unpadded")


def unbiased_when_zero(path: Path) -> int:
    """Rewrite every ``MultiHeadAttention`` with an additive attention bias (and no key mask) of the graph at
    ``path`` as ``If(the bias is all zero)``: then the same node without the bias (ORT's flash-attention kernel),
    else the node as it was. Returns the number of nodes rewritten.

    For Fun-CosyVoice3's stream DiT: a whole sentence (``chunk_frames`` 0) and a window inside one chunk have a zero
    bias and take the flash kernel; a window across a chunk boundary keeps its chunk-causal bias. The bias is
    0 or -1e10, so "all zero" is ``ReduceMin(bias) == 0``, computed once per call for the blocks' shared bias.
    """
    from onnx import TensorProto

    return _fast_branch_when(path, 5, TensorProto.FLOAT, 0.0, "unbiased")


def _fast_branch_when(path: Path, index: int, dtype: int, fast_min: float, label: str) -> int:
    """Wrap each ``MultiHeadAttention`` whose only optional input is input ``index`` (4: key mask, 5: attention
    bias) in ``If(ReduceMin(that input) == fast_min)`` (a ``dtype`` scalar): then the node on q, k, v alone, else
    the node as it was."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    nodes: list[Any] = []
    conds: dict[str, str] = {}
    rewritten = 0
    for node in graph.node:
        optional = [i for i, name in enumerate(node.input) if i >= 3 and name]
        if node.op_type != "MultiHeadAttention" or optional != [index]:
            nodes.append(node)
            continue
        mask = node.input[index]
        if mask not in conds:  # one test per distinct mask or bias (each UNet resolution has its own)
            low, cond, ref = f"{mask}/min", f"{mask}/{label}", f"{mask}/{label}_min"
            nodes += [
                helper.make_node("ReduceMin", [mask], [low], keepdims=0),
                helper.make_node("Equal", [low, ref], [cond]),
            ]
            graph.initializer.append(helper.make_tensor(ref, dtype, [], [fast_min]))
            conds[mask] = cond
        out = node.output[0]
        attrs = list(node.attribute)
        fast = helper.make_node(
            "MultiHeadAttention", list(node.input[:3]), [f"{out}/then"], f"{node.name}/{label}", domain="com.microsoft"
        )
        fast.attribute.extend(a for a in attrs if a.name != "mask_filter_value")
        slow = helper.make_node(
            "MultiHeadAttention", list(node.input), [f"{out}/else"], node.name + "/as_exported", domain="com.microsoft"
        )
        slow.attribute.extend(attrs)
        nodes.append(
            helper.make_node(
                "If",
                [conds[mask]],
                [out],
                f"{node.name}/if_{label}",
                then_branch=helper.make_graph(
                    [fast], label, [], [helper.make_tensor_value_info(f"{out}/then", TensorProto.FLOAT, None)]
                ),
                else_branch=helper.make_graph(
                    [slow], "as_exported", [], [helper.make_tensor_value_info(f"{out}/else", TensorProto.FLOAT, None)]
                ),
            )
        )
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save_model(model, str(path))
    return rewritten
