"""The LM prefix cache: a prompt transcript's KV entries, prefilled once and reused by later requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.generate import LMFacts, SpeechTokenGenerator
from cosyvoice_cpu.lm.prefix import PrefixCache
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.manifest import Manifest

PROMPT_TEXT = [11, 12, 13, 14, 15, 16]
PROMPT_SPEECH = [1, 2, 3, 4, 5]
TEXT = [40, 41, 42]


@pytest.fixture(scope="module")
def gen() -> SpeechTokenGenerator:
    """The demo model's generator (the int8w recipe, weight-only 8-bit LM)."""
    m = Manifest.load(DEMO_MODEL)
    return SpeechTokenGenerator.from_manifest(LMSession.from_dir(DEMO_MODEL, m.graphs["lm"].attrs, threads=2), m)


def _logp_one_call(gen: SpeechTokenGenerator, text, prompt_text, prompt_speech) -> np.ndarray:
    s = gen.session
    return s.prefill(s.new_cache(1), 0, gen.prompt_embeddings(text, prompt_text, prompt_speech))


def test_a_prefix_is_prefilled_once_and_gives_the_bits_of_one_call(gen) -> None:
    gen.prefixes = PrefixCache(gen.session)
    whole = _logp_one_call(gen, TEXT, PROMPT_TEXT, PROMPT_SPEECH)
    first = gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=0)
    assert first.prefix == (np.array(PROMPT_TEXT, np.int64).tobytes(), 1 + len(PROMPT_TEXT))
    got_first = first.prefill()
    assert (gen.prefixes.hits, gen.prefixes.misses, len(gen.prefixes)) == (0, 1, 1)
    second = gen.request([7, 8], PROMPT_TEXT, PROMPT_SPEECH, seed=0)
    second.prefill()
    again = gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=0)
    got_again = again.prefill()
    assert (gen.prefixes.hits, gen.prefixes.misses) == (2, 1)
    # weight-only int8 computes each row's products alone, so the split is the one call, bit for bit
    np.testing.assert_array_equal(got_first, whole)
    np.testing.assert_array_equal(got_again, whole)
    np.testing.assert_array_equal(again.cache.keys[0][0, :, : len(first.embeds)],
                                  first.cache.keys[0][0, :, : len(first.embeds)])  # fmt: skip
    assert again.cache.lengths[0] == len(again.embeds)


def test_cached_and_computed_prefixes_give_the_same_tokens(gen) -> None:
    """A request's tokens never depend on whether its prefix was cached by an earlier request."""
    gen.prefixes = PrefixCache(gen.session)
    cold = list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5))
    warm = list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5))
    gen.prefixes = PrefixCache(gen.session, max_bytes=0)  # nothing kept: every request prefills its prefix
    uncached = list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5))
    assert cold == warm == uncached and len(cold) > 5
    assert len(gen.prefixes) == 0 and gen.prefixes.misses == 1


@pytest.fixture(scope="module")
def gen_int8(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SpeechTokenGenerator:
    """The tiny LM with the dynamic-int8 recipe: activations quantized per call, so a split call differs."""
    from cosyvoice_cpu.export.lm.cosyvoice2 import export_lm
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic
    from cosyvoice_cpu.workshop.parts import load_reference

    out = tmp_path_factory.mktemp("lm_prefix")
    (artifact,) = export_lm(load_reference(tiny_model_dir, stages=("lm",)).lm.eval(), out, max_len=128)
    quantize_int8_dynamic(out / artifact.file, out / "lm_int8.onnx", reduce_range=True)  # as workshop/export_stages.py
    session = LMSession.from_dir(out, artifact.attrs, graph_file="lm_int8.onnx", threads=2)
    return SpeechTokenGenerator(session, LMFacts.from_manifest(Manifest.load(DEMO_MODEL).lm))


def test_dynamic_int8_splits_even_an_uncached_prefix(gen_int8) -> None:
    """Where the split changes the bits, every request splits, so a request gives the same output cold or warm."""
    gen = gen_int8
    whole = _logp_one_call(gen, TEXT, PROMPT_TEXT, PROMPT_SPEECH)
    cold = gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=0).prefill()
    warm = gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=0).prefill()
    assert (gen.prefixes.hits, gen.prefixes.misses) == (1, 1)
    np.testing.assert_array_equal(cold, warm)
    assert not np.array_equal(cold, whole), "premise: per-call activation scales make the split differ"
    assert np.abs(cold - whole).max() < 0.1  # within the recipe's quantization noise
    assert list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=3)) == \
        list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=3))  # fmt: skip


def test_no_prompt_transcript_means_no_prefix(gen) -> None:
    gen.prefixes = PrefixCache(gen.session)
    req = gen.request(TEXT, [], PROMPT_SPEECH, seed=0)
    assert req.prefix is None
    np.testing.assert_array_equal(req.prefill(), _logp_one_call(gen, TEXT, [], PROMPT_SPEECH))
    assert len(gen.prefixes) == 0


def test_the_cache_keeps_the_most_recent_entries_within_its_bytes(gen) -> None:
    s = gen.session
    per_position = 2 * s.spec.num_layers * s.spec.kv_heads * s.spec.head_dim * 4
    prefixes = PrefixCache(s, max_bytes=10 * per_position)
    cache = s.new_cache(2)
    rng = np.random.default_rng(0)
    embeds = {k: rng.standard_normal((n, s.spec.hidden)).astype(np.float32) for k, n in
              ((b"a", 4), (b"b", 4), (b"c", 3), (b"big", 11))}  # fmt: skip
    for key in (b"a", b"b", b"a", b"c"):  # "b" is the least recently used when "c" does not fit
        prefixes.load(cache, 1, key, embeds[key])
    assert list(prefixes._entries) == [b"a", b"c"] and prefixes.nbytes == 7 * per_position
    assert cache.lengths[1] == 3 and cache.lengths[0] == 0
    prefixes.load(cache, 1, b"big", embeds[b"big"])  # larger than the whole cache: used, never kept
    assert list(prefixes._entries) == [b"a", b"c"] and cache.lengths[1] == 11
    with pytest.raises(ConfigError, match="cannot be negative"):
        PrefixCache(s, max_bytes=-1)


def test_rows_round_trip_and_wrong_shapes_are_refused(gen) -> None:
    s = gen.session
    cache = s.new_cache(3)
    s.prefill(cache, 2, np.random.default_rng(1).standard_normal((5, s.spec.hidden)).astype(np.float32))
    kv = cache.read(2, 5)
    assert kv.shape == (2, s.spec.num_layers, s.spec.kv_heads, 5, s.spec.head_dim) and np.abs(kv).max() > 0
    cache.write(0, kv)
    np.testing.assert_array_equal(cache.read(0, 5), kv)
    assert cache.lengths[0] == 5
    with pytest.raises(ConfigError, match="do not fit"):
        cache.write(1, kv[:, :1])
    with pytest.raises(ConfigError, match="out of range"):
        cache.write(3, kv)


@pytest.fixture(scope="module")
def gen_v1(tiny_v1_export_dir: Path) -> SpeechTokenGenerator:
    """The tiny CosyVoice-300M generator (int8w): a causal text encoder and a speaker row after sos."""
    from cosyvoice_cpu.lm.prompt import TextEncoder
    from cosyvoice_cpu.lm_files import TEXT_ENCODER_FILE

    m = Manifest.load(tiny_v1_export_dir)
    session = LMSession.from_dir(tiny_v1_export_dir, m.graphs["lm"].attrs, threads=2)
    encoder = TextEncoder(tiny_v1_export_dir / TEXT_ENCODER_FILE, (session.spec.text_dim, session.spec.hidden), 2)
    return SpeechTokenGenerator.from_manifest(session, m, encoder)


def test_v1_prefix_holds_the_speaker_row_and_is_keyed_by_the_x_vector(gen_v1) -> None:
    from cosyvoice_cpu.lm.prompt import assemble

    gen, rng = gen_v1, np.random.default_rng(0)
    alice, bob = rng.standard_normal((2, 192)).astype(np.float32)
    gen.prefixes = PrefixCache(gen.session)
    req = gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5, speaker=alice)
    assert req.prefix is not None and req.prefix[1] == 2 + len(PROMPT_TEXT)  # sos, speaker, transcript
    cold = list(req)
    warm = list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5, speaker=alice))
    assert cold == warm and len(cold) > 5 and (gen.prefixes.hits, gen.prefixes.misses) == (1, 1)
    list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5, speaker=bob))  # another voice: its own entry
    assert (gen.prefixes.hits, gen.prefixes.misses, len(gen.prefixes)) == (1, 2, 2)
    gen.prefixes = PrefixCache(gen.session, max_bytes=0)
    assert list(gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5, speaker=alice)) == cold
    assert gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, seed=5).prefix[1] == 1 + len(PROMPT_TEXT)  # no speaker row
    # the transcript's rows encoded on their own equal the whole encoding's (causal encoder) up to float rounding
    ids = np.array(PROMPT_TEXT + TEXT, np.int64)
    whole = assemble(gen.session, ids, np.array(PROMPT_SPEECH), gen.text_encoder, alice)
    split = gen.prompt_embeddings(TEXT, PROMPT_TEXT, PROMPT_SPEECH, alice)
    assert split.shape == whole.shape and np.abs(split - whole).max() <= 1e-5 * np.abs(whole).max()
