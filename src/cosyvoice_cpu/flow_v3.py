"""The Fun-CosyVoice3 (v3) flow at run time (NumPy + ONNX Runtime, no torch): speech tokens -> 80-bin mel.

    tokens --flow_encoder.onnx (the v2 contract: token, context, embedding, chunk_size)--> mu (1, 80, 2T), spks
        (inside: Embedding(6561, 80) -> PreLookaheadLayer 80 -> 1024 -> 80 -> repeat x2; chunk_size is unused)
    cond = prompt mel then zeros; x_0 = the official fixed noise (``flow_noise.npy``, the same table as v2)
    Euler/CFG over ``flow_estimator.onnx`` (the DiT, official contract) = :meth:`FlowStage.solve`

Whole sentences therefore run on :class:`~cosyvoice_cpu.flow.FlowStage` unchanged;
:class:`FlowStageV3` only swaps the stream estimator's contract (``flow_estimator_stream.onnx`` of v3: a window
of frames on a key/value cache, :mod:`cosyvoice_cpu.export.flow_stream_graph_v3`) and adds the DiT's attention
chunk (``chunk_frames``, 50). Streaming is :class:`~cosyvoice_cpu.flow_stream_v3.FlowStreamV3`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow import FILES, FlowSettings, FlowStage
from cosyvoice_cpu.sessions import SessionConfig

logger = logging.getLogger(__name__)

# manifest keys -> file names: the v2 names (the stream estimator has the v3 contract below)
FILES_V3 = dict(FILES)
STREAM_IO_V3 = (
    {"x": ("float", 3), "mu": ("float", 3), "t": ("float", 1), "spks": ("float", 2), "cond": ("float", 3),
     "prompt_k": ("float|float16", 4), "prompt_v": ("float|float16", 4), "context_k": ("float|float16", 4),
     "context_v": ("float|float16", 4), "conv_state": ("float", 3), "offset": ("int64", 0)},
    ("velocity", ("new_k", "float|float16"), ("new_v", "float|float16"), "conv_in"),
)  # fmt: skip


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
    stream_serves_whole = False  # the window graph on key/value caches is not the full-attention DiT

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

    @property
    def chunk_frames(self) -> int:
        """The DiT's streaming attention chunk in mel frames."""
        return int(self.settings.chunk_frames)  # type: ignore[attr-defined]
