"""Random inputs of the whole-sentence flow estimator, for the scripts that time it alone (``bench/``)."""

from __future__ import annotations

import numpy as np


def estimator_feeds(frames: int, rng: np.random.Generator, rows: int = 2) -> dict[str, np.ndarray]:
    """One estimator call's inputs, float32: ``x``, ``mu``, ``cond`` (rows, 80, frames) standard normal, ``mask``
    (rows, 1, frames) ones (nothing padded), ``t`` (rows,) 0.3, ``spks`` (rows, 80) standard normal. Two rows are
    one CFG call; values do not move the speed."""
    f = {k: rng.standard_normal((rows, 80, frames)).astype(np.float32) for k in ("x", "mu", "cond")}
    return {
        **f,
        "mask": np.ones((rows, 1, frames), np.float32),
        "t": np.full(rows, 0.3, np.float32),
        "spks": rng.standard_normal((rows, 80)).astype(np.float32),
    }
