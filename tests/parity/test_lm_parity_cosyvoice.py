"""Our CosyVoice-300M LM (``reference.lm_v1.TransformerLM``) vs the official ``cosyvoice.llm.llm.TransformerLM``.

Both are loaded strictly from the tiny v1 fixture (the official one built by HyperPyYAML from its yaml). For the
sampling tests both speech heads are scaled by 8 (a peaky distribution, so top-p and RAS redraws matter).
Errors are relative: ``max|ours - official| / max|official|``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cosyvoice_cpu.reference.sampling import SamplingConfig
from tests.parity.official import rel_err

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("torch_one_thread")]

# Measured (fp32, torch 2.13 CPU, tiny fixture, 1 or 2 threads): prompt embeddings and text encoder 0 (bitwise),
# causal prefix (ours alone vs inside a longer text) 2.9e-7, prefill log-probs 0, decode steps 0.6e-7 .. 1.8e-7
# (our per-row projection of the relative positions vs the official full-table matmul), KV-cache decode vs full
# recompute 1.7e-7 .. 3.2e-7. The bounds leave room for other BLAS kernels.
EMBED_RTOL = 1e-6
LOGP_RTOL = 1e-5
SPEECH = 4096  # speech_token_size; EOS id


@pytest.fixture(scope="module")
def pair(official_v1, ours_v1):
    """(official, ours) LMs holding the fixture's weights, speech head scaled by 8 in both."""
    theirs, ours = copy.deepcopy(official_v1["llm"]).eval(), copy.deepcopy(ours_v1.lm).eval()
    with torch.no_grad():
        theirs.llm_decoder.weight.mul_(8.0)
        ours.llm_decoder.weight.mul_(8.0)
    return theirs, ours


@pytest.fixture(scope="module")
def tokenizer(official_v1):
    """The official v1 text tokenizer (openai-whisper multilingual tiktoken, as the yaml names it)."""
    return official_v1["get_tokenizer"]()


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text, allowed_special="all")], dtype=torch.int32)


def _official_embeds(theirs, text, prompt_text, prompt_speech, embedding) -> torch.Tensor:
    """The official sequence assembly of ``TransformerLM.inference`` (steps 1-3), for batch 1."""
    t = torch.cat([prompt_text, text], dim=1)
    h, _ = theirs.encode(theirs.text_embedding(t), torch.tensor([t.shape[1]], dtype=torch.int32))
    w = theirs.llm_embedding.weight
    parts = [w[0].view(1, 1, -1)]
    if embedding.shape[0]:
        parts.append(theirs.spk_embed_affine_layer(F.normalize(embedding, dim=1)).unsqueeze(1))
    parts += [h, w[1].view(1, 1, -1)]
    if prompt_speech.shape[1]:
        parts.append(theirs.speech_embedding(prompt_speech))
    return torch.cat(parts, dim=1)


def test_state_dict_keys_order_and_shapes(official_v1, ours_v1):
    """Same keys in the same order with the same shapes: a released llm.pt loads strictly into either."""
    a, b = official_v1["llm"].state_dict(), ours_v1.lm.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape for k in a)
    assert "llm.encoders.0.self_attn.pos_bias_u" in a and "text_encoder.encoders.1.norm_mha.weight" in a


@pytest.mark.parametrize(("with_spk", "with_prompt"), [(True, True), (False, True), (True, False)])
@torch.inference_mode()
def test_prompt_embeddings(pair, tokenizer, with_spk: bool, with_prompt: bool):
    theirs, ours = pair
    g = torch.Generator().manual_seed(1)
    text = _ids(tokenizer, "The pumps on line three have stopped.")
    prompt_text = _ids(tokenizer, "Good morning everyone." if with_prompt else "")
    prompt_speech = torch.randint(0, SPEECH, (1, 7 if with_prompt else 0), generator=g, dtype=torch.int32)
    emb = torch.randn(1, 192, generator=g) if with_spk else torch.zeros(0, 192)
    ref = _official_embeds(theirs, text, prompt_text.view(1, -1), prompt_speech, emb)
    got = ours.prompt_embeddings(text, prompt_text.view(1, -1), prompt_speech, emb)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= EMBED_RTOL


@torch.inference_mode()
def test_text_encoder_is_causal(pair, tokenizer):
    """The text encoder runs chunk-1 (causal) attention, as the official ``encode(decoding_chunk_size=1)``:
    appending text does not change the encoding of what came before (and our mask matches theirs)."""
    theirs, ours = pair
    short, long = _ids(tokenizer, "Check valve seven"), _ids(tokenizer, "Check valve seven now, please.")
    a, b = ours.encode_text(short), ours.encode_text(long)
    assert rel_err(b[:, : a.shape[1]], a) <= EMBED_RTOL
    ref, _ = theirs.encode(theirs.text_embedding(long), torch.tensor([long.shape[1]], dtype=torch.int32))
    assert rel_err(b, ref) <= EMBED_RTOL


@torch.inference_mode()
def test_prefill_and_decode_logits(pair, tokenizer):
    """Prefill then 6 decode steps: our KV-cache decoder vs the official ``forward_chunk`` loop."""
    theirs, ours = pair
    g = torch.Generator().manual_seed(2)
    text = _ids(tokenizer, "Warning: the temperature is too high.")
    prompt_text = _ids(tokenizer, "Hello there.")
    prompt_speech = torch.randint(0, SPEECH, (1, 9), generator=g, dtype=torch.int32)
    emb = torch.randn(1, 192, generator=g)
    steps = torch.randint(0, SPEECH, (6,), generator=g).tolist()

    x = _official_embeds(theirs, text, prompt_text, prompt_speech, emb)
    n = x.shape[1]
    att, cnn = torch.zeros(0, 0, 0, 0), torch.zeros(0, 0, 0, 0)
    mask = torch.tril(torch.ones(1, n, n)).bool()
    y, att, cnn = theirs.llm.forward_chunk(x, 0, -1, att, cnn, mask)
    ref = [theirs.llm_decoder(y[:, -1]).log_softmax(-1)[0]]
    for i, tok in enumerate(steps):
        xi = theirs.speech_embedding.weight[tok].view(1, 1, -1)
        y, att, cnn = theirs.llm.forward_chunk(xi, n + i, -1, att, cnn, torch.ones(1, 1, 1).bool())
        ref.append(theirs.llm_decoder(y[:, -1]).log_softmax(-1)[0])
    assert att.shape[2] == n + len(steps)  # the official cache holds every position

    embeds = ours.prompt_embeddings(text, prompt_text, prompt_speech, emb)
    got = [ours.prefill(embeds, max_len=n + len(steps))]
    got += [ours.decode_step(tok, n + i) for i, tok in enumerate(steps)]
    for i, (a, b) in enumerate(zip(got, ref)):
        assert rel_err(a, b) <= LOGP_RTOL, f"step {i}: rel err {rel_err(a, b):.2e}"

    # KV-cache decode == one causal pass over the whole sequence
    full = ours.forward_full(torch.cat([embeds, ours.speech_embedding.weight[steps].unsqueeze(0)], 1))[0, n - 1 :]
    for i, a in enumerate(got):
        assert rel_err(a, full[i]) <= LOGP_RTOL, f"kv vs full at step {i}: {rel_err(a, full[i]):.2e}"


def _official_tokens(theirs, text, prompt_text, prompt_speech, emb, seed: int, **kw) -> list[int]:
    torch.manual_seed(seed)
    lens = [torch.tensor([t.shape[1]], dtype=torch.int32) for t in (text, prompt_text, prompt_speech)]
    out = theirs.inference(text, lens[0], prompt_text, lens[1], prompt_speech, lens[2], emb, **kw)
    return [int(t) for t in out]


def _our_tokens(ours, text, prompt_text, prompt_speech, emb, seed: int) -> list[int]:
    torch.manual_seed(seed)  # ours draws through torch.multinomial on the global RNG, as the official code
    return list(ours.inference(text, prompt_text, prompt_speech, emb, sampling=SamplingConfig.token2wav_0_1_0()))


@pytest.mark.parametrize(("seed", "with_spk"), [(3, True), (11, True), (5, False)])
def test_whole_decode_identical_tokens(pair, tokenizer, seed: int, with_spk: bool):
    """Same weights, same draws -> the same speech tokens, EOS at the same step (or both reach max_len)."""
    theirs, ours = pair
    g = torch.Generator().manual_seed(seed)
    text = _ids(tokenizer, "Stop.")
    prompt_text = _ids(tokenizer, "Hi.")
    prompt_speech = torch.randint(0, SPEECH, (1, 5), generator=g, dtype=torch.int32)
    emb = torch.randn(1, 192, generator=g) if with_spk else torch.zeros(0, 192)
    ref = _official_tokens(theirs, text, prompt_text, prompt_speech, emb, seed)
    got = _our_tokens(ours, text, prompt_text, prompt_speech, emb, seed)
    assert got == ref
    n = text.shape[1]
    assert 2 * n <= len(got) <= 20 * n


def test_eos_ends_decoding_and_never_comes_first(pair, tokenizer):
    """A likely EOS stops both codes at the same step; with min_token_text_ratio 0 and an overwhelming EOS the
    official loop still emits one token (it masks EOS at step 0, llm.py ``if i == 0``), and so do we."""
    theirs, ours = pair
    text = _ids(tokenizer, "Go now.")
    empty = torch.zeros(1, 0, dtype=torch.int32)
    emb = torch.randn(1, 192, generator=torch.Generator().manual_seed(4))

    def both(lift: float, min_ratio: float) -> tuple[list[int], list[int]]:
        with torch.no_grad():
            theirs.llm_decoder.bias[SPEECH] += lift
            ours.llm_decoder.bias[SPEECH] += lift
        saved = ours.cfg.min_token_text_ratio
        ours.cfg.min_token_text_ratio = min_ratio
        try:
            ref = _official_tokens(theirs, text, empty, empty, emb, 7, min_token_text_ratio=min_ratio)
            got = _our_tokens(ours, text, empty, empty, emb, 7)
        finally:
            ours.cfg.min_token_text_ratio = saved
            with torch.no_grad():
                theirs.llm_decoder.bias[SPEECH] -= lift
                ours.llm_decoder.bias[SPEECH] -= lift
        return ref, got

    ref, got = both(200.0, 0.0)
    assert ref == got and len(got) == 1
    n = text.shape[1]
    for lift in (8.0, 12.0, 16.0):  # an EOS likely enough to end decoding early, but not at min_len exactly
        ref, got = both(lift, 2.0)
        assert ref == got
        if 2 * n < len(got) < 20 * n:
            break
    else:
        pytest.fail(f"no EOS lift stopped decoding between min and max length (last: {len(got)} tokens)")
