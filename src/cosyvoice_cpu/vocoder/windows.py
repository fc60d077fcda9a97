"""Long vocoder calls in windows: ``hift_decode`` on overlapping pieces of the mel, the same samples as one call.

HiFT's decode graph is a stack of convolutions, an STFT and an inverse STFT: a wave sample depends on the mel
frames and source samples within a fixed distance of it and on nothing else (no normalisation over time). So the
samples of frames ``[a, b)`` can be computed from the frames ``[a - left, b + right)`` alone, where ``left`` and
``right`` cover that distance (:func:`cosyvoice_cpu.export.hift.common.decode_context`, measured at export and
stored in the ``hift_decode`` attrs as ``context_frames``). At the utterance's ends a window starts or stops where
the whole call does, with the same padding. What differs from one call is float rounding only (the convolutions
block their products by length), ~1e-7 relative.

Why: ORT's CPU arena never returns memory, and HiFT's activations grow with the length: the arena grows with
every longer call and keeps it for the life of the process (measured: docs/benchmarks-log.md, "Memory"). In
windows of at most :data:`DEFAULT_WINDOW_FRAMES` frames a call of any length needs what one window needs; the cost
is the margins, computed twice (2 x 16 frames per seam for CosyVoice2).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.jsontypes import JsonValue

DEFAULT_WINDOW_FRAMES = 500  # 10 s of CosyVoice2 mel: the bench's sentence still runs in one call
MIN_WINDOW_FRAMES = 20


def context_of(attrs: dict[str, JsonValue]) -> tuple[int, int] | None:
    """``(left, right)`` mel frames of context from the ``hift_decode`` attrs; None if the export did not measure
    them (directories exported before windows existed: every call stays whole)."""
    value = attrs.get("context_frames")
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ModelDirError(f"hift_decode attrs: context_frames must be [left, right] ints >= 0, got {value!r}")
    return int(value[0]), int(value[1])


def check_window(window_frames: int) -> int:
    """``window_frames`` validated: 0 (never split) or at least :data:`MIN_WINDOW_FRAMES`."""
    if (
        isinstance(window_frames, bool)
        or not isinstance(window_frames, int)
        or (window_frames != 0 and window_frames < MIN_WINDOW_FRAMES)
    ):
        raise ConfigError(
            f"vocoder window_frames must be 0 (never split) or an int >= {MIN_WINDOW_FRAMES}, got {window_frames!r}"
        )
    return window_frames


def plan(frames: int, window: int, context: tuple[int, int] | None) -> list[tuple[int, int, int, int]]:
    """The pieces of a ``frames``-long call: ``(lo, hi, a, b)`` runs the graph on frames ``[lo, hi)`` and keeps
    the samples of frames ``[a, b)``. One piece ``(0, frames, 0, frames)`` when the call fits in ``window`` (or
    windows are off: ``window`` 0 or no ``context``); else ``ceil(frames / window)`` pieces of equal length."""
    if not window or context is None or frames <= window:
        return [(0, frames, 0, frames)]
    left, right = context
    n = math.ceil(frames / window)
    bounds = [round(i * frames / n) for i in range(n + 1)]
    return [(max(0, a - left), min(frames, b + right), a, b) for a, b in itertools.pairwise(bounds)]


def decode_windows(
    run: Callable[[np.ndarray, np.ndarray], np.ndarray],
    mel: np.ndarray,
    source: np.ndarray,
    upsample: int,
    pieces: list[tuple[int, int, int, int]],
    run_last: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """``run(mel (B, C, n), source (B, 1, n * upsample)) -> (B, n * upsample)`` over the ``pieces`` of
    :func:`plan`, joined: ``mel (B, C, T)``, ``source (B, 1, T * upsample)`` -> wave ``(B, T * upsample)``.
    ``run_last`` (default ``run``) runs the last window of a call split in several."""
    if len(pieces) == 1:
        return run(mel, source)
    out = np.empty((mel.shape[0], mel.shape[2] * upsample), np.float32)
    for i, (lo, hi, a, b) in enumerate(pieces):
        piece_source = np.ascontiguousarray(source[:, :, lo * upsample : hi * upsample])
        call = run_last if run_last is not None and i == len(pieces) - 1 else run
        part = call(np.ascontiguousarray(mel[:, :, lo:hi]), piece_source)
        out[:, a * upsample : b * upsample] = part[:, (a - lo) * upsample : (b - lo) * upsample]
    return out
