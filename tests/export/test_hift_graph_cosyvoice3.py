"""v3 causal HiFT: ONNX export (``export.hift_graph_v3``), the NumPy "v3" source and ``Vocoder(finalize=...)``
against ``CausalHiFT``, the bounded-work :class:`CausalVocoderStream` against one-shot vocoding, int8w, and the
import wall (no torch, no onnx) — on the tiny v3 fixture (as released: unvoiced; and with F0 at ~120 Hz)."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.export.hift.common import quantize_hift_weights_int8
from cosyvoice_cpu.export.hift.cosyvoice3 import export_hift, receptive_field_frames, verify_hift
from cosyvoice_cpu.reference.hift.cosyvoice3 import CausalHiFT
from cosyvoice_cpu.reference.hift.source import SourceNoise
from cosyvoice_cpu.vocoder import hift as V
from cosyvoice_cpu.vocoder import source as S
from cosyvoice_cpu.vocoder.causal_stream import CausalVocoderStream
from cosyvoice_cpu.workshop.export_stages import QUANT_TOLERANCE

WAVE_RTOL = 3e-5  # measured 1.3e-6 (graph conv rounding; F0 is bitwise thanks to the float64 graph)
CHUNKINGS = ([1, 2, 3, 5, 8, 13, 20], [9], [10, 10, 10], [25, 0, 40], [70])  # mel frames per push (+ final rest)


def _voiced(hift: CausalHiFT) -> CausalHiFT:
    """A copy whose predicted F0 sits around 120 Hz (voiced), so the phase integration matters."""
    hift = copy.deepcopy(hift)
    with torch.no_grad():
        cls = hift.f0_predictor.classifier
        cls.weight.mul_(60.0 / cls.weight.abs().sum())
        cls.bias.fill_(120.0)
    return hift


@pytest.fixture(scope="module")
def hift(tmp_path_factory: pytest.TempPathFactory) -> CausalHiFT:
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture
    from cosyvoice_cpu.workshop.parts import load_reference

    src = write_fixture(FixtureSpec("cosyvoice3", "tiny", 0), tmp_path_factory.mktemp("fixtures") / "tiny-v3")
    return load_reference(src, stages=("hift",)).hift


@pytest.fixture(scope="module")
def voiced(hift: CausalHiFT, tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalHiFT, Path, list]:
    model = _voiced(hift)
    out = tmp_path_factory.mktemp("hift_v3_voiced")
    return model, out, export_hift(model, out)


def _noise(frames: int, seed: int = 0) -> tuple[SourceNoise, S.SourceNoise]:
    """An upstream-style table (batch 1, longer than needed) for the reference and the runtime."""
    gen = torch.Generator().manual_seed(seed)
    ref = SourceNoise(torch.rand(1, 9, generator=gen), torch.rand(1, frames * 480 + 4800, 9, generator=gen))
    return ref, S.SourceNoise(ref.initial_phase.numpy(), ref.sine_noise.numpy())


def _mel(frames: int, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((1, 80, frames)) * 2 - 5).astype(np.float32)


def test_export_contract_and_gates(hift: CausalHiFT, tmp_path: Path) -> None:
    artifacts = export_hift(hift, tmp_path)
    f0, dec = artifacts
    assert [a.key for a in artifacts] == ["hift_f0", "hift_decode"]
    assert (f0.file, dec.file) == (V.F0_FILE, V.DECODE_FILE)
    assert [(s.name, s.dtype, s.shape) for s in f0.inputs] == [("mel", "float32", ["batch", 80, "frames"])]
    assert [(s.name, s.dtype, s.shape) for s in f0.outputs] == [("f0", "float32", ["batch", "frames"])]
    assert [(s.name, s.dtype, s.shape) for s in dec.inputs] == [
        ("mel", "float32", ["batch", 80, "frames"]),
        ("source", "float32", ["batch", 1, "samples"]),
    ]
    assert [(s.name, s.dtype, s.shape) for s in dec.outputs] == [("wave", "float32", ["batch", "samples"])]
    assert set(S.REQUIRED_ATTRS) <= set(dec.attrs) and dec.attrs["sine_type"] == "v3"
    assert dec.attrs["causal"] and (dec.attrs["f0_look_right"], dec.attrs["conv_pre_look_right"]) == (3, 4)
    assert dec.attrs["stream_context_frames"] == receptive_field_frames(hift.cfg) == 30
    assert dec.attrs["f0_precision"] == "fp64"
    json.dumps([dataclasses.asdict(a) for a in artifacts])  # manifest-ready
    # no noise table baked in: upstream's would be 259 MB; the graphs are about the size of the weights
    size = sum((tmp_path / n).stat().st_size for a in artifacts for n in (a.file, *a.data))
    assert size < 4 * sum(p.numel() * 4 for p in hift.parameters()) + 2_000_000
    gates = verify_hift(hift, tmp_path)
    assert [g.check.split()[0] for g in gates] == ["f0", "source", "decode", "wave", "stream", "window"]
    assert all(g.passed for g in gates), "\n".join(map(str, gates))


@pytest.mark.parametrize("seed", [0, 1])
def test_gates_voiced(voiced, seed: int) -> None:
    model, out, _ = voiced
    gates = verify_hift(model, out, seed=seed)
    assert all(g.passed for g in gates), "\n".join(map(str, gates))
    assert next(g for g in gates if g.check.startswith("f0")).value < 1e-6  # float64 F0 graph: ~bitwise


def test_numpy_source_chunked_equals_whole(voiced) -> None:
    model, _, artifacts = voiced
    cfg = S.SourceConfig.from_attrs(artifacts[1].attrs)
    with torch.no_grad():
        f0 = model.f0(torch.from_numpy(_mel(50))).numpy()
    ref_noise, noise = _noise(50)
    whole = S.harmonic_source(f0, cfg, noise)
    with torch.no_grad():
        want = model.source(torch.from_numpy(f0), ref_noise).numpy()
    assert rel_err(whole, want) < 1e-6  # sin/tanh rounding only
    for block in (997, 24_000):  # the sample-rate gather and merge block by block: the same bits
        assert np.array_equal(S.harmonic_source(f0, cfg, noise, block=block), whole), block
    parts, carry, start = [], None, 0
    for n in (1, 7, 20, 22):
        rows = S.SourceNoise(noise.initial_phase, noise.sine_noise[:, start * 480 :])
        part, carry = S.source_v3(f0[:, start : start + n], cfg, rows, start, carry)
        parts.append(part)
        start += n
    np.testing.assert_array_equal(np.concatenate(parts, axis=2), whole)


@pytest.mark.parametrize("finalize", [True, False])
def test_vocoder_matches_inference(voiced, finalize: bool) -> None:
    model, out, artifacts = voiced
    voc = V.Vocoder.from_dir(out, artifacts[1].attrs)
    mel = _mel(45)
    ref_noise, noise = _noise(45)
    want, want_source = model.inference(torch.from_numpy(mel), ref_noise, finalize=finalize)
    got, got_source = voc(mel, noise=noise, finalize=finalize)
    frames = 45 if finalize else 45 - 8
    assert got.shape == (1, frames * 480) and got_source.shape == want_source.shape
    assert rel_err(got, want.numpy()) < WAVE_RTOL and rel_err(got_source, want_source.numpy()) < 1e-5
    if not finalize:  # a non-final call's samples are final: they equal the one-shot prefix
        whole, _ = voc(mel, noise=noise)
        np.testing.assert_allclose(got[0], whole[0, : got.shape[1]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_stream_equals_whole(voiced, chunks: list[int]) -> None:
    model, out, artifacts = voiced
    voc = V.Vocoder.from_dir(out, artifacts[1].attrs)
    frames = 90
    mel = _mel(frames, seed=2)
    ref_noise, noise = _noise(frames, seed=3)
    whole, _ = voc(mel, noise=noise)
    stream = CausalVocoderStream(voc, noise=noise)
    pieces, start = [], 0
    for n in chunks:
        pieces.append(stream.push(mel[:, :, start : start + n]))
        start += n
        # bounded: past what the F0 and decode windows read, nothing is kept
        assert stream.mel.shape[2] <= stream.context + (start - stream.emitted) + 8
    pieces.append(stream.push(mel[:, :, start:], final=True))
    got = np.concatenate(pieces)
    assert got.shape == (frames * 480,)
    np.testing.assert_allclose(got, whole[0], rtol=0, atol=2e-6)  # measured 2.1e-7 (conv rounding per window)
    want, _ = model.inference(torch.from_numpy(mel), ref_noise)
    assert rel_err(got[None], want.numpy()) < WAVE_RTOL


def test_stream_latency_and_context(voiced) -> None:
    _, out, artifacts = voiced
    voc = V.Vocoder.from_dir(out, artifacts[1].attrs)
    mel = _mel(80, seed=4)
    _, noise = _noise(80)
    whole, _ = voc(mel, noise=noise)
    stream = CausalVocoderStream(voc, noise=noise)
    assert stream.push(mel[:, :, :5]).size == 0  # frame 0 needs mel frames up to 5
    assert stream.push(mel[:, :, 5:40]).size == (40 - 5) * 480  # upstream's finalize=False gives 40 - 8 frames
    # a context below the receptive field changes the samples (so the default context is needed)
    short = CausalVocoderStream(voc, noise=noise, context_frames=2)
    got = np.concatenate([short.push(mel[:, :, :40]), short.push(mel[:, :, 40:], final=True)])
    assert np.abs(got - whole[0]).max() > 1e-4
    with pytest.raises(ConfigError, match="finished"):
        short.push(mel[:, :, :1])
    with pytest.raises(ConfigError, match="one utterance"):
        stream.push(np.zeros((2, 80, 3), np.float32))
    rng_stream = CausalVocoderStream(voc, rng=np.random.default_rng(0))
    out_rng = np.concatenate([rng_stream.push(mel[:, :, :30]), rng_stream.push(mel[:, :, 30:], final=True)])
    assert out_rng.shape == (80 * 480,) and np.isfinite(out_rng).all() and np.abs(out_rng).max() <= 0.99


def test_errors(voiced, tmp_path: Path) -> None:
    from cosyvoice_cpu.export.hift.cosyvoice import export_hift as export_v2
    from cosyvoice_cpu.reference.hift.cosyvoice import HiFT, HiFTConfig

    model, out, artifacts = voiced
    voc = V.Vocoder.from_dir(out, artifacts[1].attrs)
    with pytest.raises(ConfigError, match="more than 8 mel frames"):
        voc(_mel(8), finalize=False)
    v2 = HiFT(HiFTConfig(base_channels=16, f0_cond_channels=16)).eval()
    with pytest.raises(ConfigError, match="CausalHiFT"):
        export_hift(v2, tmp_path)
    v2_voc = V.Vocoder.from_dir(tmp_path, export_v2(v2, tmp_path)[1].attrs)
    with pytest.raises(ConfigError, match="causal"):
        v2_voc(_mel(20), finalize=False)
    with pytest.raises(ConfigError, match="v3"):
        CausalVocoderStream(v2_voc)
    with pytest.raises(ConfigError, match="unknown keys"):
        verify_hift(model, out, tolerance={"nope": 1.0})


def test_weight_only_int8(voiced, tmp_path: Path) -> None:
    model, out, _ = voiced
    quantize_hift_weights_int8(out / V.DECODE_FILE, out / "hift_decode_w8.onnx", min_elements=0)
    # the stage planner's tolerance; the stream gate (stream vs one-shot on the same graphs) keeps its fp32 one
    tol = QUANT_TOLERANCE["hift:int8w"]
    gates = verify_hift(model, out, files={"hift_decode": "hift_decode_w8.onnx"}, tolerance=tol)
    assert all(g.passed for g in gates), "\n".join(map(str, gates))
    assert next(g for g in gates if g.check.startswith("decode")).value > 1e-5  # really quantized


def test_runs_without_torch_or_onnx(voiced) -> None:
    _, out, artifacts = voiced
    code = (
        "import sys, json\nsys.modules['torch'] = None\nsys.modules['onnx'] = None\n"
        "import numpy as np\nfrom cosyvoice_cpu.vocoder.hift import Vocoder\n"
        "from cosyvoice_cpu.vocoder.causal_stream import CausalVocoderStream\n"
        f"v = Vocoder.from_dir(r'{out}', json.loads(sys.stdin.read()))\n"
        "mel = np.full((1, 80, 20), -5, np.float32)\n"
        "wave, source = v(mel, rng=np.random.default_rng(0), finalize=False)\n"
        "assert wave.shape == (1, 12 * 480) and source.shape == (1, 1, 17 * 480)\n"
        "s = CausalVocoderStream(v, rng=np.random.default_rng(0))\n"
        "assert np.concatenate([s.push(mel[:, :, :9]), s.push(mel[:, :, 9:], final=True)]).shape == (9600,)\n"
        "assert not {'torch', 'onnx'} & {m.split('.')[0] for m, mod in sys.modules.items() if mod is not None}\n"
    )
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(artifacts[1].attrs), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
