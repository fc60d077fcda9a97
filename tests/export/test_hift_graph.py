"""HiFT ONNX export (``export.hift_graph``) and the torch-free vocoder (``cosyvoice_cpu.vocoder.hift``) on the tiny
fixture: graph contracts, every verification gate (as released, and with F0 moved into the voiced range), the
NumPy sine source (v2 and v1) against the reference, the whole vocoder with ``cache_source``, error messages,
the weight-only int8 variant, and the import wall (no torch, no onnx)."""

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

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.export.hift.common import decode_context, hift_attrs, quantize_hift_weights_int8
from cosyvoice_cpu.export.hift.cosyvoice import export_hift, verify_hift
from cosyvoice_cpu.reference.hift.cosyvoice import HiFT, HiFTConfig
from cosyvoice_cpu.reference.hift.source import SourceNoise
from cosyvoice_cpu.vocoder import hift as V
from cosyvoice_cpu.vocoder import source as S
from cosyvoice_cpu.vocoder.hift import DECODE_FILE, F0_FILE
from cosyvoice_cpu.workshop.parts import load_reference

SOURCE_ATOL = 1e-6  # measured 1.2e-7 (v2, v1; sin and the H -> 1 merge round differently, the phase is bitwise)
WAVE_RTOL = 3e-4  # measured 3e-5 (voiced; graph F0 ulps integrated into the phase)


def _voiced(hift: HiFT) -> HiFT:
    """A copy whose predicted F0 sits around 120 Hz (the random fixture predicts ~0.2 Hz: all unvoiced)."""
    hift = copy.deepcopy(hift)
    with torch.no_grad():
        cls = hift.f0_predictor.classifier
        cls.weight.mul_(60.0 / cls.weight.abs().sum())
        cls.bias.fill_(120.0)
    return hift


@pytest.fixture(scope="module")
def hift(tiny_model_dir: Path) -> HiFT:
    return load_reference(tiny_model_dir, stages=("hift",)).hift


@pytest.fixture(scope="module")
def voiced(hift: HiFT, tmp_path_factory: pytest.TempPathFactory) -> tuple[HiFT, Path, list]:
    model = _voiced(hift)
    out = tmp_path_factory.mktemp("hift_voiced")
    return model, out, export_hift(model, out)


def test_export_contract_and_gates(hift: HiFT, tmp_path: Path) -> None:
    artifacts = export_hift(hift, tmp_path)
    assert [a.key for a in artifacts] == ["hift_f0", "hift_decode"]
    f0, dec = artifacts
    assert (f0.file, dec.file) == (F0_FILE, DECODE_FILE)
    for a in artifacts:
        assert a.precision == "fp32" and all((tmp_path / n).is_file() for n in (a.file, *a.data))
    assert [(s.name, s.dtype, s.shape) for s in f0.inputs] == [("mel", "float32", ["batch", 80, "frames"])]
    assert [(s.name, s.dtype, s.shape) for s in f0.outputs] == [("f0", "float32", ["batch", "frames"])]
    assert [(s.name, s.dtype, s.shape) for s in dec.inputs] == [
        ("mel", "float32", ["batch", 80, "frames"]),
        ("source", "float32", ["batch", 1, "samples"]),
    ]
    assert [(s.name, s.dtype, s.shape) for s in dec.outputs] == [("wave", "float32", ["batch", "samples"])]
    assert set(S.REQUIRED_ATTRS) <= set(dec.attrs)
    assert dec.attrs["upsample"] == 480 and dec.attrs["sine_type"] == "v2" and len(dec.attrs["l_linear_weight"]) == 9
    assert dec.attrs["context_frames"] == decode_context(hift) and min(dec.attrs["context_frames"]) >= 2
    json.dumps([dataclasses.asdict(a) for a in artifacts])  # manifest-ready
    gates = verify_hift(hift, tmp_path)
    assert [g.check.split()[0] for g in gates] == ["f0", "source", "decode", "wave", "window"]
    assert all(g.passed for g in gates), "\n".join(map(str, gates))


def test_gates_voiced(voiced) -> None:
    model, out, _ = voiced
    gates = verify_hift(model, out, seed=1)
    assert all(g.passed for g in gates), "\n".join(map(str, gates))


def _f0_ramp(batch: int, frames: int) -> torch.Tensor:
    """Unvoiced frames (0 and 5 Hz, below the 10 Hz threshold) around a 80 -> 400 Hz ramp."""
    f0 = torch.cat([torch.zeros(5), torch.linspace(80, 400, frames - 10), torch.full((5,), 5.0)])
    return f0.repeat(batch, 1) * torch.linspace(1.0, 1.3, batch)[:, None]


@pytest.mark.parametrize("sine_type", ["v2", "v1"])
def test_numpy_source_matches_reference(hift: HiFT, sine_type: str) -> None:
    if sine_type == "v1":  # CosyVoice-300M layout: 22.05 kHz, upsample 8 x 8 x 4 = 256
        cfg = HiFTConfig(base_channels=32, f0_cond_channels=32, sampling_rate=22050, upsample_rates=[8, 8],
                         upsample_kernel_sizes=[16, 16], source_resblock_kernel_sizes=[7, 11],
                         source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]])  # fmt: skip
        hift = HiFT(cfg).eval()
        with torch.no_grad():
            hift.m_source.l_linear.weight.normal_(generator=torch.Generator().manual_seed(1))
    assert hift.cfg.sine_type == sine_type
    cfg = S.SourceConfig.from_attrs(hift_attrs(hift))
    f0 = _f0_ramp(2, 300)  # 6 s at 24 kHz: phases up to ~3e5 rad, where one float32 ulp is 0.03 rad
    gen = torch.Generator().manual_seed(5)
    noise = SourceNoise.draw(2, 300 * hift.cfg.upsample, 9, sine_type, generator=gen)
    with torch.no_grad():
        want = hift.source(f0, noise).numpy()
    arrays = S.SourceNoise(noise.initial_phase.numpy(), noise.sine_noise.numpy())
    got = S.harmonic_source(f0.numpy(), cfg, arrays)  # 144,000 samples: 6 blocks of 24,000
    assert got.shape == want.shape == (2, 1, 300 * hift.cfg.upsample) and got.dtype == np.float32
    assert np.abs(got - want).max() <= SOURCE_ATOL
    for block in (997, 144_000, 10**6):  # block by block, the same bits (v1: its running sum carried over)
        assert np.array_equal(S.harmonic_source(f0.numpy(), cfg, arrays, block=block), got), block
    with pytest.raises(ConfigError, match="block"):
        S.harmonic_source(f0.numpy(), cfg, arrays, block=0)


def test_vocoder_matches_inference_with_cache_source(voiced) -> None:
    model, out, artifacts = voiced
    voc = V.Vocoder(out / F0_FILE, out / DECODE_FILE, artifacts[1].attrs, threads=2)
    gen = torch.Generator().manual_seed(3)
    mel = torch.randn(2, 80, 41, generator=gen) * 2 - 5
    noise = SourceNoise.draw(2, 41 * 480, 9, generator=gen)
    cache = torch.rand(1, 1, 960, generator=gen) * 2 - 1
    want_wave, want_source = model.inference(mel, noise, cache)
    arrays = S.SourceNoise(noise.initial_phase.numpy(), noise.sine_noise.numpy())
    wave, source = voc(mel.numpy(), noise=arrays, cache_source=cache.numpy())
    assert wave.shape == (2, 41 * 480) and source.shape == (2, 1, 41 * 480)
    np.testing.assert_array_equal(source[:, :, :960], np.broadcast_to(cache.numpy(), (2, 1, 960)))
    assert rel_err(source, want_source.numpy()) <= 1e-4
    assert rel_err(wave, want_wave.numpy()) <= WAVE_RTOL
    # a NumPy generator: reproducible, and an empty cache is no cache
    a = voc(mel.numpy(), rng=np.random.default_rng(7))
    b = voc(mel.numpy(), rng=np.random.default_rng(7), cache_source=np.zeros((2, 1, 0), np.float32))
    np.testing.assert_array_equal(a[0], b[0])
    assert np.abs(a[0]).max() <= 0.99


def test_vocoder_errors(voiced, tmp_path: Path) -> None:
    _, out, artifacts = voiced
    attrs = artifacts[1].attrs
    voc = V.Vocoder(out / F0_FILE, out / DECODE_FILE, attrs)
    with pytest.raises(ConfigError, match="mel"):
        voc(np.zeros((1, 40, 5), np.float32))
    with pytest.raises(ConfigError, match="cache_source"):
        voc(np.zeros((1, 80, 2), np.float32), cache_source=np.zeros((1, 1, 961), np.float32))
    with pytest.raises(ConfigError, match="SourceNoise"):
        voc(np.zeros((1, 80, 2), np.float32), noise=S.SourceNoise(np.zeros((1, 9)), np.zeros((1, 10, 9))))
    with pytest.raises(ModelDirError, match="l_linear_bias"):
        V.Vocoder(out / F0_FILE, out / DECODE_FILE, {k: v for k, v in attrs.items() if k != "l_linear_bias"})
    with pytest.raises(ModelDirError, match="missing input source"):
        V.Vocoder(out / F0_FILE, out / F0_FILE, attrs)  # the f0 graph where the decode graph belongs
    with pytest.raises(ModelDirError, match="not found"):
        V.Vocoder(out / F0_FILE, tmp_path / "missing.onnx", attrs)


def test_weight_only_int8(voiced, tmp_path: Path) -> None:
    import onnx

    model, out, _ = voiced
    quantize_hift_weights_int8(out / DECODE_FILE, out / "hift_decode_w8.onnx", min_elements=0)
    graph = onnx.load(str(out / "hift_decode_w8.onnx"), load_external_data=False).graph
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == sum(n.op_type in ("Conv", "ConvTranspose") for n in graph.node) - 3  # all but the DFT kernels
    gates = verify_hift(
        model, out, files={"hift_decode": "hift_decode_w8.onnx"}, tolerance={"decode": 0.05, "wave": 0.05}
    )
    assert all(g.passed for g in gates), "\n".join(map(str, gates))
    assert next(g for g in gates if g.check.startswith("decode")).value > 1e-5  # really quantized


def test_vocoder_runs_without_torch_or_onnx(voiced) -> None:
    _, out, artifacts = voiced
    code = (
        "import sys, json\nsys.modules['torch'] = None\nsys.modules['onnx'] = None\n"
        "import numpy as np\nfrom cosyvoice_cpu.vocoder.hift import Vocoder\n"
        f"v = Vocoder(r'{out / F0_FILE}', r'{out / DECODE_FILE}', json.loads(sys.stdin.read()))\n"
        "wave, source = v(np.full((1, 80, 7), -5, np.float32), rng=np.random.default_rng(0))\n"
        "assert wave.shape == (1, 3360) and source.shape == (1, 1, 3360)\n"
        "assert not {'torch', 'onnx'} & {m.split('.')[0] for m, mod in sys.modules.items() if mod is not None}\n"
    )
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(artifacts[1].attrs), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
