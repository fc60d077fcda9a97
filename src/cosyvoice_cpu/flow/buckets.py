"""Frame-count buckets for backends that compile per input shape (OpenVINO), and a session that pads to them.

OpenVINO runs the flow estimator fastest on a static shape, and compiling one shape takes seconds (a cached one
about one second). A whole-sentence call is therefore padded up to the next bucket: ``x``, ``mu`` and ``cond``
with zeros and ``mask`` with zeros, which the estimator's attention and convolutions treat as absent frames, and
the output is cut back. For the CosyVoice2 UNet and the Fun-CosyVoice3 DiT a padded call equals the unpadded one
up to float rounding (the export measures it: the IR's ``pad_exact`` attr, ``docs/quantization.md``). The
official CosyVoice-300M UNet's GroupNorm pools over the padded frames too; its OpenVINO form takes the statistics
over the real frames only (the same function unpadded), so it pads like the others. A graph without
``pad_exact`` runs unpadded.

Buckets grow geometrically (:data:`STEPS_PER_OCTAVE` per doubling, rounded to :data:`ALIGN` frames): a call is
padded by 9 % on average, at most 25 % (21 % above 256 frames), and 100-2000 frames (2-40 s of CosyVoice2 mel)
fall in 18 shapes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import GraphSession, NodeInfo

logger = logging.getLogger(__name__)

ALIGN = 16  # frames
MIN_BUCKET = 64  # frames
STEPS_PER_OCTAVE = 4
TIME_INPUTS = ("x", "mu", "cond", "mask")  # the estimator inputs with a time axis (axis 2), padded with zeros


@dataclass(frozen=True)
class ShapedGraph:
    """A whole-sentence estimator to open on another backend: ``path`` (e.g. the OpenVINO model), ``backend`` (its
    name in :data:`~cosyvoice_cpu.backends.registry.BACKENDS`), and ``pad``: whether calls are padded to
    :func:`bucket` sizes (the graph's ``pad_exact`` attr: padding leaves its output alone)."""

    path: Path
    backend: str = "openvino"
    pad: bool = True


def bucket(frames: int) -> int:
    """The smallest bucket holding ``frames`` frames (>= ``frames``; see the module docstring)."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if frames <= MIN_BUCKET:
        return MIN_BUCKET
    k = math.ceil(STEPS_PER_OCTAVE * math.log2(frames / MIN_BUCKET) - 1e-9)
    while True:  # rounding to ALIGN can land a step below ``frames``; take the next step then
        size = ALIGN * round(MIN_BUCKET * 2 ** (k / STEPS_PER_OCTAVE) / ALIGN)
        if size >= frames:
            return size
        k += 1


def pad_time(feeds: Mapping[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """The estimator feeds with their time axis (``x``, ``mu``, ``cond``, ``mask``) zero-padded to ``size``."""
    out = dict(feeds)
    for name in TIME_INPUTS:
        a = feeds[name]
        extra = size - a.shape[2]
        if extra:
            out[name] = np.concatenate([a, np.zeros((*a.shape[:2], extra), a.dtype)], axis=2)
    return out


class BucketedSession(GraphSession):
    """A whole-sentence estimator session that pads every call's frames to a :func:`bucket` and cuts the output.

    Wraps any :class:`~cosyvoice_cpu.backends.base.GraphSession` with the estimator contract (x, mask, mu, t,
    spks, cond -> estimator_out (B, 80, T)); with ``pad`` False it passes calls through unchanged (a graph whose
    output padding would change). ``warm(frames)`` compiles the buckets of those frame counts ahead of use where
    the backend compiles per shape.
    """

    def __init__(self, session: GraphSession, pad: bool = True) -> None:
        self.session, self.pad = session, pad
        self.calls = self.padded_frames = 0

    def get_inputs(self) -> list[NodeInfo]:
        return self.session.get_inputs()

    def get_outputs(self) -> list[NodeInfo]:
        return self.session.get_outputs()

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        """As the wrapped ``run``; every time-axis output is cut back to the caller's frames."""
        frames = int(feeds["x"].shape[2])
        size = bucket(frames) if self.pad else frames
        self.calls += 1
        self.padded_frames += size - frames
        outs = self.session.run(output_names, pad_time(feeds, size) if size != frames else feeds, release_memory)
        return [o[:, :, :frames] if o.ndim == 3 and o.shape[2] == size else o for o in outs]

    def warm(self, frames: list[int], rows: int = 2) -> None:
        """Compile (or load from the backend's cache) the buckets of these frame counts for ``rows``-row calls,
        where the session compiles per shape (a no-op otherwise)."""
        for size in sorted({bucket(f) if self.pad else f for f in frames}):
            self.session.prepare(
                {
                    "x": (rows, 80, size),
                    "mask": (rows, 1, size),
                    "mu": (rows, 80, size),
                    "t": (rows,),
                    "spks": (rows, 80),
                    "cond": (rows, 80, size),
                }
            )
