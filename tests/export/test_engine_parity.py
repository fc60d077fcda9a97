"""The torch-free Engine (fp32 export) against the PyTorch reference given the same random draws.

Same text ids, same prompt features, the same uniform stream for the LM's sampling and the same source noise for
the vocoder: the speech tokens must be identical and the waveform equal within the stages' stated tolerances
(flow 4e-7, HiFT chain 3e-5 measured; bound 1e-3).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.lm.sampling import RngDraw
from cosyvoice_cpu.reference.hift.source import SourceNoise as TorchNoise
from cosyvoice_cpu.reference.tokenizer import CosyVoice2Tokenizer
from cosyvoice_cpu.vocoder.source import SourceNoise
from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
from cosyvoice_cpu.workshop.parts import load_reference

WAVE_RTOL = 1e-3


@pytest.fixture(scope="module")
def fp32_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    out = tmp_path_factory.mktemp("parity") / "fp32"
    export_model(tiny_model_dir, out, ExportOptions(recipe="fp32", verify=False, max_len=512))
    return Engine.load(out)


@pytest.mark.parametrize(("prompt_text", "seed"), [("Good morning everyone.", 11), ("", 5)], ids=["zero-shot", "cross"])
def test_engine_equals_reference_with_the_same_draws(
    fp32_engine: Engine, tiny_model_dir: Path, tmp_path: Path, prompt_text: str, seed: int
) -> None:
    t = np.arange(16000 * 3) / 16000
    sf.write(tmp_path / "p.wav", (0.3 * np.sin(2 * np.pi * 190 * t)).astype(np.float32), 16000)
    voice = fp32_engine.make_voice(tmp_path / "p.wav", prompt_text, name="p")
    text = "Hello there, how are you"
    ours = fp32_engine.synthesize_wav(text, voice, SynthesisConfig(seed=seed, normalize=False))

    ref = load_reference(tiny_model_dir)
    tok = CosyVoice2Tokenizer(tiny_model_dir / "CosyVoice-BlankEN")
    lm_rng, vocoder_rng = SynthesisConfig(seed=seed).rngs()  # the engine's two streams: LM draws, source noise
    draw = RngDraw(lm_rng)
    prompt_tokens = torch.as_tensor(voice.speech_tokens, dtype=torch.long)[None]
    lm_prompt = prompt_tokens if prompt_text else prompt_tokens[:, :0]
    with torch.inference_mode():
        tokens = list(ref.lm.inference(torch.tensor([tok.encode(text)]),
                                       torch.tensor([tok.encode(prompt_text) if prompt_text else []]).view(1, -1),
                                       lm_prompt, draw=lambda p: draw(p.numpy())))  # fmt: skip
        tt = torch.tensor([tokens])
        mel, _ = ref.flow.inference(tt, torch.tensor([len(tokens)]), prompt_tokens,
                                    torch.tensor([prompt_tokens.shape[1]]), torch.from_numpy(voice.mel)[None], None,
                                    torch.from_numpy(voice.embedding)[None])  # fmt: skip
        length = mel.shape[2] * ref.hift.cfg.upsample
        noise = SourceNoise.draw(vocoder_rng, 1, length, ref.hift.m_source.harmonics)
        wave, _ = ref.hift.inference(mel, noise=TorchNoise(torch.from_numpy(noise.initial_phase),
                                                           torch.from_numpy(noise.sine_noise)))  # fmt: skip
    assert len(ours) == wave.shape[1] == len(tokens) * 2 * 480
    err = rel_err(ours, wave[0].numpy())
    print(f"engine vs reference: {len(tokens)} tokens, wave rel err {err:.2e}")
    assert err < WAVE_RTOL


def test_speed_resamples_the_mel_like_the_official_interpolate() -> None:
    import torch.nn.functional as F

    from cosyvoice_cpu.sentence import change_speed as _change_speed

    mel = np.random.default_rng(0).standard_normal((1, 80, 101)).astype(np.float32)
    for speed in (0.5, 0.7, 1.3, 2.0):
        ref = F.interpolate(torch.from_numpy(mel), size=int(101 / speed), mode="linear").numpy()
        ours = _change_speed(mel, speed)
        assert ours.shape == ref.shape and np.abs(ours - ref).max() < 1e-4
