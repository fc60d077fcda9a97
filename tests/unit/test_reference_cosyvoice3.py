"""Fun-CosyVoice3 (v3) in the reference: the fixture, model-directory loading, the LM's v3 rules, the tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cosyvoice_cpu.errors import ConfigError, ModelDirError


@pytest.fixture(scope="module")
def v3_lm_dir(tmp_path_factory) -> Path:
    """The LM part of a tiny v3 fixture (yaml, BlankEN, llm.pt), seed 0."""
    from cosyvoice_cpu.fixtures.weights.cosyvoice3 import write_cosyvoice3_lm_files

    d = tmp_path_factory.mktemp("v3") / "tiny-v3-lm"
    write_cosyvoice3_lm_files(d, "tiny", 0)
    return d


@pytest.fixture(scope="module")
def lm(v3_lm_dir):
    from cosyvoice_cpu.workshop.parts import load_reference

    return load_reference(v3_lm_dir, stages=("lm",)).lm


def test_config_of_a_v3_directory(v3_lm_dir: Path) -> None:
    from cosyvoice_cpu.workshop.parts import read_model_config

    cfg = read_model_config(v3_lm_dir)
    assert (cfg.family, cfg.sample_rate, cfg.token_frame_rate, cfg.token_mel_ratio) == ("cosyvoice3", 24000, 25, 2)
    assert (cfg.mel.n_fft, cfg.mel.hop_size, cfg.mel.fmax) == (1920, 480, None)
    assert cfg.speech_tokenizer_path.name == "speech_tokenizer_v3.onnx"
    lm = cfg.lm
    assert (lm.sos_id, lm.eos_id, lm.task_id, lm.fill_id, lm.n_outputs) == (6561, 6562, 6563, 6564, 6761)
    assert lm.stop_ids == tuple(range(6561, 6761))
    assert lm.min_len_masked_id == 6561  # the official sampling_ids masks index speech_token_size (= sos in v3)
    assert (lm.endofprompt_id, lm.qwen.vocab_size) == (151646, 151936)


def test_llm_state_dict_is_the_released_layout(lm) -> None:
    sd = lm.state_dict()
    assert next(iter(sd)).startswith("llm.model.model.")
    assert list(sd)[-3:] == ["llm.model.lm_head.weight", "llm_decoder.weight", "speech_embedding.weight"]
    assert "llm_decoder.bias" not in sd and not any(k.startswith("llm_embedding") for k in sd)
    assert sd["llm_decoder.weight"].shape == (6761, 64) and sd["speech_embedding.weight"].shape == (6761, 64)
    assert sd["llm.model.lm_head.weight"].data_ptr() == sd["llm.model.model.embed_tokens.weight"].data_ptr()


def test_prompt_layout_uses_speech_embedding_rows(lm) -> None:
    text, prompt_text, speech = torch.tensor([[5, 151646]]), torch.tensor([[7]]), torch.tensor([[3, 4]])
    e = lm.prompt_embeddings(text, prompt_text, speech)
    w, emb = lm.speech_embedding.weight, lm.backbone.embed_tokens.weight
    want = torch.stack([w[6561], emb[7], emb[5], emb[151646], w[6563], w[3], w[4]])
    assert torch.equal(e[0], want)


def _decode_with_biased_row(lm, row: int) -> list[int]:
    """Decode with the logit of ``row`` lifted by 50 (a forward hook on the head, removed afterwards)."""
    from cosyvoice_cpu.reference.sampling import torch_draw

    text = torch.tensor([[151646, 10, 11, 12]])  # min_len 8
    empty = torch.zeros(1, 0, dtype=torch.long)
    lift = torch.zeros(lm.cfg.n_outputs)
    lift[row] = 50.0
    handle = lm.llm_decoder.register_forward_hook(lambda _m, _i, out: out + lift)
    try:
        return list(lm.inference(text, empty, empty, draw=torch_draw(torch.Generator().manual_seed(0))))
    finally:
        handle.remove()


def test_below_min_len_only_index_6561_is_masked(lm) -> None:
    """As upstream: a likely eos (6562) still stops at step 0; a likely 6561 is masked until min_len, then stops."""
    assert _decode_with_biased_row(lm, 6562) == []
    assert len(_decode_with_biased_row(lm, 6561)) == 8


def test_endofprompt_is_required(lm) -> None:
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"<\|endofprompt\|> \(id 151646\)"):
        next(lm.inference(torch.tensor([[1, 2, 3]]), empty, empty))
    # in the prompt text is as good as in the text
    assert isinstance(next(iter(lm.generate(torch.tensor([[1, 2]]), torch.tensor([[151646]]), empty)), None), (int,
                      type(None)))  # fmt: skip


def test_silent_runs_are_cut_after_five() -> None:
    from cosyvoice_cpu.reference.lm.cosyvoice3 import drop_long_silences

    seq = [1, 2, 28, 29, 55, 248, 494, 100, 2322, 2322, 9, 2323] + [2242] * 7
    assert drop_long_silences(seq) == [1, 2, 28, 29, 55, 100, 2322, 2322, 9, 2323] + [2242] * 4


def test_tokenizer_specials_sit_at_the_real_ids(v3_lm_dir: Path) -> None:
    from cosyvoice_cpu.reference.tokenizer import COSYVOICE3_SPECIALS, CosyVoice3Tokenizer

    tok = CosyVoice3Tokenizer(v3_lm_dir / "CosyVoice-BlankEN")
    assert len(COSYVOICE3_SPECIALS) == 280 and len(tok) == 151924
    ids = [tok.token_id(s) for s in COSYVOICE3_SPECIALS]
    assert ids == [151644, 151645, *range(151646, 151924)]
    assert tok.token_id("<|endoftext|>") == 151643
    assert tok.token_id("[HH]") == 151664 + 42  # 9 vowels x 4 ids + 6 consonants come before it
    assert tok.encode("[j][ǐ]<|endofprompt|>") == [tok.token_id("[j]"), tok.token_id("[ǐ]"), 151646]
    vocab = json.loads((v3_lm_dir / "CosyVoice-BlankEN" / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 151643


def test_a_yaml_mixing_families_is_a_precise_error(v3_lm_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.workshop.parts import read_model_config

    d = tmp_path / "mixed"
    shutil.copytree(v3_lm_dir, d)
    y = d / "cosyvoice3.yaml"
    y.write_text(y.read_text().replace("CausalHiFTGenerator", "HiFTGenerator"))
    with pytest.raises(ModelDirError, match=r"is a cosyvoice3 model .* 'hift' entry .*HiFTGenerator"):
        read_model_config(d)


def test_whole_tiny_fixture_writes_and_loads(tmp_path: Path) -> None:
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture
    from cosyvoice_cpu.workshop.parts import load_reference

    d = write_fixture(FixtureSpec("cosyvoice3", "tiny", 0), tmp_path / "v3")
    names = {p.name for p in d.iterdir()}
    assert {"cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx",
            "CosyVoice-BlankEN"} <= names  # fmt: skip
    hift = torch.load(d / "hift.pt", weights_only=True)
    assert any(k.endswith("parametrizations.weight.original0") for k in hift)
    m = load_reference(d)
    assert m.flow is not None and m.hift is not None and m.config.family == "cosyvoice3"
