"""Shape buckets for backends that compile per input shape (OpenVINO), and the session that pads calls to them.

OpenVINO runs a graph fastest on a static shape, and compiling one shape takes seconds (a cached one about one
second). A session opened with :attr:`SessionConfig.padding <cosyvoice_cpu.backends.base.SessionConfig>` on such a
backend is therefore a :class:`BucketedSession`: each call's padded inputs are zero-padded along the padded axis
up to the next bucket, and every output with that axis is cut back. Zeros are what the flow estimator's mask
treats as absent frames; a graph whose output padding would change is opened without ``padding`` (the export
measures it: the IR's ``pad_exact`` attr, ``docs/quantization.md``). Backends that run any shape as fast (ONNX
Runtime) ignore ``padding``.

Buckets grow geometrically (:data:`STEPS_PER_OCTAVE` per doubling, rounded to :data:`ALIGN`): a call is padded by
9 % on average, at most 25 % (21 % above 256), and 100-2000 frames (2-40 s of CosyVoice2 mel) fall in 18 shapes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import numpy as np

from cosyvoice_cpu.backends.base import GraphSession, Padding, WrappedSession

logger = logging.getLogger(__name__)

ALIGN = 16  # positions of the padded axis
MIN_BUCKET = 64
STEPS_PER_OCTAVE = 4


def bucket(size: int) -> int:
    """The smallest bucket holding ``size`` positions (>= ``size``; see the module docstring)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if size <= MIN_BUCKET:
        return MIN_BUCKET
    k = math.ceil(STEPS_PER_OCTAVE * math.log2(size / MIN_BUCKET) - 1e-9)
    while True:  # rounding to ALIGN can land a step below ``size``; take the next step then
        out = ALIGN * round(MIN_BUCKET * 2 ** (k / STEPS_PER_OCTAVE) / ALIGN)
        if out >= size:
            return out
        k += 1


def pad_axis(feeds: Mapping[str, np.ndarray], padding: Padding, size: int) -> dict[str, np.ndarray]:
    """``feeds`` with ``padding.inputs`` zero-padded along ``padding.axis`` to ``size``."""
    out = dict(feeds)
    for name in padding.inputs:
        a = feeds[name]
        extra = size - a.shape[padding.axis]
        if extra:
            widths = [(0, 0)] * a.ndim
            widths[padding.axis] = (0, extra)
            out[name] = np.pad(a, widths)
    return out


class BucketedSession(WrappedSession):
    """A session that pads every call to a :func:`bucket` and cuts the outputs back (see the module docstring).

    ``calls`` and ``padded`` count the calls and the padded positions (of ``padding.inputs[0]``'s axis).
    :meth:`prepare` compiles the buckets of the given shapes ahead of use.
    """

    def __init__(self, session: GraphSession, padding: Padding) -> None:
        super().__init__(session)
        self.padding = padding
        self.calls = self.padded = 0

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        """As the wrapped ``run``; every output whose padded axis came back at the bucket size is cut back."""
        axis = self.padding.axis
        size = int(feeds[self.padding.inputs[0]].shape[axis])
        padded = bucket(size)
        self.calls += 1
        self.padded += padded - size
        if padded == size:
            return self.wrapped.run(output_names, feeds, release_memory)
        outs = self.wrapped.run(output_names, pad_axis(feeds, self.padding, padded), release_memory)
        cut = (slice(None),) * axis + (slice(0, size),)
        return [o[cut] if o.ndim > axis and o.shape[axis] == padded else o for o in outs]

    def prepare(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Compile (or load from the backend's cache) the bucket these shapes fall in."""
        axis, rounded = self.padding.axis, dict(shapes)
        for name in self.padding.inputs:
            shape = list(shapes[name])
            shape[axis] = bucket(shape[axis])
            rounded[name] = tuple(shape)
        self.wrapped.prepare(rounded)
