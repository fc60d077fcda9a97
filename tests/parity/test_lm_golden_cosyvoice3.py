"""Our CosyVoice3 LM and tokenizer reproduce the official code's golden arrays (tests/golden/v3_lm.npz).

The golden file was made by scripts/make_v3_golden.py, which runs the OFFICIAL ``CosyVoice3LM`` and
``CosyVoice3Tokenizer`` on the tiny v3 fixture; the official code is not needed here. We rebuild the same fixture
(same seed -> same weights, checked by a per-tensor fingerprint), load it with :func:`load_reference` and replay
the same inputs and the same injected draws.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v3_lm.npz"
# Measured (fp32, torch 2.13 CPU, 1 thread): prompt embeddings and the log-probs of the prefill and 5 KV-cache
# decode steps bitwise equal; one full causal pass 2.0e-7 relative (max|ours - official| / max|official|).
# The bound leaves room for other BLAS kernels and thread counts.
LOGP_RTOL = 1e-5


@pytest.fixture(scope="module")
def golden() -> dict:
    z = np.load(GOLDEN, allow_pickle=False)
    out = {k: z[k] for k in z.files}
    out["header"] = json.loads(str(out["header"]))
    return out


@pytest.fixture(scope="module")
def ours(golden, tmp_path_factory):
    """(our CosyVoice3LM, our CosyVoice3Tokenizer) on the fixture the golden arrays were made on."""
    from cosyvoice_cpu.fixtures.weights.cosyvoice3 import write_cosyvoice3_lm_files
    from cosyvoice_cpu.reference.tokenizer import CosyVoice3Tokenizer
    from cosyvoice_cpu.workshop.parts import load_reference

    fx = golden["header"]["fixture"]
    d = tmp_path_factory.mktemp("v3golden") / "tiny-v3"
    write_cosyvoice3_lm_files(d, fx["size"], fx["seed"])
    lm = load_reference(d, stages=("lm",)).lm
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lm, CosyVoice3Tokenizer(d / "CosyVoice-BlankEN")
    torch.set_num_threads(saved)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=torch.long).view(1, -1)


def test_fixture_weights_are_the_golden_ones(golden, ours) -> None:
    lm, _ = ours
    want = golden["header"]["weights_fingerprint"]
    got = {k: float(v.double().abs().sum()) for k, v in lm.state_dict().items()}
    assert list(got) == list(want), "state_dict keys differ from the official CosyVoice3LM"
    bad = [k for k in want if not np.isclose(got[k], want[k], rtol=1e-9)]
    assert not bad, f"fixture weights changed ({bad[:3]}...): regenerate with scripts/make_v3_golden.py"


def test_tokenizer_ids(golden, ours) -> None:
    from cosyvoice_cpu.reference.tokenizer import COSYVOICE3_SPECIALS

    _, tok = ours
    assert list(COSYVOICE3_SPECIALS) == golden["header"]["special_tokens"]
    assert [tok.token_id(s) for s in COSYVOICE3_SPECIALS] == golden["special_ids"].tolist()
    ids = np.split(golden["tokenizer_ids"], np.cumsum(golden["tokenizer_lens"])[:-1])
    for s, want in zip(golden["header"]["tokenizer_strings"], ids):
        assert tok.encode(s) == want.tolist(), s


def test_prompt_embeddings_and_logps(golden, ours) -> None:
    lm, _ = ours
    text, prompt_text, speech = _t(golden["zs_text"]), _t(golden["zs_prompt_text"]), _t(golden["zs_prompt_speech"])
    embeds = lm.prompt_embeddings(text, prompt_text, speech)
    assert torch.equal(embeds[0], torch.from_numpy(golden["zs_embeds"]))
    steps = golden["zs_steps"].tolist()
    n = embeds.shape[1]
    got = [lm.prefill(embeds, max_len=n + len(steps))]
    got += [lm.decode_step(tok, n + i) for i, tok in enumerate(steps)]
    for i, (a, b) in enumerate(zip(got, golden["zs_logp"])):
        assert _rel(a.numpy(), b) < LOGP_RTOL, f"step {i}: {_rel(a.numpy(), b):.2e}"
    # the KV-cache path agrees with one full causal pass too
    full = lm.forward_full(torch.cat([embeds, lm.speech_embedding.weight[steps].unsqueeze(0)], 1))[0, n - 1 :]
    assert _rel(full.numpy(), golden["zs_logp"]) < LOGP_RTOL


@pytest.mark.parametrize("case", ["zs", "cl"])
def test_whole_decode_identical_tokens(golden, ours, case) -> None:
    from cosyvoice_cpu.lm.sampling import inverse_cdf

    lm, _ = ours
    empty = torch.zeros(1, 0, dtype=torch.long)
    if case == "zs":
        args = (_t(golden["zs_text"]), _t(golden["zs_prompt_text"]), _t(golden["zs_prompt_speech"]))
    else:
        args = (_t(golden["cl_text"]), empty, empty)
    for i, seed in enumerate(golden["header"]["decode_seeds"][case]):
        rng = np.random.default_rng(seed)

        def draw(p: torch.Tensor, rng: np.random.Generator = rng) -> int:
            return inverse_cdf(p.numpy(), float(rng.random()))

        got = list(lm.inference(*args, draw=draw))
        assert got == golden[f"{case}_decode_{i}"].tolist(), f"{case} draw seed {seed}"


def test_min_max_len_and_endofprompt_rule(golden, ours) -> None:
    from cosyvoice_cpu.errors import ConfigError

    lm, tok = ours
    n_text = len(golden["zs_text"])
    assert int(n_text * lm.cfg.min_token_text_ratio) == golden["header"]["zs_min_len"]
    assert int(n_text * lm.cfg.max_token_text_ratio) == golden["header"]["zs_max_len"]
    assert golden["header"]["endofprompt_asserts"]
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ConfigError, match="endofprompt"):
        next(lm.inference(_t(tok.encode("no marker")), empty, empty))


def test_silent_run_filter(golden) -> None:
    from cosyvoice_cpu.reference.lm.cosyvoice3 import SilentRunFilter, drop_long_silences

    assert drop_long_silences(golden["silent_input"].tolist()) == golden["silent_output"].tolist()
    f = SilentRunFilter()
    assert [t for t in golden["silent_input"].tolist() if f.keep(t)] == golden["silent_output"].tolist()
