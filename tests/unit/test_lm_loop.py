"""NumPy RAS sampler and the speech-token loop: unit edges, token-exact parity with the reference, errors, no torch."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.generate import LMFacts, SpeechTokenGenerator
from cosyvoice_cpu.lm.sampling import (
    DegenerateOutputError,
    RngDraw,
    SamplingConfig,
    inverse_cdf,
    nucleus_sample,
    ras_sample,
    sample_next,
)
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.reference import sampling as ref_sampling

EOS, V = 6561, 6564


class Recorder:
    """A draw that records what it was offered and returns a fixed index."""

    def __init__(self, pick: int = 0) -> None:
        self.pick, self.offered = pick, []

    def __call__(self, probs: np.ndarray) -> int:
        self.offered.append(np.array(probs))
        return self.pick


def torch_adapter(draw):
    """The reference's Draw (torch probs) on top of a NumPy draw: both sides see the same uniform stream."""
    return lambda p: draw(p.numpy())


def ref_cfg(cfg: SamplingConfig) -> ref_sampling.SamplingConfig:
    return ref_sampling.SamplingConfig(**vars(cfg))


# ---- (a) the sampler ------------------------------------------------------------------------------------------


def test_nucleus_top_p_and_top_k_edges() -> None:
    scores = np.log(np.array([0.5, 0.3, 0.1, 0.05, 0.05], np.float32))
    d = Recorder()  # (exact boundaries like top_p=0.8 here depend on the last ulp of exp; keep away from them)
    assert nucleus_sample(scores, top_p=0.75, top_k=25, draw=d) == 0
    assert len(d.offered[0]) == 2  # 0.5 (0 before) and 0.3 (0.5 before); 0.1 has 0.8 before: out
    for top_p, top_k, n in ((1.0, 3, 3), (1e-6, 25, 1), (1.0, 1, 1), (1.0, 100, 5)):
        d = Recorder()
        nucleus_sample(scores, top_p, top_k, d)
        assert len(d.offered[0]) == n, (top_p, top_k)
    d = Recorder(pick=1)
    assert nucleus_sample(scores, 0.75, 25, d) == 1 and np.isclose(d.offered[0].sum(), 0.8)


def test_ties_keep_id_order_like_the_reference() -> None:
    scores = np.array([0.0, 1.0, 0.0, 1.0, 0.0], np.float32)
    for pick in range(3):
        ours = nucleus_sample(scores, 1.0, 3, Recorder(pick))
        ref = ref_sampling.nucleus_sample(torch.from_numpy(scores), 1.0, 3, lambda p, k=pick: k)
        assert ours == ref == [1, 3, 0][pick]


def test_repetition_aware_resampling_trigger() -> None:
    scores = np.log(np.array([0.9, 0.05, 0.05], np.float32))
    d = Recorder(pick=0)
    assert ras_sample(scores, [2, 0], SamplingConfig(), d) == 0  # 0 seen once >= 10 * 0.1: full-softmax redraw
    assert len(d.offered) == 2 and len(d.offered[1]) == 3 and d.offered[1][0] == 0.0  # repeated id excluded
    d = Recorder(pick=0)
    ras_sample(scores, [2, 0], SamplingConfig(exclude_repeated=False), d)
    assert d.offered[1][0] > 0.8
    for decoded, cfg in (([1, 2], SamplingConfig()), ([0, 1], SamplingConfig(tau_r=0.2)),
                         ([0] + [1] * 10, SamplingConfig())):  # fmt: skip
        d = Recorder(pick=0)
        ras_sample(scores, decoded, cfg, d)  # absent / below win_size * tau_r / outside the window: one draw
        assert len(d.offered) == 1, (decoded, cfg)


def test_eos_is_masked_below_min_len() -> None:
    scores = np.log(np.array([0.1, 0.9], np.float32))  # EOS (id 1) is likely
    d = Recorder(0)
    assert sample_next(scores, [], SamplingConfig(), d, eos_id=1, ignore_eos=True) == 0
    assert len(d.offered[0]) == 1  # EOS has probability 0: not in the nucleus
    assert sample_next(scores, [], SamplingConfig(), Recorder(0), eos_id=1, ignore_eos=False) == 1
    with pytest.raises(DegenerateOutputError, match="EOS 101 times"):
        sample_next(scores, [], SamplingConfig(eos_policy="resample"), lambda p: 0, eos_id=1, ignore_eos=True)
    picks = iter([0, 0, 1])  # resample: EOS twice (nucleus index 0 is EOS), then the other token
    assert sample_next(scores, [], SamplingConfig(eos_policy="resample"), lambda p: next(picks), 1, True) == 0


@pytest.mark.parametrize(
    "bad", [dict(top_p=0), dict(top_p=1.5), dict(top_k=0), dict(win_size=-1), dict(tau_r=-0.1), dict(eos_policy="x")]
)
def test_invalid_configs(bad: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        SamplingConfig(**bad).validate()
    with pytest.raises(ConfigError):
        SamplingConfig.from_manifest(bad)


def test_config_from_manifest() -> None:
    assert SamplingConfig.from_manifest({}) == SamplingConfig()
    assert SamplingConfig.from_manifest({"top_k": 5, "tau_r": 0.2}) == SamplingConfig(top_k=5, tau_r=0.2)
    with pytest.raises(ConfigError, match=r"unknown sampling setting.*temperature"):
        SamplingConfig.from_manifest({"temperature": 1.0})
    with pytest.raises(ConfigError, match="bad sampling settings"):
        SamplingConfig.from_manifest({"top_k": "many"})


def test_inverse_cdf_and_rng_draw() -> None:
    p = np.array([0.0, 0.5, 0.0, 0.5])
    assert [inverse_cdf(p, u) for u in (0.0, 0.49, 0.5, 0.999999, np.nextafter(1.0, 0))] == [1, 1, 3, 3, 3]
    with pytest.raises(DegenerateOutputError):
        inverse_cdf(np.zeros(3), 0.5)
    a, b = RngDraw(7), RngDraw(np.random.default_rng(7))
    q = np.random.default_rng(0).random(50)
    assert [a(q) for _ in range(20)] == [b(q) for _ in range(20)]


def test_sampler_matches_the_reference_on_random_scores() -> None:
    """Same uniforms in, same tokens out, over random log-probs, histories and configs (incl. EOS policies)."""
    rng = np.random.default_rng(1)
    cfgs = [SamplingConfig(), SamplingConfig(top_k=3, top_p=0.95), SamplingConfig(exclude_repeated=False),
            SamplingConfig(eos_policy="resample", win_size=4, tau_r=0.5)]  # fmt: skip
    for step in range(300):
        cfg = cfgs[step % len(cfgs)]
        logp = torch.from_numpy((rng.standard_normal(64) * rng.uniform(0.1, 4)).astype(np.float32)).log_softmax(0)
        decoded = rng.integers(0, 8, rng.integers(0, 15)).tolist()
        ignore = bool(step % 3 == 0)
        ours = sample_next(logp.numpy(), decoded, cfg, RngDraw(step), eos_id=2, ignore_eos=ignore)
        ref = ref_sampling.sample_next(logp, decoded, ref_cfg(cfg), torch_adapter(RngDraw(step)), 2, ignore)
        assert ours == ref, step


# ---- (b) parity of the loop with Qwen2LM.inference on the fp32 export ------------------------------------------


@pytest.fixture(scope="module")
def fp32_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("lm_loop") / "tiny-fp32"
    export_model(tiny_model_dir, out, ExportOptions(recipe="fp32", max_len=512, verify=False))  # parity is the gate
    return out


@pytest.fixture(scope="module")
def gen(fp32_dir: Path) -> SpeechTokenGenerator:
    m = Manifest.load(fp32_dir)
    return SpeechTokenGenerator.from_manifest(LMSession.from_dir(fp32_dir, m.graphs["lm"].attrs), m)


@pytest.fixture(scope="module")
def ref_lm(tiny_model_dir: Path):
    from cosyvoice_cpu.workshop.parts import load_reference

    return load_reference(tiny_model_dir, ("lm",)).lm


class StopDraw:
    """RngDraw that, from call ``after`` on, picks ``stop`` whenever it is offered the full distribution with it.

    The full distribution is offered only by the repetition fallback; ``ALWAYS_REDRAW`` (tau_r = 0) makes every
    step fall back, since the tiny LM's near-uniform top-25 rarely repeats a token.
    """

    def __init__(self, seed: int, after: int, stop: int = EOS) -> None:
        self.inner, self.after, self.stop, self.calls = RngDraw(seed), after, stop, 0

    def __call__(self, probs: np.ndarray) -> int:
        self.calls += 1
        if self.calls > self.after and len(probs) == V and probs[self.stop] > 0:
            return self.stop
        return self.inner(probs)


ALWAYS_REDRAW = SamplingConfig(tau_r=0.0)


def run_both(gen, ref_lm, text, pt, ps, make_draw, cfg=None):
    ref = list(ref_lm.inference(torch.tensor([text]), torch.tensor([pt], dtype=torch.long),
                                torch.tensor([ps], dtype=torch.long), draw=torch_adapter(make_draw()),
                                sampling=ref_cfg(cfg or gen.sampling)))  # fmt: skip
    req = gen.request(text, pt, ps, draw=make_draw(), sampling=cfg)
    return ref, list(req), req


@pytest.mark.parametrize(
    "seed, text, pt, ps, cfg",
    [
        (0, [5, 6, 7], [1, 2], [10, 20, 6000], None),
        (1, [40, 41], [], [], None),
        (2, [9, 8, 7, 6], [300], [1, 2, 3, 4, 5], SamplingConfig(top_k=5, top_p=0.9)),
        (3, [100], [7, 7], [33], SamplingConfig(exclude_repeated=False, eos_policy="resample")),
    ],
)
def test_parity_runs_to_max_len(gen, ref_lm, seed, text, pt, ps, cfg) -> None:
    ref, ours, req = run_both(gen, ref_lm, text, pt, ps, lambda: RngDraw(seed), cfg)
    assert ours == ref
    assert len(ours) == req.max_len == int(len(text) * 20.0) and req.stop_reason == "max_len"


@pytest.mark.parametrize("seed", [0, 4])
def test_parity_stops_at_eos_after_min_len(gen, ref_lm, seed) -> None:
    text = [11, 12, 13]
    ref, ours, req = run_both(gen, ref_lm, text, [5], [1, 2], lambda: StopDraw(seed, after=3), ALWAYS_REDRAW)
    assert ours == ref
    assert len(ours) == req.min_len == 6  # EOS has probability 0 (masked) for the first min_len tokens, then wins
    assert (req.stop_reason, req.stop_token) == ("stop", EOS)


def test_other_stop_ids_end_even_below_min_len(gen, ref_lm) -> None:
    ref, ours, req = run_both(gen, ref_lm, [3, 4], [], [], lambda: StopDraw(0, after=0, stop=EOS + 1), ALWAYS_REDRAW)
    assert ours == ref == [] and req.stop_token == EOS + 1  # 6562 is never masked: stops before min_len


def test_requests_are_independent(gen) -> None:
    """Interleaved and threaded requests on one generator give the tokens of separate runs."""
    args = [([5, 6], [], [], 0), ([7, 8, 9], [1], [2], 1)]
    alone = [list(gen.request(t, p, s, seed=k)) for t, p, s, k in args]
    a, b = (iter(gen.request(t, p, s, seed=k)) for t, p, s, k in args)
    got = ([], [])
    for x, y in zip(a, b):
        got[0].append(x)
        got[1].append(y)
    got[1].extend(b)
    assert list(got) == alone
    out: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, list(gen.request(*args[i][:3], seed=i))))
               for i in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[0], out[1]] == alone


# ---- (c) errors ------------------------------------------------------------------------------------------------


def test_request_errors(gen) -> None:
    with pytest.raises(ConfigError, match="text is empty"):
        gen.request([])
    with pytest.raises(ConfigError, match=r"split it into sentences.*max-len"):
        gen.request(list(range(25)))  # 27 prompt + 25 x 20 - 1 fed tokens = 526 > 512 positions
    gen.request(list(range(24)))  # 26 + 479 = 505: fits
    with pytest.raises(ConfigError, match="prompt speech tokens"):
        gen.request([5], prompt_speech=[EOS])
    with pytest.raises(ConfigError, match="flat sequence"):
        gen.request([[5, 6]])
    req = gen.request([5], seed=0)
    list(req)
    with pytest.raises(ConfigError, match="only once"):
        iter(req)
    with pytest.raises(ConfigError, match="lacks eos_id"):
        LMFacts.from_manifest({"speech_token_size": 6561})


def test_runtime_modules_import_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import cosyvoice_cpu.lm.sampling, cosyvoice_cpu.lm.generate\n"
            "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_top_k_order_is_the_head_of_a_stable_descending_sort() -> None:
    from cosyvoice_cpu.lm.sampling import top_k_order

    rng = np.random.default_rng(1)
    for trial in range(2000):
        n, k = int(rng.integers(1, 60)), int(rng.integers(1, 70))
        probs = rng.random(n).astype(np.float32) if trial % 3 == 0 else rng.integers(0, 5, n).astype(np.float32) / 4
        np.testing.assert_array_equal(top_k_order(probs, k), np.argsort(-probs, kind="stable")[:k])
