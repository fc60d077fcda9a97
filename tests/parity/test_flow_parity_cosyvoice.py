"""Our CosyVoice-300M flow and vocoder vs the official ``MaskedDiffWithXvec`` and 22.05 kHz ``HiFTGenerator``, and
the whole v1 chain (whisper tokenizer -> LM -> flow -> HiFT) given the same random draws.

Both sides are loaded strictly from the tiny v1 fixture (the official modules built by HyperPyYAML from its yaml).
v1 draws fresh flow noise on every call (``randn_like(mu)`` on torch's global RNG); ours takes the noise as an
input, so each test either reseeds the global RNG before both calls or feeds the official draw explicitly.
Errors are relative: ``max|ours - official| / max|official|``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cosyvoice_cpu.reference.flow.length_regulator import frames_for_tokens
from cosyvoice_cpu.reference.hift.cosyvoice import HiFT
from cosyvoice_cpu.reference.sampling import SamplingConfig
from tests.parity.official import rel_err

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("torch_one_thread")]

# Measured (fp32, torch 2.13 CPU, tiny fixture): every stage below is bitwise equal (0.0) -- encoder + length
# regulator, estimator (full mask, padded row, odd length), one full CFM solve, whole inference with and without
# the streaming flow cache, HiFT v1 with the same source noise, and the whole text -> wave chain. The bounds leave
# room for BLAS kernels that round differently.
FLOW_RTOL = 1e-5
WAVE_RTOL = 1e-5
N_PROMPT = 15
PROMPT_FRAMES = 27  # any length: the prompt tokens are stretched to the prompt mel


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "prompt_token": torch.randint(0, 4096, (1, N_PROMPT), generator=g, dtype=torch.int32),
        "prompt_feat": torch.randn(1, PROMPT_FRAMES, 80, generator=g),
        "embedding": torch.randn(1, 192, generator=g),
        "tokens": torch.randint(0, 4096, (1, 57), generator=g, dtype=torch.int32),
    }


def _args(inp: dict, n_new: int, n_prompt: int = N_PROMPT) -> tuple:
    """Positional arguments of ``MaskedDiffWithXvec.inference`` (without the cache)."""
    tok, pt = inp["tokens"][:, :n_new], inp["prompt_token"][:, :n_prompt]
    pf = inp["prompt_feat"][:, : PROMPT_FRAMES if n_prompt else 0]
    i32 = torch.int32
    return (tok, torch.tensor([n_new], dtype=i32), pt, torch.tensor([n_prompt], dtype=i32), pf,
            torch.tensor([pf.shape[1]], dtype=i32), inp["embedding"])  # fmt: skip


def _official_mu(off, tok, pt, pf, n_new: int) -> torch.Tensor:
    """The official ``inference`` up to the decoder, step by step: (1, 80, mel_len1 + mel_len2)."""
    token = torch.cat([pt, tok], dim=1)
    h, _ = off.encoder(off.input_embedding(token.clamp(min=0)), torch.tensor([token.shape[1]]))
    h = off.encoder_proj(h)
    mel_len2 = int(n_new / off.input_frame_rate * 22050 / 256)
    h, _ = off.length_regulator.inference(h[:, : pt.shape[1]], h[:, pt.shape[1] :], pf.shape[1], mel_len2, 50)
    return h.transpose(1, 2)


def test_state_dict_keys_order_and_shapes(official_v1, ours_v1):
    a, b = official_v1["flow"].state_dict(), ours_v1.flow.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape for k in a)
    assert "decoder.estimator.up_blocks.0.2.conv.weight" in a and "length_regulator.model.12.weight" in a


@pytest.mark.parametrize(("n_new", "n_prompt"), [(30, N_PROMPT), (57, N_PROMPT), (45, 0), (41, N_PROMPT)])
@torch.inference_mode()
def test_encoder_and_length_regulator(official_v1, ours_v1, inputs, n_new: int, n_prompt: int):
    """mu after encoder, encoder_proj and the length regulator: <= 40 new tokens one stretch, > 40 head/mid/tail
    (41: a 2-frame middle), with and without a prompt."""
    off, ours = official_v1["flow"], ours_v1.flow
    tok, _, pt, pt_len, pf, _, emb = _args(inputs, n_new, n_prompt)
    ref = _official_mu(off, tok, pt, pf, n_new)
    c = ours.encode(tok, torch.tensor([n_new]), pt, pt_len, pf, emb)
    assert (c.mel_len1, c.mel_len2) == (pf.shape[1], frames_for_tokens(n_new, 50))
    assert rel_err(c.mu, ref) <= FLOW_RTOL
    assert rel_err(c.spks, off.spk_embed_affine_layer(F.normalize(emb, dim=1))) <= FLOW_RTOL
    assert torch.equal(c.cond[:, :, : pf.shape[1]], pf.transpose(1, 2)) and not c.cond[:, :, pf.shape[1] :].any()


@torch.inference_mode()
def test_length_regulator_split_is_not_a_plain_stretch(ours_v1):
    """Guard against a vacuous split test: head/mid/tail differs from stretching 57 tokens in one go."""
    lr = ours_v1.flow.length_regulator
    x = torch.randn(1, 57, 80, generator=torch.Generator().manual_seed(3))
    n = frames_for_tokens(57, 50)
    split = lr.stretch(x[:, :0], x, 0, n)
    plain = F.interpolate(x.transpose(1, 2), size=n, mode="linear")
    assert split.shape == plain.shape == (1, 80, 98) and rel_err(split, plain) > 1e-3


@torch.inference_mode()
def test_estimator(official_v1, ours_v1):
    """Batch 2 (the CFG batch), odd length (down/up-sampling crops), one row padded."""
    off, ours = official_v1["flow"].decoder.estimator, ours_v1.flow.decoder.estimator
    g = torch.Generator().manual_seed(11)
    b, size = 2, 121
    x, mu, cond = (torch.randn(b, 80, size, generator=g) for _ in range(3))
    spks, t = torch.randn(b, 80, generator=g), torch.rand(b, generator=g)
    mask = torch.ones(b, 1, size)
    mask[1, :, size - 17 :] = 0
    ref = off(x, mask, mu, t, spks, cond)
    got = ours(x, mask, mu, t, spks, cond)
    assert rel_err(got, ref) <= FLOW_RTOL
    assert float(got[1, :, size - 17 :].abs().max()) == 0.0


@torch.inference_mode()
def test_cfm_solve_same_noise(official_v1, ours_v1, inputs):
    """One full 10-step CFG solve: the official draw (global RNG after a seed) fed to ours as ``noise``; also the
    streaming cache it returns (prompt frames + last 34 frames of noise and mu)."""
    off, ours = official_v1["flow"], ours_v1.flow
    tok, tok_len, pt, pt_len, pf, _, emb = _args(inputs, 57)
    c = ours.encode(tok, tok_len, pt, pt_len, pf, emb)
    torch.manual_seed(21)
    ref, ref_cache = off.decoder(c.mu.clone(), c.mask, n_timesteps=10, spks=c.spks, cond=c.cond,
                                 prompt_len=c.mel_len1, cache=torch.zeros(1, 80, 0, 2))  # fmt: skip
    torch.manual_seed(21)
    noise = torch.randn(c.mu.shape)
    z, mu, cache = ours.start_noise(c.mu, None, c.mel_len1, noise)
    got = ours.decoder(mu, c.mask, c.spks, c.cond, noise=z)
    assert rel_err(got, ref) <= FLOW_RTOL
    assert cache.shape == ref_cache.shape == (1, 80, c.mel_len1 + 34, 2)
    assert rel_err(cache, ref_cache) <= FLOW_RTOL


@pytest.mark.parametrize("n_new", [30, 57])
def test_inference_and_streaming_cache(official_v1, ours_v1, inputs, n_new: int):
    """Whole ``inference`` from the same global-RNG state, then a second call fed the first call's cache."""
    off, ours = official_v1["flow"], ours_v1.flow
    args = _args(inputs, n_new)
    torch.manual_seed(5)
    ref, ref_cache = off.inference(*args, torch.zeros(1, 80, 0, 2))
    torch.manual_seed(5)
    got, cache = ours.inference(*args)
    assert got.shape == (1, 80, frames_for_tokens(n_new, 50))
    assert rel_err(got, ref) <= FLOW_RTOL and rel_err(cache, ref_cache) <= FLOW_RTOL
    torch.manual_seed(6)
    ref2, _ = off.inference(*args, ref_cache)
    got2, _ = ours.inference(*args, flow_cache=cache, generator=torch.Generator().manual_seed(6))
    assert rel_err(got2, ref2) <= FLOW_RTOL
    assert rel_err(got2, got) > 1e-3  # the other noise outside the cached frames changes the result


@pytest.mark.parametrize("voiced", [False, True])
def test_hift_v1_same_source_noise(official_v1, ours_v1, voiced: bool):
    """22.05 kHz HiFT ([8, 8] upsampling, ``SineGen``): same global-RNG draws -> same source and waveform.

    The fixture's random F0 predictor gives ~0 Hz (unvoiced: a noise-only source); for ``voiced`` copies of both
    models get an F0 classifier that lands around 120 Hz, so the sine harmonics are compared too."""
    off, ours = official_v1["hift"], ours_v1.hift
    if voiced:
        off = copy.deepcopy(off)
        with torch.no_grad():
            cls = off.f0_predictor.classifier
            cls.weight.mul_(60.0 / cls.weight.abs().sum())
            cls.bias.fill_(120.0)
        ours = HiFT(ours_v1.hift.cfg).eval()
        ours.load_checkpoint_state(off.state_dict())
    assert ours.cfg.sine_type == "v1" and ours.cfg.upsample == 256
    mel = torch.randn(1, 80, 43, generator=torch.Generator().manual_seed(8)) * 2 - 5
    f0 = ours.f0(mel)
    assert (float(f0.min()) > 50) if voiced else (float(f0.max()) < 10)  # the nsf_voiced_threshold is 10 Hz
    torch.manual_seed(12)
    ref, ref_src = off.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0))
    torch.manual_seed(12)
    got, src = ours.inference(mel)
    assert got.shape == ref.shape == (1, 43 * 256)
    assert rel_err(src, ref_src) <= WAVE_RTOL and rel_err(got, ref) <= WAVE_RTOL
    assert float(ref.abs().max()) > 1e-3  # not a silent output


def test_whole_chain_text_to_wave(official_v1, ours_v1, inputs):
    """Whisper token ids -> LM (same seed: identical tokens) -> flow (same seed) -> HiFT (same seed)."""
    tokenizer = official_v1["get_tokenizer"]()
    text = torch.tensor([tokenizer.encode("Warning: line three is too hot.")], dtype=torch.int32)
    prompt_text = torch.tensor([tokenizer.encode("Good morning.")], dtype=torch.int32)
    pt, pf, emb = inputs["prompt_token"], inputs["prompt_feat"], inputs["embedding"]
    i32 = torch.int32

    def lens(*ts: torch.Tensor) -> list[torch.Tensor]:
        return [torch.tensor([t.shape[1]], dtype=i32) for t in ts]

    llm, flow, hift = official_v1["llm"], official_v1["flow"], official_v1["hift"]
    with torch.inference_mode():
        torch.manual_seed(4)
        n_text, n_prompt_text, n_prompt = lens(text, prompt_text, pt)
        ref_tokens = [int(t) for t in llm.inference(text, n_text, prompt_text, n_prompt_text, pt, n_prompt, emb)]
        tk = torch.tensor([ref_tokens], dtype=i32)
        torch.manual_seed(5)
        ref_mel, _ = flow.inference(tk, *lens(tk), pt, *lens(pt), pf, *lens(pf), emb, torch.zeros(1, 80, 0, 2))
        torch.manual_seed(6)
        ref_wave, _ = hift.inference(speech_feat=ref_mel, cache_source=torch.zeros(1, 1, 0))

    m = ours_v1
    torch.manual_seed(4)
    tokens = list(m.lm.inference(text, prompt_text, pt, emb, sampling=SamplingConfig.token2wav_0_1_0()))
    assert tokens == ref_tokens
    tk = torch.tensor([tokens])
    torch.manual_seed(5)
    mel, _ = m.flow.inference(tk, torch.tensor([tk.shape[1]]), pt, torch.tensor([N_PROMPT]), pf, None, emb)
    torch.manual_seed(6)
    wave, _ = m.hift.inference(mel)
    assert rel_err(mel, ref_mel) <= FLOW_RTOL
    assert rel_err(wave, ref_wave) <= WAVE_RTOL
    assert wave.shape == (1, frames_for_tokens(len(tokens), 50) * 256)
