"""The Fun-CosyVoice3 (v3) flow at run time (NumPy + ONNX Runtime, no torch): speech tokens -> 80-bin mel.

    tokens --flow_encoder.onnx (the v2 contract: token, context, embedding, chunk_size)--> mu (1, 80, 2T), spks
        (inside: Embedding(6561, 80) -> PreLookaheadLayer 80 -> 1024 -> 80 -> repeat x2; chunk_size is unused)
    cond = prompt mel then zeros; x_0 = the official fixed noise (``flow_noise.npy``, the same table as v2)
    Euler/CFG over ``flow_estimator.onnx`` (the DiT, official contract) = :meth:`FlowStage.solve`

Whole sentences therefore run on :class:`~cosyvoice_cpu.flow.FlowStage`'s solver; :class:`FlowStageV3` swaps the
stream estimator's contract (``flow_estimator_stream.onnx`` of v3: a window of frames on a key/value cache,
:mod:`cosyvoice_cpu.export.flow_stream_graph_v3`), runs whole sentences on that graph too (empty caches: the
full-attention DiT, so a process that does both modes holds one copy of the DiT's weights, 344 MB at int8 full
size; ``flow_estimator.onnx`` is opened only for padded rows or without the stream graph) and adds the DiT's
attention chunk (``chunk_frames``, 50). Streaming is :class:`~cosyvoice_cpu.flow_stream_v3.FlowStreamV3`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow import FILES, FlowSettings, FlowStage, cache_dtype
from cosyvoice_cpu.sessions import SessionConfig

logger = logging.getLogger(__name__)

# manifest keys -> file names: the v2 names (the stream estimator has the v3 contract below)
FILES_V3 = dict(FILES)
STREAM_IO_V3 = (
    {"x": ("float", 3), "mu": ("float", 3), "t": ("float", 1), "spks": ("float", 2), "cond": ("float", 3),
     "prompt_k": ("float|float16", 4), "prompt_v": ("float|float16", 4), "context_k": ("float|float16", 4),
     "context_v": ("float|float16", 4), "conv_state": ("float", 3), "offset": ("int64", 0),
     "keep_frames": ("int64", 0), "chunk_frames": ("int64", 0)},
    ("velocity", ("new_k", "float|float16"), ("new_v", "float|float16"), "conv_in"),
)  # fmt: skip


def stream_layout_v3(sess: Any) -> tuple[int, int, int, int]:
    """(L, I, 2D, K-1) of a v3 stream estimator from its input shapes (prompt_k (L, B, P, I), conv_state
    (B, 2D, K-1))."""
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    return (int(shapes["prompt_k"][0]), int(shapes["prompt_k"][3]), int(shapes["conv_state"][1]),
            int(shapes["conv_state"][2]))  # fmt: skip


@dataclass
class FlowSettingsV3(FlowSettings):
    """:class:`FlowSettings` plus the DiT's streaming attention chunk (frames).

    ``static_chunk_size`` (tokens) is kept for the encoder contract but has no effect in v3 (no conformer).
    """

    chunk_frames: int = 50  # DiT static_chunk_size: key j visible from query i iff j < (i // 50 + 1) * 50

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any] | None) -> FlowSettingsV3:
        settings = super().from_attrs(attrs)
        if settings.chunk_frames <= 0 or settings.chunk_frames % settings.token_mel_ratio:
            raise ConfigError(f"flow chunk_frames must be a positive multiple of token_mel_ratio "
                              f"{settings.token_mel_ratio}, got {settings.chunk_frames}; export the model "
                              "again")  # fmt: skip
        return settings  # type: ignore[return-value]


class FlowStageV3(FlowStage):
    """:class:`FlowStage` for v3 directories: same encoder/estimator/noise, the v3 stream estimator.

    Args: as :class:`FlowStage`; ``settings`` may carry ``chunk_frames`` (the stream graph's attrs).
    """

    stream_io = STREAM_IO_V3
    stream_serves_whole = True  # empty caches, chunk_frames 0: the full-attention DiT (format 4)

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        estimator_stream: str | Path | None = None,
        noise: str | Path | None = None,
        settings: FlowSettingsV3 | dict[str, Any] | None = None,
        threads: int | SessionConfig = 1,
    ) -> None:
        if not isinstance(settings, FlowSettingsV3):
            settings = FlowSettingsV3.from_attrs(settings if isinstance(settings, dict) else
                                                 (vars(settings) if settings is not None else None))  # fmt: skip
        super().__init__(encoder, estimator, estimator_stream, noise, settings, threads)

    @classmethod
    def from_dir(cls, model_dir: str | Path, settings: FlowSettingsV3 | dict[str, Any] | None = None,
                 threads: int | SessionConfig = 1, streaming: bool = True) -> FlowStageV3:  # fmt: skip
        """The stage from the standard file names in an exported v3 directory."""
        d = Path(model_dir)
        stream = d / FILES_V3["flow_estimator_stream"] if streaming else None
        return cls(d / FILES_V3["flow_encoder"], d / FILES_V3["flow_estimator"], stream,
                   d / FILES_V3["flow_noise"], settings, threads)  # fmt: skip

    def _whole_call(self, padded: bool, n: int) -> tuple[Any, dict[str, np.ndarray]]:
        """As :meth:`FlowStage._whole_call`, with the v3 stream graph's feeds: empty key/value caches, zero conv
        state, ``offset`` 0, ``chunk_frames`` 0 (full attention: ORT's flash kernel) and ``keep_frames`` 0 (no
        key/value is returned: ~117 MB of float16 at 650 frames)."""
        if padded or not self.can_stream:
            return super()._whole_call(padded, n)
        sess = self.stream_estimator
        layers, width, state, hist = stream_layout_v3(sess)
        empty = np.zeros((layers, n, 0, width), cache_dtype(sess, "prompt_k"))
        conv = np.zeros((n, state, hist), np.float32)
        return sess, {"prompt_k": empty, "prompt_v": empty, "context_k": empty, "context_v": empty,
                      "conv_state": conv, "offset": np.array(0, np.int64), "keep_frames": np.array(0, np.int64),
                      "chunk_frames": np.array(0, np.int64)}

    @property
    def chunk_frames(self) -> int:
        """The DiT's streaming attention chunk in mel frames."""
        return int(self.settings.chunk_frames)  # type: ignore[attr-defined]
