"""Classifier-free guidance as the estimator's batch rows: the official solver's layout of the conditioned and
unconditioned rows, and how their velocities combine.

With guidance (``cfg_rate > 0``) each utterance takes two rows: block 0 conditioned, block 1 with mu, spks and
cond zeroed; the step's velocity is ``(1 + r) v_cond - r v_uncond``. Without it, one conditioned row.
"""

from __future__ import annotations

import numpy as np


def guidance_rows(cfg_rate: float) -> int:
    """Estimator rows per utterance: 2 (conditioned + unconditioned) with guidance, else 1."""
    return 2 if cfg_rate > 0 else 1


def guided_rows(mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, rows: int) -> dict[str, np.ndarray]:
    """Row block 0 conditioned, block 1 (``rows == 2``) unconditioned: mu, spks and cond zeroed (the reference
    solver's layout)."""
    return {
        "mu": np.concatenate([mu, np.zeros_like(mu)][:rows]),
        "spks": np.concatenate([spks, np.zeros_like(spks)][:rows]),
        "cond": np.concatenate([cond, np.zeros_like(cond)][:rows]),
    }


def guide(v: np.ndarray, cfg_rate: float, b: int) -> np.ndarray:
    """``(1+r) v_cond - r v_uncond`` from the estimator output of :func:`guided_rows` rows."""
    if v.shape[0] == b:
        return v
    return np.float32(1.0 + cfg_rate) * v[:b] - np.float32(cfg_rate) * v[b:]
