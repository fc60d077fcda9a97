"""A stateful LM's compile properties on OpenVINO: f32 compute and KV cache, int8 activations grouped like the weights.

Only an f32 input takes the CPU plugin's int8-activation path for compressed weights
(``DYNAMIC_QUANTIZATION_GROUP_SIZE``: the activations quantized to int8 in groups and multiplied with the weights
as integers); in bf16 the products widen their weights to bf16, and bf16 compute with OpenVINO's u8 cache kept
fewer argmaxes. So the LM computes in f32 on every CPU. The activation group follows the weights:

- int4 weights: their own group, 128 at full size. NNCF stores grouped int4 weights of a ``MatMul`` with
  ``(out, in)`` weights (what ``ov.convert_model`` makes of a PyTorch ``Linear``, as the export does) as
  ``(out, groups, group)`` constants; an asymmetric form adds ``(out, groups, 1)`` zero points, so the group is the
  largest last axis among the 3-D int4 constants;
- int8 weights (one scale per output channel) and fp32 ones: :data:`CHANNEL_WEIGHTS_GROUP`, OpenVINO's default.

Why each, with the figures: docs/backends.md, "The LM on OpenVINO" (int4: 128 against 32 on the AMX Xeon and the
Zen 4; int8: 128 against 32 on the Zen 4 only).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openvino as ov

logger = logging.getLogger(__name__)

CHANNEL_WEIGHTS_GROUP = 32  # OpenVINO 2026.4's default, set so a later release's default cannot move it unmeasured
INT4_TYPES = ("i4", "u4")


def int4_weight_group(model: ov.Model) -> int | None:
    """The group size of ``model``'s int4 weights: the largest last axis of its 3-D int4 constants (zero points have
    1 there), or None where it has none."""
    group = 0
    for op in model.get_ops():
        if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in INT4_TYPES:
            shape = op.get_output_partial_shape(0)
            if shape.rank.is_static and shape.rank.get_length() == 3 and shape[2].is_static:
                group = max(group, int(shape[2].get_length()))
    return group if group > 1 else None


def stateful_lm_properties(model: ov.Model) -> dict[str, str | int]:
    """The compile properties of a stateful LM (a model with sinks), whatever precision the backend has."""
    group = int4_weight_group(model) or CHANNEL_WEIGHTS_GROUP
    logger.debug("stateful LM: f32, activations in groups of %d", group)
    return {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": group}
