"""Repetition-Aware Sampling: nucleus ∩ top-k, the repetition fallback and the EOS policies."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.sampling import SamplingConfig, nucleus_sample, ras_sample, sample_next


class Recorder:
    """A draw that records what it was offered and returns a fixed index."""

    def __init__(self, pick: int = 0) -> None:
        self.pick, self.offered = pick, []

    def __call__(self, probs: torch.Tensor) -> int:
        self.offered.append(probs.clone())
        return self.pick


def test_nucleus_keeps_top_p_mass_and_at_most_top_k() -> None:
    scores = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]))
    d = Recorder()
    assert nucleus_sample(scores, top_p=0.8, top_k=25, draw=d) == 0
    assert len(d.offered[0]) == 2  # 0.5 (< 0.8 before) then 0.3 (0.5 < 0.8 before), stop at 0.8
    d = Recorder()
    nucleus_sample(scores, top_p=1.0, top_k=3, draw=d)
    assert len(d.offered[0]) == 3


def test_repetition_falls_back_to_the_full_distribution_without_the_repeated_token() -> None:
    scores = torch.log(torch.tensor([0.9, 0.05, 0.05]))
    d = Recorder(pick=0)
    cfg = SamplingConfig()
    assert ras_sample(scores, [2, 0], cfg, d) == 0  # fallback draw returns index 0 of the full softmax
    assert len(d.offered) == 2 and len(d.offered[1]) == 3 and d.offered[1][0] == 0.0
    d = Recorder(pick=0)
    ras_sample(scores, [2, 0], SamplingConfig(exclude_repeated=False), d)
    assert d.offered[1][0] > 0.8
    d = Recorder(pick=0)
    ras_sample(scores, [1, 2], cfg, d)  # no repetition: one draw
    assert len(d.offered) == 1


def test_eos_policies() -> None:
    scores = torch.log(torch.tensor([0.1, 0.9]))  # EOS (id 1) is likely
    assert sample_next(scores, [], SamplingConfig(), Recorder(0), eos_id=1, ignore_eos=True) == 0
    with pytest.raises(RuntimeError, match="EOS 101 times"):
        sample_next(scores, [], SamplingConfig(eos_policy="resample"), lambda p: 0, eos_id=1, ignore_eos=True)


def test_config_validation() -> None:
    for bad in (dict(top_p=0), dict(top_k=0), dict(eos_policy="never"), dict(win_size=-1)):
        with pytest.raises(ConfigError):
            SamplingConfig(**bad).validate()
