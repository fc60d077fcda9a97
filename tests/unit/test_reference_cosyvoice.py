"""CosyVoice-300M (v1) without the official code: the fixture, reading its directory, configs, speakers, errors.

Parity with the official implementation is in tests/parity/test_{lm,flow}_v1_parity.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cosyvoice_cpu.errors import ConfigError, ModelDirError


def test_fixture_loads_strictly_with_v1_config(tiny_v1_model_dir: Path) -> None:
    from cosyvoice_cpu.workshop.parts import load_reference

    names = sorted(p.name for p in tiny_v1_model_dir.iterdir())
    assert names == ["campplus.onnx", "cosyvoice.yaml", "flow.pt", "hift.pt", "llm.pt", "multilingual.tiktoken",
                     "speech_tokenizer_v1.onnx", "spk2info.pt"]  # fmt: skip
    m = load_reference(tiny_v1_model_dir)
    cfg = m.config
    assert (cfg.family, cfg.sample_rate, cfg.token_frame_rate, cfg.token_mel_ratio) == ("cosyvoice", 22050, 50, 0)
    assert (cfg.mel.n_fft, cfg.mel.hop_size, cfg.mel.sampling_rate, cfg.mel.fmax) == (1024, 256, 22050, 8000.0)
    assert cfg.speech_tokenizer_path.name == "speech_tokenizer_v1.onnx"
    assert cfg.lm.stop_ids == (4096,) and cfg.lm.text_token_size == 51866
    assert cfg.lm.text_encoder.chunk_size == 1 and cfg.flow.encoder.chunk_size == 0  # causal text, full flow
    assert cfg.hift.upsample_rates == [8, 8] and cfg.hift.upsample == 256 and cfg.hift.sine_type == "v1"
    assert type(m.lm).__name__ == "TransformerLM" and type(m.flow).__name__ == "FlowV1"


def test_full_size_yaml_gives_the_released_shapes(tmp_path: Path) -> None:
    """The full-size fixture yaml reads back as the released configuration; parameter counts as documented
    (310.7 M LM, 104.9 M flow of which 81.9 M estimator), built on the meta device (no memory)."""
    from cosyvoice_cpu.fixtures.yaml.cosyvoice import V1Sizes, render_cosyvoice_yaml
    from cosyvoice_cpu.reference.flow.cosyvoice import FlowV1, FlowV1Config
    from cosyvoice_cpu.reference.lm.cosyvoice import TransformerLM, TransformerLMConfig
    from cosyvoice_cpu.workshop.parts import read_model_config

    (tmp_path / "cosyvoice.yaml").write_text(render_cosyvoice_yaml(V1Sizes()))
    cfg = read_model_config(tmp_path)
    assert cfg.lm == TransformerLMConfig()
    assert cfg.flow == FlowV1Config()
    assert cfg.hift.base_channels == 512 and cfg.hift.source_resblock_kernel_sizes == [7, 11]
    with torch.device("meta"):
        lm, flow = TransformerLM(cfg.lm), FlowV1(cfg.flow)

    def count(m: torch.nn.Module) -> float:
        return round(sum(p.numel() for p in m.parameters()) / 1e6, 1)

    assert (count(lm), count(flow), count(flow.decoder.estimator)) == (310.7, 104.9, 81.9)


def test_speakers(tiny_v1_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.reference.checkpoint import load_speakers

    speakers = load_speakers(tiny_v1_model_dir)
    assert sorted(speakers) == sorted(["中文女", "英文男"])
    assert all(v.shape == (1, 192) and v.dtype == torch.float32 for v in speakers.values())
    assert load_speakers(tmp_path) == {}  # base models ship no spk2info.pt
    torch.save({"x": {"embedding": torch.zeros(3)}}, tmp_path / "spk2info.pt")
    with pytest.raises(ModelDirError, match="speaker 'x' has no 192-d 'embedding'"):
        load_speakers(tmp_path)
    (tmp_path / "spk2info.pt").write_bytes(b"garbage")
    with pytest.raises(ModelDirError, match="not a readable PyTorch file"):
        load_speakers(tmp_path)


def test_lm_decodes_within_length_bounds_deterministically(tiny_v1_model_dir: Path) -> None:
    from cosyvoice_cpu.reference.sampling import torch_draw
    from cosyvoice_cpu.workshop.parts import load_reference

    lm = load_reference(tiny_v1_model_dir, ("lm",)).lm
    text = torch.tensor([[50258, 400, 1000, 12]])
    empty = torch.zeros(1, 0, dtype=torch.long)
    emb = torch.randn(1, 192, generator=torch.Generator().manual_seed(0))
    runs = [list(lm.inference(text, empty, empty, emb, draw=torch_draw(torch.Generator().manual_seed(3))))
            for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1]
    assert 8 <= len(runs[0]) <= 80 and all(0 <= t < 4096 for t in runs[0])
    with pytest.raises(ConfigError, match="KV cache holds 3 positions"):
        lm.prefill(lm.prompt_embeddings(text, empty, empty, emb), max_len=3)


def test_flow_noise_and_cache_contract(tiny_v1_model_dir: Path) -> None:
    from cosyvoice_cpu.workshop.parts import load_reference

    flow = load_reference(tiny_v1_model_dir, ("flow",)).flow
    g = torch.Generator().manual_seed(1)
    tok, pt = torch.randint(0, 4096, (1, 20), generator=g), torch.randint(0, 4096, (1, 6), generator=g)
    pf, emb = torch.randn(1, 10, 80, generator=g), torch.randn(1, 192, generator=g)
    args = (tok, torch.tensor([20]), pt, torch.tensor([6]), pf, None, emb)
    noise = torch.randn(1, 80, 10 + 34, generator=g)
    a, cache = flow.inference(*args, n_timesteps=2, noise=noise)
    b, _ = flow.inference(*args, n_timesteps=2, noise=noise)
    assert a.shape == (1, 80, 34) and torch.equal(a, b)  # int(20 / 50 * 22050 / 256) = 34 frames
    assert cache.shape == (1, 80, 10 + 34, 2) and torch.equal(cache[..., 0], noise)
    with pytest.raises(ValueError, match="noise must be"):
        flow.inference(*args, noise=torch.randn(1, 80, 5))
    with pytest.raises(ValueError, match="flow_cache must be"):
        flow.inference(*args, flow_cache=torch.zeros(1, 80, 3))


def test_yaml_choices_we_do_not_implement_are_refused(tiny_v1_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.workshop.parts import read_model_config

    original = (tiny_v1_model_dir / "cosyvoice.yaml").read_text()
    for old, new, message in [
        ("        use_cnn_module: False\n        macaron_style: False\n        use_dynamic_chunk",
         "        use_cnn_module: True\n        macaron_style: False\n        use_dynamic_chunk",
         r"llm\.text_encoder\.use_cnn_module = True is not supported"),
        ("        use_dynamic_chunk: False", "        use_dynamic_chunk: True", None),  # decoding chunk 1: fine
        ("    output_type: 'mel'\n", "    output_type: 'linear'\n", "output_type 'linear' is not supported"),
        ("channels: [64, 64]", "channels: [64, 32]", r"estimator\.channels must all be equal"),
        ("ConditionalCFM\n", "CausalConditionalCFM\n", "flow.decoder is CausalConditionalCFM"),
    ]:  # fmt: skip
        assert old in original, old
        (tmp_path / "cosyvoice.yaml").write_text(original.replace(old, new, 1))
        if message is None:
            assert read_model_config(tmp_path).lm.text_encoder.chunk_size == 1
            continue
        with pytest.raises(ModelDirError, match=message):
            read_model_config(tmp_path)


def test_fixture_cli_determinism_and_family_sizes(tiny_v1_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.cli.main import main
    from cosyvoice_cpu.workshop import fixture_writer as fx

    assert main(["fixture", "--family", "cosyvoice", "--out", str(tmp_path / "again")]) == 0
    for name in ("llm.pt", "flow.pt", "hift.pt", "spk2info.pt"):
        a, b = (torch.load(d / name, weights_only=True) for d in (tiny_v1_model_dir, tmp_path / "again"))
        assert a.keys() == b.keys()
        assert all(torch.equal(x, y) for x, y in zip(a.values(), b.values()) if isinstance(x, torch.Tensor))
    assert (tiny_v1_model_dir / "cosyvoice.yaml").read_text() == (tmp_path / "again" / "cosyvoice.yaml").read_text()
    with pytest.raises(ConfigError, match="not made for cosyvoice"):
        fx.FixtureSpec("cosyvoice", "demo").validate()


def test_export_source_checks_and_text_pipeline_refusal(tiny_v1_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.workshop.exporter import ExportError, _export_tokenizer, check_source
    from cosyvoice_cpu.workshop.parts import read_model_config
    from cosyvoice_cpu.workshop.reference_pipeline import ReferencePipeline

    assert check_source(tiny_v1_model_dir).family == "cosyvoice"
    with pytest.raises(ModelDirError, match="pipeline supports cosyvoice2 only"):
        ReferencePipeline.load(tiny_v1_model_dir)
    d = shutil.copytree(tiny_v1_model_dir, tmp_path / "broken")
    (d / "speech_tokenizer_v1.onnx").unlink()
    with pytest.raises(ExportError, match=r"missing speech_tokenizer_v1\.onnx"):
        check_source(d)
    (d / "flow.pt").unlink()
    with pytest.raises(ModelDirError, match=r"flow\.pt is missing"):
        from cosyvoice_cpu.workshop.parts import load_reference

        load_reference(d)
    # a vocabulary larger than the LM's text table (e.g. the 25 Hz asset for a 300M model) is refused
    small = shutil.copytree(tiny_v1_model_dir, tmp_path / "small")
    yaml = small / "cosyvoice.yaml"
    yaml.write_text(yaml.read_text().replace("text_token_size: 51866", "text_token_size: 1000"))
    (tmp_path / "out").mkdir()
    with pytest.raises(ExportError, match="wrong vocabulary for this model"):
        _export_tokenizer(read_model_config(small), tmp_path / "out")


def test_standin_speech_tokenizer_v1_contract(tiny_v1_model_dir: Path) -> None:
    """Inputs (feats (1, 128, T) float, feats_length (1,) int32) by position -> indices (1, T // 2) int32 in
    [0, 4096): 50 tokens/s from 100 mel frames/s, the v1 code space."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tiny_v1_model_dir / "speech_tokenizer_v1.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["feats", "feats_length"]
    feats = np.random.default_rng(0).standard_normal((1, 128, 301)).astype(np.float32)
    ids = sess.run(None, {"feats": feats, "feats_length": np.array([301], dtype=np.int32)})[0]
    assert ids.shape == (1, 150) and ids.dtype == np.int32
    assert 0 <= ids.min() and ids.max() < 4096 and len(np.unique(ids)) > 50
