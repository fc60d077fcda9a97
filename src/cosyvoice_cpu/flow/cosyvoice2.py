"""The CosyVoice2 flow at run time (NumPy + ONNX Runtime, no torch): speech tokens -> 80-bin mel.

    tokens --flow_encoder.onnx--> mu (1, 80, 2T), spks (1, 80)
    cond = prompt mel then zeros; x_0 = the official fixed noise (``flow_noise.npy``) or caller noise
    Euler over a cosine time schedule, classifier-free guidance as one batch-2 call of the estimator:
    rows [conditioned; mu = spks = cond = 0]. Streaming (``flow_estimator_stream.onnx``, chunk by chunk on cached
    activations) is :mod:`cosyvoice_cpu.flow.cosyvoice2_stream`.

The encoder, noise and solve are the chunk-streamed families' (:class:`~cosyvoice_cpu.flow.common.ChunkedFlow`);
this module adds the stream graph's contract: the UNet's cached ``norm1`` outputs (``prompt_h``, ``context_h``) and
causal-convolution states. Whole sentences run on that graph with empty caches and ``keep_frames`` 0 (the
full-attention estimator), so a process that does both modes holds one copy of its weights.

Numerically this is :meth:`cosyvoice_cpu.reference.flow.cosyvoice2.Flow.inference` (same time bookkeeping, same
noise); graph contracts are documented in :mod:`cosyvoice_cpu.export.flow.cosyvoice2`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import numpy as np

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES, GraphSession, SessionConfig
from cosyvoice_cpu.flow.base import Attrs, Feeds, FlowSettings
from cosyvoice_cpu.flow.common import FILES, ChunkedFlow
from cosyvoice_cpu.flow.graphs import IO, ShapedGraph, cache_dtype

logger = logging.getLogger(__name__)

__all__ = ["FILES", "STREAM_IO", "CosyVoice2Flow", "stream_layout"]

STREAM_IO: IO = (
    {
        "x": ("float", 3),
        "mu": ("float", 3),
        "t": ("float", 1),
        "spks": ("float", 2),
        "cond": ("float", 3),
        "prompt_h": ("float|float16", 4),
        "context_h": ("float|float16", 4),
        "conv_state": ("float", 3),
        "keep_frames": ("int64", 0),
    },
    ("velocity", ("new_h", "float|float16"), "new_conv_state"),
)


def stream_layout(sess: GraphSession) -> tuple[int, int, int]:
    """(L, width, S) of the stream estimator from its input shapes (prompt_h (L, B, T, width), conv (B, S, 2))."""
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    return int(shapes["prompt_h"][0]), int(shapes["prompt_h"][3]), int(shapes["conv_state"][1])


class CosyVoice2Flow(ChunkedFlow):
    """Tokens -> mel with the exported CosyVoice2 flow graphs.

    Args:
        encoder, estimator: ``flow_encoder.onnx`` and ``flow_estimator.onnx`` paths.
        estimator_stream: ``flow_estimator_stream.onnx`` (needed for streaming), or None.
        noise: ``flow_noise.npy`` (the official fixed noise), or None: then every ``solve`` needs ``noise=``.
        settings: :class:`~cosyvoice_cpu.flow.base.FlowSettings` or the artifacts' attrs dict.
        threads, arena_shrink_frames, whole: as :class:`~cosyvoice_cpu.flow.base.FlowStage`.
    """

    stream_io: ClassVar[IO | None] = STREAM_IO

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        estimator_stream: str | Path | None = None,
        noise: str | Path | None = None,
        settings: FlowSettings | Attrs | None = None,
        threads: int | SessionConfig = 1,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> None:
        settings = settings if isinstance(settings, FlowSettings) else FlowSettings.from_attrs(settings)
        super().__init__(encoder, estimator, estimator_stream, noise, settings, threads, arena_shrink_frames, whole)

    def empty_stream_feeds(self, sess: GraphSession, n: int) -> Feeds:
        """Empty ``prompt_h``/``context_h``, zero conv state and ``keep_frames`` 0: the full-attention estimator."""
        layers, width, state = stream_layout(sess)
        empty = np.zeros((layers, n, 0, width), cache_dtype(sess))
        return {
            "prompt_h": empty,
            "context_h": empty,
            "conv_state": np.zeros((n, state, 2), np.float32),
            "keep_frames": np.array(0, np.int64),
        }
