"""Fun-CosyVoice3 flow (DiT) and causal HiFT vs golden arrays of the official code.

``tests/golden/v3_flow.npz`` is written by ``scripts/make_v3_flow_golden.py``, which runs the official
``CausalMaskedDiffWithDiT`` / ``DiT`` / ``CausalHiFTGenerator`` (commit in the npz header) on tiny seeded
configurations; the official code itself is not needed here. Our modules are built from the header's yaml-like
configuration through ``from_yaml``, loaded strictly from the stored state dicts, and must reproduce the stored
outputs. Relative error = max|ours - golden| / max|golden|.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cosyvoice_cpu.reference.flow.cosyvoice3 import FlowV3, FlowV3Config  # noqa: E402
from cosyvoice_cpu.reference.flow.dit import DiT  # noqa: E402
from cosyvoice_cpu.reference.hift.cosyvoice3 import CausalHiFT, CausalHiFTConfig  # noqa: E402
from cosyvoice_cpu.reference.hift.source import SourceNoise  # noqa: E402
from cosyvoice_cpu.reference.yamlconf import Tagged  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v3_flow.npz"
EST_TOL = 1e-6  # estimator (measured: 0, bitwise)
FLOW_TOL = 1e-5  # flow inference, 10 Euler steps with CFG (measured: 0, bitwise)
HIFT_TOL = 1e-6  # F0 (float64), source (measured: 0, bitwise)
# The wave after the float32 convolution stack depends on the CPU's convolution kernels: bitwise on the AMD EPYC
# machine the golden arrays were checked on, 2.6e-6 (whole) and 3.4e-6 (streamed chunk) on an Intel Xeon
# (Sapphire Rapids) with the same torch. A wrong padding, cache or iSTFT moves it by 1e-2 or more.
HIFT_WAVE_TOL = 2e-5
F0_FP32_TOL = 1e-5  # F0 predictor in float32 instead of float64 (measured ~1e-7 on F0, see docs/reference.md)


def rel(ours, ref) -> float:
    ours = ours.detach().double().numpy() if hasattr(ours, "detach") else np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def tagged(node):
    """The script's yaml-like dicts (``__target__``) -> :class:`Tagged`, as ``load_yaml_data`` would give."""
    if isinstance(node, dict) and "__target__" in node:
        args = {k: tagged(v) for k, v in node.items() if k != "__target__"}
        return Tagged(kind="new", target=node["__target__"], args=args)
    if isinstance(node, dict):
        return {k: tagged(v) for k, v in node.items()}
    return node


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN} missing: run scripts/make_v3_flow_golden.py --official <checkout>")
    z = np.load(GOLDEN)
    data = {k: z[k] for k in z.files}
    data["header"] = json.loads(str(data["header"]))
    return data


def state(golden, prefix: str) -> dict:
    return {k[len(prefix) :]: torch.from_numpy(v.copy()) for k, v in golden.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def flow(golden, torch_one_thread) -> FlowV3:
    model = FlowV3(FlowV3Config.from_yaml(tagged(golden["header"]["flow"]))).eval()
    model.load_state_dict(state(golden, "flow/"), strict=True)
    return model


@pytest.fixture(scope="module")
def hift(golden, torch_one_thread) -> CausalHiFT:
    model = CausalHiFT(CausalHiFTConfig.from_yaml(tagged(golden["header"]["hift"]))).eval()
    model.load_checkpoint_state(state(golden, "hift/"))
    return model


def pinned_noise(golden) -> SourceNoise:
    return SourceNoise(
        torch.from_numpy(golden["hift_noise/rand_ini"]), torch.from_numpy(golden["hift_noise/sine_waves"])
    )


def test_header_and_state_dict_layout(golden, flow: FlowV3, hift: CausalHiFT) -> None:
    header = golden["header"]
    assert len(header["official_commit"]) == 40
    ours = {k: tuple(v.shape) for k, v in flow.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state(golden, "flow/").items()}
    assert ours == theirs  # includes decoder.estimator.rotary_embed.inv_freq
    folded = {k.replace(".parametrizations.weight.original1", ".weight") for k in state(golden, "hift/")}
    folded = {k for k in folded if not k.endswith(".original0")}
    assert set(hift.state_dict()) == folded
    assert hift.f0_predictor.classifier.weight.dtype == torch.float64


@pytest.mark.parametrize("name, streaming", [("full", False), ("chunk", True)])
def test_estimator(golden, flow: FlowV3, name: str, streaming: bool) -> None:
    est: DiT = flow.decoder.estimator
    args = [torch.from_numpy(golden[f"est/{k}"]) for k in ("x", "mask", "mu", "t", "spks", "cond")]
    with torch.inference_mode():
        out = est(*args, streaming=streaming)
    assert rel(out, golden[f"est/out_{name}"]) <= EST_TOL
    if streaming:  # an explicit chunk_id of i // static_chunk_size is the same mask
        ids = (torch.arange(out.size(2)) // est.cfg.static_chunk_size).expand(2, -1)
        with torch.inference_mode():
            again = est(*args, streaming=True, chunk_id=ids)
        assert torch.equal(again, out)


def flow_inputs(golden):
    g = {k: torch.from_numpy(golden[f"flow_in/{k}"]) for k in ("token", "prompt_token", "prompt_feat", "embedding")}
    return g["token"], g["prompt_token"], g["prompt_feat"], g["embedding"]


def test_flow_mu(golden, flow: FlowV3) -> None:
    token, p_tok, p_feat, emb = flow_inputs(golden)
    n = lambda a: torch.tensor([a.shape[1]], dtype=torch.int32)  # noqa: E731
    c = flow.encode(token, n(token), p_tok, n(p_tok), p_feat, emb)
    assert (c.mel_len1, c.mel_len2) == (10, 24)
    assert rel(c.mu, golden["flow_out/mu"]) <= EST_TOL


@pytest.mark.parametrize(
    "case, prompt, streaming, finalize, n_tokens",
    [
        ("prompt", True, False, True, 12),
        ("no_prompt", False, False, True, 12),
        ("stream_final", True, True, True, 12),
        ("stream_chunk", True, True, False, 7),
    ],
)
def test_flow_inference(golden, flow: FlowV3, case, prompt, streaming, finalize, n_tokens) -> None:
    token, p_tok, p_feat, emb = flow_inputs(golden)
    token = token[:, :n_tokens]
    if not prompt:
        p_tok, p_feat = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80)
    n = lambda a: torch.tensor([a.shape[1]], dtype=torch.int32)  # noqa: E731
    mel, cache = flow.inference(token, n(token), p_tok, n(p_tok), p_feat, n(p_feat), emb, streaming, finalize)
    assert cache is None
    assert rel(mel, golden[f"flow_out/{case}"]) <= FLOW_TOL


def test_hift_finalize(golden, hift: CausalHiFT) -> None:
    mel = torch.from_numpy(golden["hift_in/mel"])
    with torch.inference_mode():
        f0 = hift.f0_predictor(mel.double())
    assert rel(f0, golden["hift_out/f0"]) <= HIFT_TOL
    wave, source = hift.inference(mel, pinned_noise(golden), finalize=True)
    assert rel(source, golden["hift_out/source"]) <= HIFT_TOL
    assert rel(wave, golden["hift_out/wave"]) <= HIFT_WAVE_TOL


def test_hift_streaming_chunk(golden, hift: CausalHiFT) -> None:
    mel = torch.from_numpy(golden["hift_in/mel"])[:1, :, :16]
    with torch.inference_mode():
        f0 = hift.f0_predictor(mel.double(), finalize=False)
    assert rel(f0, golden["hift_out/f0_chunk"]) <= HIFT_TOL
    wave, source = hift.inference(mel, pinned_noise(golden), finalize=False)  # the table is longer: sliced
    assert source.shape[-1] == 13 * hift.frame_samples and wave.shape[-1] == 8 * hift.frame_samples
    assert rel(source, golden["hift_out/source_chunk"]) <= HIFT_TOL
    assert rel(wave, golden["hift_out/wave_chunk"]) <= HIFT_WAVE_TOL


def test_hift_weight_norm_formats(golden, hift: CausalHiFT) -> None:
    """Old ``weight_g/weight_v`` keys and already-folded weights load to the same module."""
    old = {
        k.replace(".parametrizations.weight.original0", ".weight_g").replace(
            ".parametrizations.weight.original1", ".weight_v"
        ): v
        for k, v in state(golden, "hift/").items()
    }
    other = CausalHiFT(hift.cfg).eval()
    other.load_checkpoint_state(old)
    plain = CausalHiFT(hift.cfg).eval()
    plain.load_checkpoint_state({f"generator.{k}": v for k, v in hift.state_dict().items()})
    for model in (other, plain):
        for (k, a), b in zip(hift.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), k


def test_hift_f0_float32_cost(golden, hift: CausalHiFT) -> None:
    """Upstream runs the F0 predictor in float64; in float32 the F0 moves by ~1e-7 relative (stated bound)."""
    f32 = CausalHiFT(hift.cfg, f0_dtype=torch.float32).eval()
    f32.load_checkpoint_state(state(golden, "hift/"))
    mel = torch.from_numpy(golden["hift_in/mel"])
    wave, source = f32.inference(mel, pinned_noise(golden))
    f0 = f32.f0(mel)
    assert rel(f0, golden["hift_out/f0"]) <= F0_FP32_TOL
    assert rel(source, golden["hift_out/source"]) <= F0_FP32_TOL * 10
    assert rel(wave, golden["hift_out/wave"]) <= F0_FP32_TOL * 10


def test_hift_fresh_noise_is_uniform(hift: CausalHiFT) -> None:
    mel = torch.zeros(1, 80, 12) - 4
    gen = torch.Generator().manual_seed(0)
    w1, s1 = hift.inference(mel, gen)
    w2, s2 = hift.inference(mel, torch.Generator().manual_seed(0))
    assert torch.equal(w1, w2) and torch.equal(s1, s2)
    noise = SourceNoise.draw(1, 100, 9, "v3", torch.Generator().manual_seed(0))
    assert float(noise.sine_noise.min()) >= 0.0 and float(noise.sine_noise.max()) < 1.0
