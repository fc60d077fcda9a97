"""The torch-free Engine on an exported tiny model: voices, the three modes, determinism, and clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine, Timings
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.voices.voice import Voice, VoiceError


def _prompt_wav(path: Path, seconds: float = 3.0, sr: int = 44100) -> Path:
    """A voiced, vibrato tone with a little noise, stereo at 44.1 kHz (exercises mixing and resampling)."""
    rng = np.random.default_rng(0)
    t = np.arange(int(sr * seconds)) / sr
    tone = 0.3 * np.sin(2 * np.pi * 170 * t * (1 + 0.05 * np.sin(2 * np.pi * 3 * t)))
    wav = np.stack([tone, tone * 0.8], axis=1) + 0.01 * rng.standard_normal((t.size, 2))
    sf.write(path, wav.astype(np.float32), sr)
    return path


@pytest.fixture(scope="module")
def engine(tiny_export_dir: Path) -> Engine:
    return Engine.load(tiny_export_dir)


@pytest.fixture(scope="module")
def voice(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Voice:
    wav = _prompt_wav(tmp_path_factory.mktemp("prompt") / "alice.wav")
    return engine.make_voice(wav, "Good morning everyone.", name="alice")


def test_public_api_is_importable_lazily() -> None:
    import cosyvoice_cpu

    assert cosyvoice_cpu.Engine is Engine and cosyvoice_cpu.SynthesisConfig is SynthesisConfig
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        cosyvoice_cpu.Nope  # noqa: B018


def test_voice_from_prompt_audio(voice: Voice) -> None:
    assert voice.mel.shape == (2 * len(voice.speech_tokens), 80)  # trimmed to 2 mel frames per token
    assert 70 <= len(voice.speech_tokens) <= 75 and voice.embedding.shape == (192,)
    assert abs(voice.meta["duration_s"] - 3.0) < 0.01 and voice.prompt_text == "Good morning everyone."


def test_synthesis_is_deterministic_per_seed_and_reports_timings(engine: Engine, voice: Voice) -> None:
    timings = Timings()
    chunks = list(engine.synthesize("Hello world. How are you?", voice, SynthesisConfig(seed=3), timings=timings))
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert all(c.sample_rate == 24000 and c.samples.dtype == np.float32 for c in chunks)
    wave = np.concatenate([c.samples for c in chunks])
    assert np.isfinite(wave).all() and np.abs(wave).max() <= 0.99 + 1e-6
    assert len(wave) == timings.tokens * 2 * 480 and timings.first_audio is not None
    again = engine.synthesize_wav("Hello world. How are you?", voice, SynthesisConfig(seed=3))
    np.testing.assert_array_equal(wave, again)
    other = engine.synthesize_wav("Hello world. How are you?", voice, SynthesisConfig(seed=4))
    assert other.shape != wave.shape or not np.array_equal(other, wave)


def test_modes_and_saved_voices(engine: Engine, voice: Voice, tmp_path: Path) -> None:
    cfg = SynthesisConfig(seed=7, flow_steps=3)
    zero_shot = engine.synthesize_wav("Hi there.", voice, cfg)
    loaded = Voice.load(voice.save(tmp_path / "alice.npz"))
    np.testing.assert_array_equal(engine.synthesize_wav("Hi there.", loaded, cfg), zero_shot)
    cross = Voice(voice.name, "", voice.speech_tokens, voice.mel, voice.embedding)
    instruct = engine.synthesize_wav("Hi there.", voice, cfg, instruct="Speak slowly.")
    for wave in (engine.synthesize_wav("Hi there.", cross, cfg), instruct):
        assert wave.shape != zero_shot.shape or not np.array_equal(wave, zero_shot)  # the LM saw another prompt
    fast = engine.synthesize_wav("Hi there.", voice, cfg.with_(speed=2.0))
    assert abs(len(fast) - len(zero_shot) / 2) <= 480


def test_lm_prompt_per_mode(engine: Engine, voice: Voice) -> None:
    """What the LM sees: the official frontend's composition for each mode."""
    enc = engine.tokenizer.encode
    ids, speech, speaker = engine.lm_prompt(voice, "Speak slowly.")
    assert ids == enc("Speak slowly.<|endofprompt|>") and len(speech) == 0  # instruct: no prompt speech
    assert speaker is None
    assert engine.lm_prompt(voice, "Speak slowly.<|endofprompt|>")[0] == ids  # the marker is not doubled
    numbered = Voice("n", "I paid 5 dollars.", voice.speech_tokens, voice.mel, voice.embedding)
    ids, speech, speaker = engine.lm_prompt(numbered, None)
    assert speaker is None  # CosyVoice2's LM takes no x-vector
    assert ids == enc("I paid five dollars.") and np.array_equal(speech, voice.speech_tokens)  # normalized
    assert engine.lm_prompt(numbered, None, normalize=False)[0] == enc("I paid 5 dollars.")
    cross = Voice("c", "", voice.speech_tokens, voice.mel, voice.embedding)
    ids, speech, _ = engine.lm_prompt(cross, None)
    assert ids == [] and len(speech) == 0
    assert engine.sampling_for(SynthesisConfig(tau_r=0.0, top_k=5)).tau_r == 0.0  # 0 is an override, not "unset"


def test_chunks_stream_per_sentence_and_the_engine_is_shared_by_threads(engine: Engine, voice: Voice) -> None:
    from concurrent.futures import ThreadPoolExecutor

    text = " ".join(f"This is sentence number {w}, and it goes on for a while." for w in ("one", "two", "three"))
    cfg = SynthesisConfig(seed=1, flow_steps=1, cfg_rate=0.0)
    chunks = engine.synthesize(text, voice, cfg)
    first = next(chunks)
    assert not first.final and first.span[0] == 0  # yielded before the later sentences are synthesized
    rest = list(chunks)
    assert rest and rest[-1].final and rest[-1].span[1] == len(text)

    def say(seed: int) -> np.ndarray:
        return engine.synthesize_wav("Hello there.", voice, cfg.with_(seed=seed))

    serial = [say(s) for s in (1, 2, 3, 4)]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(say, (1, 2, 3, 4)))
    for a, b in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)


def test_bad_input_is_refused_clearly(engine: Engine, voice: Voice, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="text is empty"):
        engine.synthesize("   ", voice)
    with pytest.raises(ConfigError, match="nothing speakable"):
        engine.synthesize_wav("?!...", voice)
    with pytest.raises(ConfigError, match="instruct must be a non-empty instruction"):
        engine.synthesize("Hi.", voice, instruct=" ")
    with pytest.raises(ConfigError, match="voice must be a Voice"):
        engine.synthesize("Hi.", "alice")
    with pytest.raises(ConfigError, match="speed = 9"):
        engine.synthesize("Hi.", voice, SynthesisConfig(speed=9))
    foreign = Voice(
        "v1", "", voice.speech_tokens % 4096, voice.mel, voice.embedding, family="cosyvoice", sample_rate=22050
    )
    with pytest.raises(VoiceError, match="made for cosyvoice at 22050 Hz"):
        engine.synthesize("Hi.", foreign)
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(48000, np.float32), 16000)
    with pytest.raises(ConfigError, match="silent"):
        engine.make_voice(silent, "x")
    with pytest.raises(ConfigError, match=r"0\.50 s long; use at least 1 s"):
        engine.make_voice(_prompt_wav(tmp_path / "short.wav", seconds=0.5), "x")
    with pytest.raises(ConfigError, match=r"is 40\.0 s long; at most 30 s"):  # refused from the header
        engine.make_voice(_prompt_wav(tmp_path / "long.wav", seconds=40.0, sr=8000), "x")
    (tmp_path / "notaudio.wav").write_text("hello")
    with pytest.raises(ConfigError, match=r"notaudio\.wav"):
        engine.make_voice(tmp_path / "notaudio.wav", "x")


def test_engine_runs_with_torch_blocked(tiny_export_dir: Path, tmp_path: Path) -> None:
    wav = _prompt_wav(tmp_path / "p.wav")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from cosyvoice_cpu.engine import Engine; from cosyvoice_cpu.config import SynthesisConfig\n"
        f"e = Engine.load(r'{tiny_export_dir}')\n"
        f"v = e.make_voice(r'{wav}', 'Good morning.', name='p')\n"
        "w = e.synthesize_wav('Hello there.', v, SynthesisConfig(seed=1, flow_steps=2))\n"
        "print(len(w) > 0, 'onnx' in sys.modules)\n"  # the runtime never needs the onnx package either
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]


def test_broken_model_directories_fail_at_load_with_the_fix(tiny_export_dir: Path, tmp_path: Path) -> None:
    import shutil

    from cosyvoice_cpu.errors import ModelDirError

    d = tmp_path / "model"
    shutil.copytree(tiny_export_dir, d)
    (d / "flow_encoder.onnx").unlink()
    with pytest.raises(ModelDirError, match=r"flow_encoder\.onnx is missing.*Re-export"):
        Engine.load(d)
    shutil.copy(d / "hift_f0.onnx", d / "flow_encoder.onnx")  # a graph of the wrong stage, sizes patched below
    import json

    m = json.loads((d / "cosyvoice_cpu.json").read_text())
    m["graphs"]["flow_encoder"]["file"]["size"] = (d / "flow_encoder.onnx").stat().st_size
    (d / "cosyvoice_cpu.json").write_text(json.dumps(m))
    with pytest.raises(ModelDirError, match="does not have the expected graph contract"):
        Engine.load(d)
    with pytest.raises(ModelDirError, match="not a cosyvoice-cpu model directory"):
        Engine.load(tmp_path)


def test_one_flow_estimator_serves_both_modes(tiny_export_dir: Path) -> None:
    """The stream graph runs whole sentences too: a process that does both modes holds one estimator, and one
    loaded without streaming holds only the whole-sentence graph; the two give the same audio."""
    engine = Engine.load(tiny_export_dir, EngineConfig(threads=2))  # 2 threads: the rows split
    voice = engine.make_voice(_prompt_wav(tiny_export_dir.parent / "bob.wav"), "Hi there.", name="bob")
    assert engine.flow._sessions == {}  # nothing estimator-sized is in memory after load
    wav = engine.synthesize_wav("Hello.", voice, SynthesisConfig(seed=1))
    assert set(engine.flow._sessions) == {"stream"}
    # priority-based node order: the per-layer new_h gathers run early instead of holding every layer's input
    import onnxruntime as ort

    from cosyvoice_cpu.backends.row_groups import RowGroupSession

    stream = engine.flow.stream_estimator  # its CFG rows split on 2 threads (an OrtSession underneath)
    assert isinstance(stream, RowGroupSession)
    order = stream.wrapped.ort.get_session_options().execution_order
    assert order == ort.ExecutionOrder.PRIORITY_BASED
    engine.synthesize_wav("Hello.", voice, SynthesisConfig(seed=1, stream=True))
    assert set(engine.flow._sessions) == {"stream"}
    assert getattr(stream, "_whole", None) is None  # both modes split: no second copy of the graph opened
    whole_only = Engine.load(tiny_export_dir, EngineConfig(threads=2, streaming_estimator=False, split_rows=False))
    other = whole_only.synthesize_wav("Hello.", voice, SynthesisConfig(seed=1))
    assert set(whole_only.flow._sessions) == {"whole"}
    whole_split = Engine.load(tiny_export_dir, EngineConfig(threads=2, streaming_estimator=False))  # splits too
    assert isinstance(whole_split.flow.estimator, RowGroupSession)
    other_split = whole_split.synthesize_wav("Hello.", voice, SynthesisConfig(seed=1))
    # the stream graph as one call per step gives the whole-sentence graph's audio; the rows as two calls (the
    # default) move it by their own int8 activation scales only
    one_call = Engine.load(tiny_export_dir, EngineConfig(threads=2, split_rows=False))
    one = one_call.synthesize_wav("Hello.", voice, SynthesisConfig(seed=1))
    for e in (engine, whole_only, whole_split, one_call):
        e.close()
    pairs = (("whole", other), ("split", wav), ("whole split", other_split))
    rel = {k: np.abs(w - one).max() / np.abs(one).max() for k, w in pairs}
    print(f"against the stream graph's one call: {rel}")
    assert other.shape == wav.shape == other_split.shape == one.shape and rel["whole"] < 1e-4
    assert rel["split"] < 1e-3 and rel["whole split"] < 1e-3
    assert rel["whole split"] > 0  # int8: each row's call quantizes with its own scale


def test_long_vocoder_calls_run_in_windows_with_the_same_samples(engine: Engine, voice: Voice,
                                                                   tiny_export_dir: Path) -> None:  # fmt: skip
    """A sentence's HiFT call in windows of 20 frames (several windows here) gives the samples of one call;
    the export measured the context the windows need. Windows too thin for it do not (the test can fail)."""
    from cosyvoice_cpu.vocoder.windows import plan

    assert engine.vocoder.context is not None and min(engine.vocoder.context) >= 2
    text, cfg = "Hello world. How are you today?", SynthesisConfig(seed=5, flow_steps=2)
    whole = engine.synthesize_wav(text, voice, cfg)
    windowed = Engine.load(tiny_export_dir, EngineConfig(vocoder_window_frames=20))
    got = windowed.synthesize_wav(text, voice, cfg)
    assert len(plan(len(whole) // 480, 20, windowed.vocoder.context)) >= 3
    assert got.shape == whole.shape and np.abs(got - whole).max() <= 1e-5 * np.abs(whole).max()
    windowed.vocoder.context = (1, 1)
    thin = windowed.synthesize_wav(text, voice, cfg)
    assert np.abs(thin - whole).max() > 1e-3 * np.abs(whole).max()
    with pytest.raises(ConfigError, match="vocoder_window_frames"):
        EngineConfig(vocoder_window_frames=5).validate()
    with pytest.raises(ConfigError, match="arena_shrink_frames"):
        EngineConfig(arena_shrink_frames=-1).validate()
