"""Repetition-Aware Sampling (RAS) of the speech-token LM in NumPy, with an injectable random source.

The torch-free twin of :mod:`cosyvoice_cpu.reference.sampling`: the same steps, the same tie-breaking, the same
number and order of random draws, so that fed the same :data:`Draw` both pick the same tokens. One step:
softmax the log-probabilities, sort them (descending, stable: equal probabilities keep id order), keep the head
while the mass *before* a token is below ``top_p`` and at most ``top_k`` tokens (at least one), draw one. If the
drawn id occurs at least ``win_size * tau_r`` times among the last ``win_size`` decoded tokens, draw again from
the full distribution (without the repeated id when ``exclude_repeated``).

Every random choice goes through a :data:`Draw` ``probs (N,) -> index`` (unnormalised, non-negative probs). The
default, :class:`RngDraw`, inverts the CDF at one ``numpy.random.Generator.random()`` per draw, so a request
seeded with ``seed`` is reproducible; tests wrap the same class for the reference to replay identical uniforms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from cosyvoice_cpu.errors import ConfigError, CosyVoiceCpuError
from cosyvoice_cpu.jsontypes import JsonValue

logger = logging.getLogger(__name__)

Draw = Callable[[np.ndarray], int]
"""Draw one index from an unnormalised probability vector (N,) float; returns an index with probs[index] > 0."""

EOS_POLICIES = ("mask", "resample")
MAX_EOS_TRIALS = 101  # the 0.1.0 code: 1 draw + 100 retries


class DegenerateOutputError(CosyVoiceCpuError, RuntimeError):
    """Sampling cannot go on: the LM keeps producing EOS while EOS is not allowed yet."""


@dataclass
class SamplingConfig:
    """RAS parameters (defaults = the released CosyVoice2 yaml) and the end-of-speech policy.

    ``eos_policy``: while fewer than ``min_len`` tokens are decoded, EOS is masked out of the scores (``"mask"``,
    the official code since 2025) or drawn and rejected up to 100 more times (``"resample"``, the
    ``token2wav-cosyvoice==0.1.0`` code). The other stop ids are never masked (as in the reference).
    """

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    exclude_repeated: bool = True
    eos_policy: str = "mask"

    def validate(self) -> None:
        """Raise ConfigError naming the bad field and its valid range."""
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling top_p must be in (0, 1] (0.8 is the CosyVoice2 default), got {self.top_p}")
        if self.top_k < 1:
            raise ConfigError(f"sampling top_k must be an integer >= 1 (25 is the default), got {self.top_k}")
        if self.win_size < 0 or self.tau_r < 0:
            raise ConfigError(
                f"sampling win_size and tau_r must be >= 0 (defaults 10 and 0.1), got {self.win_size} and {self.tau_r}"
            )
        if self.eos_policy not in EOS_POLICIES:
            raise ConfigError(f"sampling eos_policy must be one of {', '.join(EOS_POLICIES)}, got {self.eos_policy!r}")

    @classmethod
    def token2wav_0_1_0(cls, **kw: object) -> SamplingConfig:
        """The behaviour of the official code packaged as ``token2wav-cosyvoice==0.1.0`` (parity tests)."""
        return cls(exclude_repeated=False, eos_policy="resample", **kw)

    @classmethod
    def from_manifest(cls, d: Mapping[str, JsonValue]) -> SamplingConfig:
        """Build from the manifest's ``sampling`` section (missing keys take the defaults) and validate."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown sampling setting(s) {', '.join(unknown)}; valid ones are {', '.join(known)} "
                "(re-export the model directory if it was written by a newer cosyvoice-cpu)"
            )
        casts = {
            "top_p": float,
            "top_k": int,
            "win_size": int,
            "tau_r": float,
            "exclude_repeated": bool,
            "eos_policy": str,
        }
        try:
            cfg = cls(**{k: casts[k](v) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad sampling settings {dict(d)}: {e}; fix the manifest's sampling section") from e
        cfg.validate()
        return cfg


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The index whose CDF bin holds ``u`` in [0, 1); probs (N,) unnormalised, non-negative, not all zero.

    Zero-probability entries are never returned (their bins are empty and the search goes right of ties).
    """
    cdf = np.cumsum(np.asarray(probs, dtype=np.float64))
    total = cdf[-1]
    if not total > 0 or not np.isfinite(total):
        raise DegenerateOutputError(f"cannot draw from probabilities summing to {total}; the LM output is broken")
    idx = int(np.searchsorted(cdf, u * total, side="right"))
    if idx >= len(cdf):  # u * total rounded up to total: take the last non-empty bin
        idx = int(np.flatnonzero(np.asarray(probs) > 0)[-1])
    return idx


class RngDraw:
    """The default random source: inverse CDF at ``rng.random()``, one uniform per draw.

    Args:
        rng: a ``numpy.random.Generator`` (or an int seed / None for a fresh one).
    """

    def __init__(self, rng: np.random.Generator | int | None = None) -> None:
        self.rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)

    def __call__(self, probs: np.ndarray) -> int:
        return inverse_cdf(probs, float(self.rng.random()))


def softmax(scores: np.ndarray) -> np.ndarray:
    """float32 softmax of scores (N,) (``-inf`` entries get probability 0) -> (N,)."""
    x = np.asarray(scores, dtype=np.float32)
    e = np.exp(x - x.max())
    return e / e.sum(dtype=np.float32)


def top_k_order(probs: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` indices of a stable descending sort of ``probs`` (N,) (ties keep ascending ids, as torch's
    stable sort), in O(N): a partition finds the k-th largest value, then only the candidates at or above it
    (every tie at the boundary included) are sorted. A full stable sort of the 6,564 speech logits cost more per
    token than a tiny model's whole decode step (measured: docs/benchmarks-log.md, "LM")."""
    n = len(probs)
    if k >= n:
        return np.argsort(-probs, kind="stable")
    kth = np.partition(probs, n - k)[n - k]
    candidates = np.flatnonzero(probs >= kth)  # ascending ids, so the stable sort below keeps id order on ties
    if len(candidates) < k:  # NaN scores compare false: the full sort, as before (the draw then reports them)
        return np.argsort(-probs, kind="stable")[:k]
    return candidates[np.argsort(-probs[candidates], kind="stable")][:k]


def nucleus_sample(scores: np.ndarray, top_p: float, top_k: int, draw: Draw) -> int:
    """Draw from the nucleus ∩ top-k of ``softmax(scores)``; scores (N,) -> token id."""
    probs = softmax(scores)
    order = top_k_order(probs, top_k)  # descending; ties keep ascending ids
    head = probs[order]
    # exclusive running mass, accumulated in float64 and rounded to float32 per element (torch.cumsum on CPU)
    before = np.empty_like(head)
    before[0] = 0.0
    before[1:] = np.cumsum(head[:-1], dtype=np.float64).astype(np.float32)
    keep = max(1, int(np.count_nonzero(before < np.float32(top_p))))
    return int(order[draw(head[:keep].copy())])


def ras_sample(scores: np.ndarray, decoded: Sequence[int], cfg: SamplingConfig, draw: Draw) -> int:
    """One Repetition-Aware Sampling step; scores (N,) log-probabilities, decoded = tokens so far -> token id."""
    token = nucleus_sample(scores, cfg.top_p, cfg.top_k, draw)
    window = list(decoded[-cfg.win_size :]) if cfg.win_size else []
    if window.count(token) >= cfg.win_size * cfg.tau_r:
        if cfg.exclude_repeated:
            scores = np.array(scores, dtype=np.float32)
            scores[token] = -np.inf
        token = int(draw(softmax(scores)))
    return token


def sample_next(
    logp: np.ndarray,
    decoded: Sequence[int],
    cfg: SamplingConfig,
    draw: Draw,
    eos_id: int,
    ignore_eos: bool,
) -> int:
    """Sample the next speech token, keeping EOS out while ``ignore_eos`` per ``cfg.eos_policy``; logp (N,)."""
    if not ignore_eos:
        return ras_sample(logp, decoded, cfg, draw)
    if cfg.eos_policy == "mask":
        logp = np.array(logp, dtype=np.float32)
        logp[eos_id] = -np.inf
        return ras_sample(logp, decoded, cfg, draw)
    for _ in range(MAX_EOS_TRIALS):
        token = ras_sample(logp, decoded, cfg, draw)
        if token != eos_id:
            return token
    raise DegenerateOutputError(
        f"sampling drew EOS {MAX_EOS_TRIALS} times while EOS is not allowed yet; the LM output is degenerate "
        "(check the model directory, or use eos_policy='mask')"
    )
