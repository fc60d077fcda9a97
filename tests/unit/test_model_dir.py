"""Model directories: family detection from content, strict loading, and precise errors for broken input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cosyvoice_cpu.errors import ModelDirError


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_reads_config_and_loads_strictly(tiny_model_dir: Path) -> None:
    from cosyvoice_cpu.workshop.parts import load_reference

    m = load_reference(tiny_model_dir)
    cfg = m.config
    assert (cfg.family, cfg.sample_rate, cfg.token_frame_rate, cfg.token_mel_ratio) == ("cosyvoice2", 24000, 25, 2)
    assert (cfg.mel.n_fft, cfg.mel.hop_size, cfg.mel.fmax) == (1920, 480, 8000.0)
    assert cfg.lm.stop_ids == (6561, 6562, 6563)
    assert cfg.lm.sampling.top_k == 25 and cfg.lm.sampling.top_p == 0.8
    assert cfg.flow.estimator.static_chunk_size == 50 and cfg.flow.encoder.static_chunk_size == 25
    assert cfg.hift.upsample_rates == [8, 5, 3]


def test_family_is_told_by_content_not_file_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Older CosyVoice2 downloads ship their yaml as cosyvoice.yaml."""
    from cosyvoice_cpu.workshop.parts import read_model_config

    d = _copy(tiny_model_dir, tmp_path / "old")
    (d / "cosyvoice2.yaml").rename(d / "cosyvoice.yaml")
    assert read_model_config(d).family == "cosyvoice2"


def test_v3_is_recognised_and_refused_clearly(tiny_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.workshop.parts import detect_family, read_model_config

    d = _copy(tiny_model_dir, tmp_path / "cosyvoice3")
    text = (d / "cosyvoice2.yaml").read_text().replace("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.CosyVoice3LM")
    (d / "cosyvoice2.yaml").write_text(text)
    assert detect_family(d) == "cosyvoice3"
    with pytest.raises(ModelDirError, match="is a cosyvoice3 model"):
        read_model_config(d)


def test_a_v1_lm_entry_in_a_v2_yaml_is_a_precise_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    """v1 is supported now: a TransformerLM tag over Qwen2LM arguments fails on the missing v1 fields."""
    from cosyvoice_cpu.workshop.parts import detect_family, read_model_config

    d = _copy(tiny_model_dir, tmp_path / "mixed")
    text = (d / "cosyvoice2.yaml").read_text().replace("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.TransformerLM")
    (d / "cosyvoice2.yaml").write_text(text)
    assert detect_family(d) == "cosyvoice"
    with pytest.raises(ModelDirError, match="TransformerLM needs a 'text_encoder' entry"):
        read_model_config(d)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: shutil.rmtree(d), "does not exist"),
        (lambda d: (d / "cosyvoice2.yaml").unlink(), "holds none of"),
        (lambda d: (d / "cosyvoice2.yaml").write_text("llm: [unclosed"), "not valid YAML"),
        (lambda d: (d / "cosyvoice2.yaml").write_text("sample_rate: 24000\n"), "no 'llm: !new:...' entry"),
        (lambda d: (d / "CosyVoice-BlankEN" / "config.json").unlink(), "config.json not found"),
        (lambda d: (d / "llm.pt").unlink(), "llm.pt is missing"),
        (lambda d: (d / "flow.pt").write_bytes(b"\x80\x02garbage"), "not a readable PyTorch checkpoint"),
        (lambda d: shutil.copy(d / "flow.pt", d / "llm.pt"), "does not match the architecture"),
    ],
)
def test_broken_directories_get_precise_errors(tiny_model_dir: Path, tmp_path: Path, breakage, message) -> None:
    from cosyvoice_cpu.workshop.parts import load_reference

    d = _copy(tiny_model_dir, tmp_path / "broken")
    breakage(d)
    with pytest.raises(ModelDirError, match=message):
        load_reference(d)


def test_hift_checkpoint_mismatch_is_a_model_dir_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch

    from cosyvoice_cpu.workshop.parts import load_reference

    d = _copy(tiny_model_dir, tmp_path / "hift")
    state = torch.load(d / "hift.pt", weights_only=True)
    state.pop("conv_post.bias")
    torch.save(state, d / "hift.pt")
    with pytest.raises(ModelDirError, match=r"conv_post\.bias"):
        load_reference(d, stages=("hift",))


def test_one_loader_per_family_with_the_released_mel_defaults() -> None:
    """Every family of the facts table has parts; a yaml without ``feat_extractor`` gets the family's released
    values."""
    from cosyvoice_cpu.facts import FAMILIES, facts
    from cosyvoice_cpu.reference.model_dir import MelConfig
    from cosyvoice_cpu.workshop.parts import PARTS

    assert tuple(PARTS) == FAMILIES and all(PARTS[name].facts.name == name for name in FAMILIES)
    released = {"cosyvoice": (1024, 22050, 256, 1024, 8000.0), "cosyvoice2": (1920, 24000, 480, 1920, 8000.0),
                "cosyvoice3": (1920, 24000, 480, 1920, None)}  # fmt: skip
    for name in FAMILIES:
        f = facts(name)
        mel = MelConfig.from_yaml(
            None, MelConfig(sampling_rate=f.sample_rate, hop_size=f.mel_hop, **PARTS[name].loader.mel)
        )
        assert (mel.n_fft, mel.sampling_rate, mel.hop_size, mel.win_size, mel.fmax) == released[name]
        assert (mel.num_mels, mel.fmin) == (80, 0.0)
