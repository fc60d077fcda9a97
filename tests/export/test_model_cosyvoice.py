"""CosyVoice-300M (v1) end to end: export of the tiny fixture, the torch-free engine against the PyTorch reference
with the same draws, built-in (SFT) speakers, zero-shot / cross-lingual / instruct modes, streaming, the CLI and
the server.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosyvoice_cpu.backends.row_groups import RowGroupSession
from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.lm.sampling import RngDraw
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.reference.checkpoint import load_speakers
from cosyvoice_cpu.reference.hift.source import SourceNoise as TorchNoise
from cosyvoice_cpu.vocoder.source import SourceNoise
from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
from cosyvoice_cpu.workshop.parts import load_reference

WAVE_RTOL = 1e-3  # the v2 engine parity bound; measured here: see the printed values
TEXT = "你好，今天天气很好。Hello there, how are you today?"
SPEAKER = "中文女"  # one of the fixture's spk2info.pt speakers (the released -SFT ids)


def _prompt_wav(path: Path, seconds: float = 3.0) -> Path:
    t = np.arange(int(16000 * seconds)) / 16000
    sf.write(path, (0.3 * np.sin(2 * np.pi * 190 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32),
             16000)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def v1_int8w(tiny_v1_export_dir: Path) -> Path:
    return tiny_v1_export_dir  # the default recipe is int8w


@pytest.fixture(scope="module")
def fp32_engine(tiny_v1_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    out = tmp_path_factory.mktemp("v1") / "fp32"
    export_model(tiny_v1_model_dir, out, ExportOptions(recipe="fp32", verify=False, max_len=1024))
    return Engine.load(out)


def test_export_writes_a_v1_model_directory(v1_int8w: Path, tiny_v1_model_dir: Path) -> None:
    m = Manifest.load(v1_int8w, check_hashes=True)
    assert (m.family, m.sample_rate, m.token_frame_rate) == ("cosyvoice", 22050, 50)
    assert m.text["kind"] == "whisper" and m.lm["stop_ids"] == [4096]
    assert {"lm", "lm_text_encoder", "flow_encoder", "flow_estimator", "hift_decode"} <= set(m.graphs)
    assert m.graphs["lm"].precision == "int8w" and m.graphs["flow_estimator"].precision == "int8"
    phases = {g["phase"] for g in m.verification}
    assert all(g["passed"] for g in m.verification)
    assert {"fp32", "int8, flow_encoder int8w"} < phases  # and the LM's int8w phase
    assert m.graphs["flow_encoder"].precision == "int8w"
    # the built-in speakers, exactly the x-vectors of spk2info.pt, listed (and hashed) in the manifest
    speakers = load_speakers(tiny_v1_model_dir)
    assert {k for k in m.files if k.startswith("voice:")} == {f"voice:{n}" for n in speakers}
    engine = Engine.load(v1_int8w)
    builtin = engine.builtin_voices()
    assert set(builtin) == set(speakers)
    assert np.array_equal(builtin[SPEAKER].embedding, speakers[SPEAKER].numpy().reshape(-1))
    assert builtin[SPEAKER].builtin and builtin[SPEAKER].prompt_text == ""
    # what a server asks of the engine (the audio bound counts 50 Hz tokens; the instruction-room message)
    assert engine.token_rate == 50.0 and engine.kv_cache_positions == m.graphs["lm"].attrs["max_len"]


@pytest.mark.parametrize(("mode", "seed"), [("sft", 3), ("zero-shot", 11), ("cross-lingual", 5)])
def test_engine_equals_reference_with_the_same_draws(
    fp32_engine: Engine, tiny_v1_model_dir: Path, tmp_path: Path, mode: str, seed: int
) -> None:
    """Same text ids, same LM draws, same flow noise and source noise: identical tokens, equal waves."""
    engine = fp32_engine
    if mode == "sft":
        voice = engine.builtin_voices()[SPEAKER]
    else:
        voice = engine.make_voice(_prompt_wav(tmp_path / "p.wav"), "今天天气很好" if mode == "zero-shot" else "", "p")
    ours = engine.synthesize_wav(TEXT, voice, SynthesisConfig(seed=seed, normalize=False))

    ref = load_reference(tiny_v1_model_dir)
    ids = engine.tokenizer.encode(TEXT)
    lm_rng, rng = SynthesisConfig(seed=seed).rngs()  # the LM's draws; flow noise then source noise
    draw = RngDraw(lm_rng)
    zero_shot = mode == "zero-shot"
    prompt_ids = engine.tokenizer.encode(voice.prompt_text) if zero_shot else []
    prompt_tokens = torch.as_tensor(voice.speech_tokens, dtype=torch.long)[None]
    emb = torch.from_numpy(voice.embedding)[None]
    with torch.inference_mode():
        tokens = list(ref.lm.inference(torch.tensor([ids]), torch.tensor([prompt_ids], dtype=torch.long).view(1, -1),
                                       prompt_tokens if zero_shot else prompt_tokens[:, :0], emb,
                                       draw=lambda p: draw(p.numpy())))  # fmt: skip
        c = ref.flow.encode(torch.tensor([tokens]), torch.tensor([len(tokens)]), prompt_tokens,
                            torch.tensor([prompt_tokens.shape[1]]), torch.from_numpy(voice.mel)[None], emb)  # fmt: skip
        noise = torch.from_numpy(rng.standard_normal(tuple(c.mu.shape), dtype=np.float32))
        mel, _ = ref.flow.inference(torch.tensor([tokens]), torch.tensor([len(tokens)]), prompt_tokens,
                                    torch.tensor([prompt_tokens.shape[1]]), torch.from_numpy(voice.mel)[None], None,
                                    emb, noise=noise)  # fmt: skip
        length = mel.shape[2] * ref.hift.cfg.upsample
        source = SourceNoise.draw(rng, 1, length, ref.hift.m_source.harmonics)
        wave, _ = ref.hift.inference(mel, noise=TorchNoise(torch.from_numpy(source.initial_phase),
                                                           torch.from_numpy(source.sine_noise)))  # fmt: skip
    assert len(tokens) >= 2 * len(ids)  # min_token_text_ratio 2
    assert len(ours) == wave.shape[1] == int(len(tokens) / 50 * 22050 / 256) * 256
    err = rel_err(ours, wave[0].numpy())
    print(f"v1 engine vs reference ({mode}): {len(tokens)} tokens, wave rel err {err:.2e}")
    assert err < WAVE_RTOL


def test_modes_streaming_and_bad_input(v1_int8w: Path, tmp_path: Path) -> None:
    engine = Engine.load(v1_int8w, EngineConfig(threads=2))  # 2 threads: the CFG rows split
    sft = engine.builtin_voices()[SPEAKER]
    config = SynthesisConfig(seed=2, min_tokens=150, max_tokens=150)  # forced length: random weights
    whole = engine.synthesize_wav("Hello there.", sft, config)
    assert len(whole) == int(150 / 50 * 22050 / 256) * 256 and np.isfinite(whole).all() and np.abs(whole).max() > 0
    # the estimator's CFG rows as two one-thread calls on 2 threads (every window below too): the one call's audio
    # up to each row's own int8 activation scale
    assert isinstance(engine.flow.estimator, RowGroupSession)
    one_call = Engine.load(v1_int8w, EngineConfig(threads=2, split_rows=False))
    one = one_call.synthesize_wav("Hello there.", sft, config)
    one_call.close()
    err = rel_err(whole, one)
    print(f"v1 rows split against one call: wave rel err {err:.2e}")
    assert 0 < err < 5e-3
    # instruct: the LM sees the instruction, not the speaker (official frontend_instruct drops llm_embedding)
    ids, speech, speaker = engine.lm_prompt(sft, "A calm voice.")
    assert ids == engine.tokenizer.encode("A calm voice.<endofprompt>") and len(speech) == 0 and speaker is None
    assert engine.lm_prompt(sft, None)[2] is sft.embedding  # SFT: the x-vector conditions the LM too
    instructed = engine.synthesize_wav("Hello there.", sft, config, instruct="A calm voice.")
    assert len(instructed) == len(whole) and not np.array_equal(instructed, whole)
    # streaming: the official overlapping windows; first window after 41 tokens, then hops doubling
    chunks = list(engine.synthesize("Hello there.", sft, SynthesisConfig(seed=2, min_tokens=150, max_tokens=150,
                                                                         stream=True)))  # fmt: skip
    streamed = np.concatenate([c.samples for c in chunks])
    assert len(chunks) >= 3 and chunks[-1].final and np.isfinite(streamed).all()
    assert len(chunks[0].samples) < len(streamed) / 3  # the first chunk is early, not the whole sentence
    assert abs(len(streamed) - len(whole)) <= 4 * 256  # windows are stretched one by one: a few frames differ
    # a zero-shot voice at 22.05 kHz keeps all its prompt mel frames (no 2-per-token trim as in CosyVoice2)
    voice = engine.make_voice(_prompt_wav(tmp_path / "p.wav", 4.0), "今天天气很好", "p")
    assert voice.family == "cosyvoice" and voice.sample_rate == 22050
    assert abs(voice.mel.shape[0] - 4 * 22050 / 256) <= 2 and abs(voice.duration - 4.0) < 0.03
    with pytest.raises(ConfigError, match="has no speech tokens"):
        voice.__class__("x", "some text", np.zeros(0, np.int32), np.zeros((0, 80), np.float32), sft.embedding,
                        family="cosyvoice", sample_rate=22050)  # fmt: skip


def test_say_with_a_builtin_speaker_and_serve_it(v1_int8w: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    r = subprocess.run([sys.executable, "-m", "cosyvoice_cpu", "say", "-m", str(v1_int8w), "--voice", SPEAKER,
                        "--voices", str(tmp_path / "none"), "--seed", "1", "-o", str(out), TEXT],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    wave, sr = sf.read(out)
    assert sr == 22050 and len(wave) > 22050
    r = subprocess.run([sys.executable, "-m", "cosyvoice_cpu", "say", "-m", str(v1_int8w), "--voice", "nobody",
                        "--voices", str(tmp_path / "none"), "hi"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0 and "built-in speakers of this model: 中文女, 英文男" in r.stderr

    from tests.server.conftest import start_server

    server = start_server(tmp_path / "voices", tmp_path / "server.log", model=v1_int8w)
    try:
        with server.client() as c:
            voices = {v["name"]: v for v in c.get("/v1/audio/voices").json()["voices"]}
            assert voices[SPEAKER]["mode"] == "built-in"
            body = {"model": "tts-1", "input": "你好。", "voice": SPEAKER, "response_format": "wav", "seed": 1}
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == 200, r.text
            assert sf.info(io.BytesIO(r.content)).samplerate == 22050
            r = c.delete(f"/v1/audio/voices/{SPEAKER}")
            assert r.status_code == 409 and "built-in" in r.json()["error"]["message"]
            assert c.get("/health").json()["status"] == "ok"
    finally:
        server.stop()


def test_base_variant_has_no_builtin_speakers(tmp_path: Path) -> None:
    """`fixture --variant base` mimics the base CosyVoice-300M download: no spk2info.pt, so no built-in voices."""
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    src = write_fixture(FixtureSpec("cosyvoice", "tiny", 0, "base"), tmp_path / "base")
    assert not (src / "spk2info.pt").exists()
    out = tmp_path / "out"
    m = export_model(src, out, ExportOptions(recipe="fp32", verify=False, max_len=512))
    assert not [k for k in m.files if k.startswith("voice:")] and not (out / "voices").exists()
    assert Engine.load(out).builtin_voices() == {}
    with pytest.raises(ConfigError, match="variants are CosyVoice-300M downloads"):
        FixtureSpec("cosyvoice2", "tiny", 0, "base").validate()
