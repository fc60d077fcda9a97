"""Fun-CosyVoice3 end to end: export of the tiny fixture, the torch-free engine against the PyTorch reference with
the same draws, the prompt rules around ``<|endofprompt|>``, the silent-token filter, and streaming.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import soundfile as sf
import torch

from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.lm.sampling import RngDraw
from cosyvoice_cpu.lm.silence import drop_long_silences
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.reference.hift.source import SourceNoise as TorchNoise
from cosyvoice_cpu.vocoder.source import SourceNoise
from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
from cosyvoice_cpu.workshop.parts import load_reference

SYSTEM_PROMPT_V3 = facts("cosyvoice3").system_prompt
WAVE_RTOL = 1e-3  # as the v1/v2 engine parity; measured here: see the printed values
TEXT = "Hello there, how are you today?"
MARK = "<|endofprompt|>"


@pytest.fixture(scope="module")
def v3_src(tiny_v3_model_dir: Path) -> Path:
    return tiny_v3_model_dir


@pytest.fixture(scope="module")
def v3_int8w(tiny_v3_export_dir: Path) -> Path:
    return tiny_v3_export_dir  # the default recipe is int8w


@pytest.fixture(scope="module")
def fp32_engine(v3_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    out = tmp_path_factory.mktemp("v3") / "fp32"
    export_model(v3_src, out, ExportOptions(recipe="fp32", verify=False, max_len=1024))
    return Engine.load(out)


def _prompt_wav(path: Path) -> Path:
    t = np.arange(16000 * 3) / 16000
    sf.write(path, (0.3 * np.sin(2 * np.pi * 190 * t)).astype(np.float32), 16000)
    return path


def test_export_writes_a_v3_model_directory(v3_int8w: Path) -> None:
    m = Manifest.load(v3_int8w, check_hashes=True)
    assert (m.family, m.sample_rate, m.token_frame_rate, m.token_mel_ratio) == ("cosyvoice3", 24000, 25, 2)
    assert m.mel["fmax"] is None  # v3's prompt mel goes up to Nyquist
    assert m.lm["stop_ids"] == list(range(6561, 6761)) and m.lm["eos_id"] == 6562
    assert (m.lm["min_len_masked_id"], m.lm["endofprompt_id"]) == (6561, 151646)
    assert m.text["special_ids"][MARK] == 151646 and m.flow["chunk_frames"] == 50
    graphs = {"lm", "flow_encoder", "flow_estimator", "flow_estimator_stream", "flow_time", "hift_f0", "hift_decode"}
    assert graphs <= set(m.graphs)
    assert m.graphs["lm"].precision == "int8w" and m.graphs["flow_estimator"].precision == "int8"
    assert m.graphs["flow_time"].precision == "int8"  # weight-only 8-bit: run once per Euler schedule
    ops = [n.op_type for n in onnx.load(v3_int8w / "flow_time.onnx", load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == m.graphs["flow_time"].attrs["depth"] + 1  # every AdaLN linear
    assert m.graphs["hift_decode"].attrs["sine_type"] == "v3" and m.graphs["hift_decode"].attrs["causal"]
    assert all(g["passed"] for g in m.verification) and m.graphs["flow_encoder"].precision == "int8w"
    assert {"fp32", "int8, flow_encoder int8w"} < {g["phase"] for g in m.verification}
    # the int8 stream DiT takes and returns its key/value caches in float16 (half the prompt cache's memory)
    stream = m.graphs["flow_estimator_stream"]
    kv = {s["name"]: s["dtype"] for s in (*stream.inputs, *stream.outputs) if s["name"].endswith(("_k", "_v"))}
    assert kv == dict.fromkeys(["prompt_k", "prompt_v", "context_k", "context_v", "new_k", "new_v"], "float16")


@pytest.mark.parametrize(("mode", "seed"), [("zero-shot", 11), ("cross-lingual", 5)])
def test_engine_equals_reference_with_the_same_draws(
    fp32_engine: Engine, v3_src: Path, tmp_path: Path, mode: str, seed: int
) -> None:
    engine = fp32_engine
    transcript = "希望你以后能够做的比我还好呦。" if mode == "zero-shot" else ""
    voice = engine.make_voice(_prompt_wav(tmp_path / "p.wav"), transcript, "p")
    ours = engine.synthesize_wav(TEXT, voice, SynthesisConfig(seed=seed, normalize=False))

    ref = load_reference(v3_src)
    ids = engine.tokenizer.encode(TEXT)
    prompt_ids = engine.lm_prompt(voice, None, normalize=False)[0]  # the system prompt + marker (+ transcript)
    lm_rng, vocoder_rng = SynthesisConfig(seed=seed).rngs()
    draw = RngDraw(lm_rng)
    prompt_tokens = torch.as_tensor(voice.speech_tokens, dtype=torch.long)[None]
    with torch.inference_mode():
        raw = list(ref.lm.inference(torch.tensor([ids]), torch.tensor([prompt_ids]),
                                    prompt_tokens if mode == "zero-shot" else prompt_tokens[:, :0],
                                    draw=lambda p: draw(p.numpy())))  # fmt: skip
        tokens = drop_long_silences(raw)
        mel, _ = ref.flow.inference(torch.tensor([tokens]), torch.tensor([len(tokens)]), prompt_tokens,
                                    torch.tensor([prompt_tokens.shape[1]]), torch.from_numpy(voice.mel)[None], None,
                                    torch.from_numpy(voice.embedding)[None])  # fmt: skip
        length = mel.shape[2] * 480
        noise = SourceNoise.draw(vocoder_rng, 1, length, ref.hift.m_source.harmonics, "v3")
        wave, _ = ref.hift.inference(mel, noise=TorchNoise(torch.from_numpy(noise.initial_phase),
                                                           torch.from_numpy(noise.sine_noise)))  # fmt: skip
    assert len(ours) == wave.shape[1] == len(tokens) * 2 * 480
    err = rel_err(ours, wave[0].numpy())
    print(f"v3 engine vs reference ({mode}): {len(raw)} tokens ({len(tokens)} to the flow), wave rel err {err:.2e}")
    assert err < WAVE_RTOL


def test_prompt_rules_streaming_and_bad_input(v3_int8w: Path, tmp_path: Path) -> None:
    engine = Engine.load(v3_int8w)
    enc = engine.tokenizer.encode
    voice = engine.make_voice(_prompt_wav(tmp_path / "p.wav"), "今天天气很好。", "p")
    # the LM needs <|endofprompt|>: the official examples' system prompt is put in front when it is missing
    assert engine.lm_prompt(voice, None, normalize=False)[0] == enc(f"{SYSTEM_PROMPT_V3}{MARK}今天天气很好。")
    marked = voice.__class__("m", f"Speak slowly.{MARK}今天天气很好。", voice.speech_tokens, voice.mel,
                             voice.embedding, family="cosyvoice3")  # fmt: skip
    assert engine.lm_prompt(marked, None, normalize=False)[0] == enc(f"Speak slowly.{MARK}今天天气很好。")
    cross = voice.__class__("c", "", voice.speech_tokens, voice.mel, voice.embedding, family="cosyvoice3")
    assert engine.lm_prompt(cross, None)[0] == enc(f"{SYSTEM_PROMPT_V3}{MARK}")
    ids, speech, speaker = engine.lm_prompt(voice, "请用广东话表达。")
    assert ids == enc(f"{SYSTEM_PROMPT_V3} 请用广东话表达。{MARK}") and len(speech) == 0 and speaker is None
    # the runtime LM itself refuses a prompt without the marker, as the official assert does
    with pytest.raises(ConfigError, match="endofprompt"):
        engine.lm.request(enc(TEXT), [], voice.speech_tokens)
    # streaming: chunks on the DiT's key/value caches, the causal HiFT continued; same length as whole
    config = SynthesisConfig(seed=3, min_tokens=80, max_tokens=80)
    whole = engine.synthesize_wav(TEXT, voice, config)
    chunks = list(engine.synthesize(TEXT, voice, SynthesisConfig(seed=3, min_tokens=80, max_tokens=80, stream=True)))
    streamed = np.concatenate([c.samples for c in chunks])
    assert len(chunks) >= 3 and chunks[-1].final and np.isfinite(streamed).all() and np.abs(streamed).max() > 0
    assert len(chunks[0].samples) < len(streamed) / 3
    assert len(streamed) == len(whole)  # 2 frames per token x 480 samples, whatever the chunking
    assert {a.dtype for c in engine.prompt_caches._items.values() for a in (*c.k, *c.v)} == {np.dtype(np.float16)}


def test_serve_a_v3_model(v3_int8w: Path, tmp_path: Path) -> None:
    """A real server on a Fun-CosyVoice3 directory: a voice uploaded once, then streamed speech in PCM."""
    from tests.server.conftest import start_server

    server = start_server(tmp_path / "voices", tmp_path / "server.log", model=v3_int8w)
    try:
        with server.client() as c:
            files = {"file": ("p.wav", _prompt_wav(tmp_path / "p.wav").read_bytes(), "audio/wav")}
            r = c.post("/v1/audio/voices", data={"name": "p", "prompt_text": "今天天气很好。"}, files=files)
            assert r.status_code == 201, r.text
            body = {"model": "tts-1", "input": "Hello there.", "voice": "p", "response_format": "pcm", "seed": 1,
                    "stream": True}  # fmt: skip
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == 200, r.text
            pcm = np.frombuffer(r.content, np.int16)
            assert len(pcm) > 0 and len(pcm) % 480 == 0  # whole 20 ms frames at 24 kHz
            assert c.get("/health").json()["family"] == "cosyvoice3"
    finally:
        server.stop()
