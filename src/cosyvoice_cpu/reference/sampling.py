"""Repetition-Aware Sampling (RAS) of CosyVoice's speech-token LM, with an injectable random source.

One step: softmax the scores, keep the most likely tokens while their cumulative probability is below
``top_p`` and fewer than ``top_k`` are kept (nucleus ∩ top-k), draw one. If the drawn id already occurs at least
``win_size * tau_r`` times among the last ``win_size`` decoded tokens, draw again from the full distribution
(with the repeated id excluded when ``exclude_repeated`` is set, as the official code does since 2026-02).

Every draw goes through a :class:`Draw` callable ``probs (N,) -> index``, so tests can replay the official code's
random stream (the default uses ``torch.multinomial`` on a seeded generator, the same call the official code
makes on the global RNG) and the NumPy runtime can share the exact same draws.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

# One settings class for the reference and the runtime (plain data, no torch); re-exported from here.
from cosyvoice_cpu.lm.sampling import SamplingConfig
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)
__all__ = ["Draw", "SamplingConfig", "nucleus_sample", "ras_sample", "sample_next", "sampling_from_yaml", "torch_draw"]

Draw = Callable[[torch.Tensor], int]
"""Draw one index from an unnormalised probability vector (N,)."""


def sampling_from_yaml(node: Any) -> SamplingConfig:
    """The LM's ``sampling: !name:cosyvoice.utils.common.ras_sampling`` arguments (defaults where absent)."""
    if not isinstance(node, Tagged):
        return SamplingConfig()
    return SamplingConfig(
        top_p=float(node.get("top_p", 0.8)),
        top_k=int(node.get("top_k", 25)),
        win_size=int(node.get("win_size", 10)),
        tau_r=float(node.get("tau_r", 0.1)),
    )


def torch_draw(generator: torch.Generator | None = None) -> Draw:
    """The default random source: ``torch.multinomial(p, 1, replacement=True)`` on ``generator``."""

    def draw(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, replacement=True, generator=generator).item())

    return draw


def nucleus_sample(scores: torch.Tensor, top_p: float, top_k: int, draw: Draw) -> int:
    """Draw from the nucleus ∩ top-k of ``softmax(scores)``; scores (N,) -> token id."""
    probs, idx = scores.softmax(dim=0).sort(descending=True, stable=True)
    # keep token i while the mass of the tokens before it is < top_p (and at most top_k tokens); the
    # exclusive running sum is accumulated in fp32 left to right, as the official loop does
    head = probs[:top_k]
    before = torch.cat([head.new_zeros(1), torch.cumsum(head, 0)[:-1]])
    keep = max(1, int((before < top_p).sum()))
    return int(idx[draw(probs[:keep].clone())])


def ras_sample(scores: torch.Tensor, decoded: Sequence[int], cfg: SamplingConfig, draw: Draw) -> int:
    """One Repetition-Aware Sampling step. scores (N,) log-probabilities; decoded = tokens so far."""
    token = nucleus_sample(scores, cfg.top_p, cfg.top_k, draw)
    window = list(decoded[-cfg.win_size :]) if cfg.win_size else []
    if window.count(token) >= cfg.win_size * cfg.tau_r:
        if cfg.exclude_repeated:
            scores = scores.clone()
            scores[token] = -float("inf")
        token = draw(scores.softmax(dim=0))
    return token


def sample_next(
    logp: torch.Tensor,
    decoded: Sequence[int],
    cfg: SamplingConfig,
    draw: Draw,
    eos_id: int,
    ignore_eos: bool,
) -> int:
    """Sample the next speech token honouring ``cfg.eos_policy`` while ``ignore_eos``; logp (N,)."""
    if not ignore_eos:
        return ras_sample(logp, decoded, cfg, draw)
    if cfg.eos_policy == "mask":
        logp = logp.clone()
        logp[eos_id] = -float("inf")
        return ras_sample(logp, decoded, cfg, draw)
    for _ in range(101):
        token = ras_sample(logp, decoded, cfg, draw)
        if token != eos_id:
            return token
    raise RuntimeError("sampling drew EOS 101 times while EOS is not allowed yet; the LM output is degenerate")
