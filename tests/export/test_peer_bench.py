"""``bench/peer.py`` (the PyTorch peers' stage benchmark) runs on the tiny fixture for both implementations and
reports every field, on the same workload."""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.repo_scripts import load_script

TOKENS = 20
FIELDS = ("impl", "threads", "tokens", "audio_s", "torch_version", "machine", "build_s", "lm_prefill_s",
          "lm_decode_tok_s", "lm_total_s", "flow_s", "flow_ms_per_step", "hift_s", "e2e_s", "rtf", "peak_rss_mb",
          "rss_after")  # fmt: skip
TIMES = ("build_s", "lm_prefill_s", "lm_decode_tok_s", "lm_total_s", "flow_s", "flow_ms_per_step", "hift_s", "e2e_s")

PEER = "bench/peer.py"  # not a package: loaded as a module (it does no work at import)


@pytest.fixture(scope="module")
def results(tiny_model_dir) -> dict[str, dict]:
    """Both implementations' JSON on the tiny fixture, each from its own subprocess."""
    if importlib.util.find_spec("cosyvoice") is None:
        pytest.skip("official CosyVoice code not installed (token2wav-cosyvoice); run scripts/install.sh --dev")
    peer = load_script(PEER)
    return {impl: peer.run_peer(tiny_model_dir, impl, threads=1, tokens=TOKENS, seed=0, timeout=120)
            for impl in peer.IMPLS}  # fmt: skip


@pytest.mark.parametrize("impl", ["official", "reference"])
def test_fields_and_times(results, impl: str) -> None:
    r = results[impl]
    missing = [k for k in FIELDS if k not in r]
    assert not missing, missing
    assert r["impl"] == impl and r["threads"] == 1 and r["tokens"] == TOKENS
    for key in TIMES:
        assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
    assert r["rtf"] > 0 and math.isclose(r["rtf"], r["e2e_s"] / r["audio_s"])
    assert math.isclose(r["e2e_s"], r["lm_total_s"] + r["flow_s"] + r["hift_s"])
    assert set(r["rss_after"]) == {"build", "lm", "flow", "hift"}
    assert r["peak_rss_mb"] >= max(r["rss_after"].values()) > 0
    assert r["flow_estimator_calls"] == 10  # 10 Euler steps, CFG as one batch-2 call each
    assert r["flow_mel_frames"] == 2 * TOKENS and r["hift_samples"] == 480 * 2 * TOKENS


def test_same_workload(results) -> None:
    off, ref = results["official"], results["reference"]
    assert off["tokens"] == ref["tokens"] == TOKENS
    assert off["audio_s"] == ref["audio_s"] == TOKENS / 25


def test_exact_ratio_forces_length() -> None:
    """int(n_text * ratio) is exactly the wanted count, in float64 and in float32 (official tensor math)."""
    import torch

    ratio = load_script(PEER).exact_ratio
    for n_text in (1, 7, 40, 41):
        for tokens in (1, 20, 30, 249, 250, 251, 500, 1000):
            r = ratio(tokens, n_text)
            assert int(n_text * r) == tokens
            assert int(torch.tensor([n_text]) * r) == tokens
