"""CosyVoice-300M (v1) flow ONNX export (``export.flow.cosyvoice``) and its torch-free runtime (``flow.cosyvoice``,
``flow.cosyvoice_stream``) on the tiny v1 fixture: gates, the length regulator's matrix bit for bit, whole inference and
the official streaming (flow cache, 34-frame mel fade) vs the PyTorch reference with the same noise, int8."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.export.flow.cosyvoice import export_flow, settings_of, verify_flow
from cosyvoice_cpu.flow.cosyvoice import FILES, CosyVoiceFlow, frames_for_tokens, interpolation_matrix, stretch_matrix
from cosyvoice_cpu.flow.cosyvoice_stream import CosyVoiceFlowStream
from cosyvoice_cpu.reference.flow import length_regulator
from cosyvoice_cpu.workshop.parts import load_reference

# Measured (fp32 ORT vs torch, 1 thread, tiny fixture): encoder mu 5.6e-7 .. 6.4e-7, estimator 8.7e-7 .. 1.1e-6,
# whole flow (10 steps, CFG 0.7) 2.6e-7 .. 4.3e-7, streamed 3 windows ~4e-7. int8 estimator (reduce_range):
# velocity 7.3e-3 .. 9.7e-3, mel 3.0e-3 .. 3.7e-3.
RTOL = 1e-5
N_PROMPT, PROMPT_FRAMES = 15, 27


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared 2-core machine: a second thread only adds barrier waits
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def flow(tiny_v1_model_dir: Path):
    return load_reference(tiny_v1_model_dir, stages=("flow",)).flow


@pytest.fixture(scope="module")
def flow_dir(flow, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flow_v1_onnx")
    artifacts = export_flow(flow, out)
    assert [a.key for a in artifacts] == ["flow_encoder", "flow_estimator"]
    assert all((out / a.file).is_file() and all((out / d).is_file() for d in a.data) for a in artifacts)
    return out


@pytest.fixture(scope="module")
def stage(flow_dir: Path, flow) -> CosyVoiceFlow:
    return CosyVoiceFlow.from_dir(flow_dir, settings_of(flow), threads=1)


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "prompt": rng.integers(0, 4096, N_PROMPT),
        "feat": rng.standard_normal((PROMPT_FRAMES, 80), dtype=np.float32),
        "emb": rng.standard_normal((1, 192), dtype=np.float32),
        "tokens": rng.integers(0, 4096, 260),
    }


def _ref(flow, tokens, prompt, feat, emb, noise, cache=None):
    """``FlowV1.inference`` on NumPy inputs -> (mel, cache) as NumPy."""
    t = torch.from_numpy(np.asarray(tokens, np.int64))[None]
    p = torch.from_numpy(np.asarray(prompt, np.int64))[None]
    mel, new_cache = flow.inference(t, torch.tensor([t.shape[1]]), p, torch.tensor([p.shape[1]]),
                                    torch.from_numpy(feat)[None], None, torch.from_numpy(emb),
                                    flow_cache=None if cache is None else torch.from_numpy(cache),
                                    noise=torch.from_numpy(noise))  # fmt: skip
    return mel.numpy(), new_cache.numpy()


def test_all_verification_gates_pass(flow, flow_dir: Path) -> None:
    results = verify_flow(flow, flow_dir, seed=3)
    assert len(results) == 13
    assert all(r.passed for r in results), "\n".join(str(r) for r in results)


def test_verify_flow_rejects_unknown_keys(flow, flow_dir: Path) -> None:
    with pytest.raises(ConfigError, match="unknown keys"):
        verify_flow(flow, flow_dir, tolerance={"flow_estimator": 0.1})


def test_artifact_contracts(flow, tmp_path: Path) -> None:
    arts = {a.key: a for a in export_flow(flow, tmp_path)}
    enc, est = arts["flow_encoder"], arts["flow_estimator"]
    assert [(s.name, s.dtype, s.shape) for s in enc.inputs] == [
        ("token", "int64", [1, "tokens"]), ("embedding", "float32", [1, 192]),
        ("stretch", "float32", ["tokens", "frames"]),
    ]  # fmt: skip
    assert [(s.name, s.shape) for s in enc.outputs] == [("mu", [1, 80, "frames"]), ("spks", [1, 80])]
    assert [s.name for s in est.inputs] == ["x", "mask", "mu", "t", "spks", "cond"]
    assert est.inputs[0].shape == ["batch", 80, "time"] and est.inputs[3].shape == ["batch"]
    assert [(s.name, s.shape) for s in est.outputs] == [("estimator_out", ["batch", 80, "time"])]
    for a in (enc, est):
        assert {k: a.attrs[k] for k in ("input_frame_rate", "overlap_tokens", "cache_tail_frames")} == {
            "input_frame_rate": 50, "overlap_tokens": 20, "cache_tail_frames": 34}  # fmt: skip
        assert (a.attrs["n_timesteps"], a.attrs["cfg_rate"], a.attrs["t_scheduler"]) == (10, 0.7, "cosine")
    assert enc.attrs["mel_frames_per_second"] == 22050 / 256 and enc.attrs["split_above_tokens"] == 40


def test_interpolation_matrix_is_torch_linear_bit_for_bit() -> None:
    for n_in in range(1, 90):
        for n_out in (*range(1, 50), 70, 97, 171, 206, 344):
            ref = F.interpolate(torch.eye(n_in)[None], size=n_out, mode="linear")[0].numpy()
            assert np.array_equal(interpolation_matrix(n_in, n_out), ref), (n_in, n_out)


@pytest.mark.parametrize("n_prompt, mel_len1", [(0, 0), (15, 27), (1, 1), (40, 71)])
def test_stretch_matrix_equals_reference_stretch(flow, n_prompt: int, mel_len1: int) -> None:
    """``InterpolateRegulator.stretch`` of one-hot channels gives its weights exactly; every split regime
    (<= 40, 41 = 2-frame middle, > 40) and the empty prompt."""
    lr = flow.length_regulator
    for n_new in (*range(1, 48), 57, 100, 120, 131):
        mel_len2 = frames_for_tokens(n_new, 50)
        eye = torch.eye(n_prompt + n_new)[None]  # channel c = one-hot token c
        ref = lr.stretch(eye[:, :n_prompt], eye[:, n_prompt:], mel_len1, mel_len2)[0].numpy()
        assert np.array_equal(stretch_matrix(n_prompt, n_new, mel_len1, mel_len2), ref), n_new


def test_frames_for_tokens_and_stretch_errors() -> None:
    assert all(frames_for_tokens(n) == length_regulator.frames_for_tokens(n, 50) for n in range(2000))
    with pytest.raises(ConfigError, match="both empty"):
        stretch_matrix(5, 30, 0, 51)
    with pytest.raises(ConfigError, match="at least one more token"):
        stretch_matrix(0, 0, 0, 0)


@pytest.mark.parametrize("n_new, n_prompt", [(30, N_PROMPT), (57, N_PROMPT), (41, N_PROMPT), (45, 0), (30, 0)])
def test_inference_matches_reference(flow, stage, inputs, n_new: int, n_prompt: int) -> None:
    """Same injected noise: <= 40, > 40, 41 new tokens, with a prompt and SFT-style (no prompt tokens, 0 frames)."""
    feat = inputs["feat"][: PROMPT_FRAMES if n_prompt else 0]
    tok, prompt = inputs["tokens"][:n_new], inputs["prompt"][:n_prompt]
    noise = np.random.default_rng(n_new).standard_normal((1, 80, len(feat) + frames_for_tokens(n_new)), np.float32)
    ref_mel, ref_cache = _ref(flow, tok, prompt, feat, inputs["emb"], noise)
    mel, cache = stage.inference_cached(tok, prompt, feat, inputs["emb"], noise=noise)
    assert mel.shape == ref_mel.shape == (1, 80, frames_for_tokens(n_new)) and cache.shape == ref_cache.shape
    assert rel_err(mel, ref_mel) <= RTOL and rel_err(cache, ref_cache) <= RTOL
    # the second window of a stream, on this cache
    tok2 = inputs["tokens"][n_new - 20 : 2 * n_new]
    noise2 = np.random.default_rng(99).standard_normal((1, 80, len(feat) + frames_for_tokens(len(tok2))), np.float32)
    ref2, ref_cache2 = _ref(flow, tok2, prompt, feat, inputs["emb"], noise2, ref_cache)
    mel2, cache2 = stage.inference_cached(tok2, prompt, feat, inputs["emb"], noise=noise2, flow_cache=cache)
    assert rel_err(mel2, ref2) <= RTOL and rel_err(cache2, ref_cache2) <= RTOL


def test_fresh_noise_per_call_reproducible_per_seed(stage, inputs) -> None:
    args = (inputs["tokens"][:30], [], np.zeros((0, 80), np.float32), inputs["emb"])
    a = stage.inference(*args, rng=np.random.default_rng(1))
    b, _ = stage.inference_cached(*args, rng=np.random.default_rng(1))  # the same mel, with the stream's cache
    rng = np.random.default_rng(2)
    c = stage.inference(*args, rng=rng)
    d = stage.inference(*args, rng=rng)
    assert np.array_equal(a, b) and rel_err(a, c) > 1e-2 and rel_err(c, d) > 1e-2
    with pytest.raises(ConfigError, match="rng="):
        stage.inference(*args)
    with pytest.raises(TypeError, match="context"):  # look-ahead context is the chunk-streamed flows' alone
        stage.inference(*args, rng=rng, context=[1, 2, 3])


def _official_windows(n_tokens: int, hop: int = 100, overlap: int = 20) -> list[tuple[int, int, bool]]:
    """The official ``tts(stream=True)`` token loop (all tokens already decoded): windows as (start, end, final)."""
    out, start = [], 0
    while n_tokens - start >= hop + overlap:
        out.append((start, start + hop + overlap, False))
        start += hop
    return [*out, (start, n_tokens, True)]


def _reference_stream(flow, tokens, prompt, feat, emb, noises) -> np.ndarray:
    """The official v1 token2wav flow/mel side in torch: flow_cache across windows, hold back 34 frames, fade."""
    window = torch.from_numpy(np.hamming(68))  # float64, as the official numpy window: the fade runs in float64
    cache, held, out = None, torch.zeros(1, 80, 0), []
    for (a, b, final), noise in zip(_official_windows(len(tokens)), noises):
        mel, cache = _ref(flow, tokens[a:b], prompt, feat, emb, noise, cache)
        mel = torch.from_numpy(mel)
        if held.shape[2]:
            mel[..., :34] = mel[..., :34] * window[:34] + held[..., -34:] * window[34:]
        if not final:
            held, mel = mel[:, :, -34:], mel[:, :, :-34]
        out.append(mel.numpy())
    return np.concatenate(out, axis=2)


@pytest.mark.parametrize("n_tokens, n_prompt", [(260, N_PROMPT), (230, 0), (90, N_PROMPT)])
def test_stream_matches_reference_stream(flow, stage, inputs, n_tokens: int, n_prompt: int) -> None:
    feat = inputs["feat"][: PROMPT_FRAMES if n_prompt else 0]
    tokens, prompt = inputs["tokens"][:n_tokens], inputs["prompt"][:n_prompt]
    windows = _official_windows(n_tokens)
    rng = np.random.default_rng(5)
    noises = [rng.standard_normal((1, 80, len(feat) + frames_for_tokens(b - a)), np.float32) for a, b, _ in windows]
    ref = _reference_stream(flow, tokens, prompt, feat, inputs["emb"], noises)

    fs = CosyVoiceFlowStream(stage, prompt, feat, inputs["emb"])
    pieces, k, got_windows = [], 0, []
    for available in range(1, n_tokens + 1):  # the LM hands over one token at a time
        while (w := fs.next_window(available, available == n_tokens)) is not None:
            got_windows.append(w)
            pieces.append(fs.push_window(tokens[w[0] : w[1]], w[2], noise=noises[k]))
            k += 1
    assert got_windows == windows
    mel = np.concatenate(pieces, axis=2)
    assert mel.shape == ref.shape and rel_err(mel, ref) <= RTOL
    with pytest.raises(ConfigError, match="already ended"):
        fs.push_window(tokens[-30:], True)


def test_stream_rejects_a_window_without_the_overlap(stage, inputs) -> None:
    fs = CosyVoiceFlowStream(stage, [], np.zeros((0, 80), np.float32), inputs["emb"], rng=np.random.default_rng(0))
    assert fs.push_window(inputs["tokens"][:120], False).shape == (1, 80, frames_for_tokens(120) - 34)
    with pytest.raises(ConfigError, match="previous window's last 20 tokens"):
        fs.push_window(inputs["tokens"][101:221], False)
    with pytest.raises(ConfigError, match="> 40 tokens"):
        fs.push_window(inputs["tokens"][100:130], False)


def test_int8_estimator_passes_its_gate(flow, flow_dir: Path) -> None:
    import onnx

    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic
    from cosyvoice_cpu.workshop.export_stages import QUANT_TOLERANCE

    quantize_int8_dynamic(flow_dir / FILES["flow_estimator"], flow_dir / "est_int8.onnx", reduce_range=True)
    ops = {n.op_type for n in onnx.load(str(flow_dir / "est_int8.onnx"), load_external_data=False).graph.node}
    assert "MatMulInteger" in ops
    results = verify_flow(flow, flow_dir, files={"flow_estimator": "est_int8.onnx"},
                          tolerance=QUANT_TOLERANCE["flow_estimator:int8"])  # fmt: skip
    assert all(r.passed for r in results), "\n".join(str(r) for r in results)
    quantized = [r.value for r in results if r.graph in ("flow_estimator", "flow") and "mel" in r.check]
    assert min(quantized) > 1e-4  # the gate really ran the int8 graph


RUNTIME = """
import json, sys
sys.modules["torch"] = None
import numpy as np
from cosyvoice_cpu.flow.cosyvoice import CosyVoiceFlow, stretch_matrix
from cosyvoice_cpu.flow.cosyvoice_stream import CosyVoiceFlowStream
stage = CosyVoiceFlow.from_dir(sys.argv[1])
rng = np.random.default_rng(0)
emb = rng.standard_normal((1, 192)).astype(np.float32)
mel, cache = stage.inference_cached(rng.integers(0, 4096, 57), [], np.zeros((0, 80), np.float32), emb, rng=rng)
prompt = rng.integers(0, 4096, 9)
fs = CosyVoiceFlowStream(stage, prompt, rng.standard_normal((16, 80)).astype(np.float32), emb, rng=rng)
toks = rng.integers(0, 4096, 150)
out = [fs.push_window(toks[:120], False), fs.push_window(toks[100:], True)]
assert stretch_matrix(3, 45, 5, 77).shape == (48, 82)
assert "torch" not in {m for m in sys.modules if sys.modules[m] is not None}
print(json.dumps([mel.shape, cache.shape, sum(m.shape[2] for m in out)]))
"""


def test_runtime_runs_without_torch(flow_dir: Path) -> None:
    r = subprocess.run([sys.executable, "-c", RUNTIME, str(flow_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    mel, cache, streamed = json.loads(r.stdout)
    assert mel == [1, 80, 98] and cache == [1, 80, 34, 2]  # SFT: the cache is the last 34 frames only
    assert streamed == frames_for_tokens(120) - 34 + frames_for_tokens(50)
