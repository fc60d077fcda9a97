"""Flow ONNX export (``export.flow.cosyvoice2``) and the torch-free flow stage (``cosyvoice_cpu.flow.cosyvoice2``) on
the tiny fixture: every verification gate, dynamic batch/time, padding, streaming look-ahead context, whole-flow
parity."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.onnxruntime import make_session
from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.export.flow.cosyvoice2 import FILES, export_flow, verify_flow
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.hardware.cpu import read_cpuinfo
from cosyvoice_cpu.workshop.parts import load_reference

RTOL = 1e-5  # measured 2e-7 .. 1e-6 (fp32 ORT vs torch)


@pytest.fixture(scope="module")
def flow(tiny_model_dir: Path):
    return load_reference(tiny_model_dir, stages=("flow",)).flow


@pytest.fixture(scope="module")
def flow_dir(flow, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flow_onnx")
    artifacts = export_flow(flow, out)
    assert [a.key for a in artifacts] == ["flow_encoder", "flow_estimator", "flow_estimator_stream"]
    assert all((out / a.file).is_file() and all((out / d).is_file() for d in a.data) for a in artifacts)
    assert (out / FILES["flow_noise"]).is_file()
    return out


@pytest.fixture(scope="module")
def stage(flow_dir: Path, flow) -> CosyVoice2Flow:
    c = flow.config
    attrs = {"static_chunk_size": c.encoder.static_chunk_size, "pre_lookahead_len": c.pre_lookahead_len}
    return CosyVoice2Flow.from_dir(flow_dir, settings=attrs, threads=2)


def _estimator_feeds(rng: np.random.Generator, lengths: list[int], size: int) -> dict[str, np.ndarray]:
    mask = (np.arange(size)[None, None] < np.array(lengths)[:, None, None]).astype(np.float32)
    b = len(lengths)
    feeds = {"x": rng.standard_normal((b, 80, size)), "mask": mask, "mu": rng.standard_normal((b, 80, size)) * mask,
             "t": rng.uniform(0, 1, b), "spks": rng.standard_normal((b, 80)),
             "cond": rng.standard_normal((b, 80, size)) * mask}  # fmt: skip
    return {k: v.astype(np.float32) for k, v in feeds.items()}


def test_all_verification_gates_pass(flow, flow_dir: Path) -> None:
    results = verify_flow(flow, flow_dir, seed=3, threads=2)
    # incl. the stream estimator (prompt pass, 2 cached chunks, keep_frames, a whole sentence) and a streamed flow
    assert len(results) == 16
    assert all(r.passed for r in results), "\n".join(str(r) for r in results)


def test_verify_flow_rejects_unknown_keys(flow, flow_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        verify_flow(flow, flow_dir, tolerance={"flow_estimator": 0.1})


def test_artifact_contracts(flow, tmp_path: Path) -> None:
    artifacts = {a.key: a for a in export_flow(flow, tmp_path)}
    enc = artifacts["flow_encoder"]
    assert [(s.name, s.dtype, s.shape) for s in enc.inputs] == [
        ("token", "int64", [1, "tokens"]), ("context", "int64", [1, "context"]),
        ("embedding", "float32", [1, 192]), ("chunk_size", "int64", []),
    ]  # fmt: skip
    assert [(s.name, s.shape) for s in enc.outputs] == [("mu", [1, 80, "frames"]), ("spks", [1, 80])]
    assert enc.attrs["static_chunk_size"] == 25 and enc.attrs["pre_lookahead_len"] == 3
    est = artifacts["flow_estimator"]
    assert [s.name for s in est.inputs] == ["x", "mask", "mu", "t", "spks", "cond"]
    assert est.inputs[0].shape == ["batch", 80, "time"] and est.inputs[3].shape == ["batch"]
    assert [(s.name, s.shape) for s in est.outputs] == [("estimator_out", ["batch", 80, "time"])]
    stream = artifacts["flow_estimator_stream"]
    layers, width = stream.attrs["cache_layers"], stream.attrs["cache_width"]
    channels = stream.attrs["conv_state_channels"]
    assert {s.name: s.shape for s in stream.inputs} == {
        "x": ["batch", 80, "time"], "mu": ["batch", 80, "time"], "t": ["batch"], "spks": ["batch", 80],
        "cond": ["batch", 80, "time"], "prompt_h": [layers, "batch", "prompt_frames", width],
        "context_h": [layers, "batch", "context_frames", width], "conv_state": ["batch", channels, 2],
        "keep_frames": [],
    }  # fmt: skip
    assert [s.name for s in stream.outputs] == ["velocity", "new_h", "new_conv_state"]
    assert stream.outputs[1].shape == [layers, "batch", "kept_frames", width]
    noise = np.load(tmp_path / "flow_noise.npy")
    assert noise.shape == (1, 80, 15000) and noise.dtype == np.float32
    from cosyvoice_cpu.reference.flow.cfm import official_fixed_noise

    assert np.array_equal(noise, official_fixed_noise().numpy())


def test_estimator_dynamic_batch_and_padding(flow, flow_dir: Path) -> None:
    sess = make_session(flow_dir / FILES["flow_estimator"], SessionConfig(threads=2))
    est = flow.decoder.estimator
    rng = np.random.default_rng(0)
    for lengths, size in (([57], 57), ([120, 120], 120), ([150, 99, 150, 40], 150)):
        feeds = _estimator_feeds(rng, lengths, size)
        ours = sess.run(None, feeds)[0]
        with torch.inference_mode():
            ref = est(*(torch.from_numpy(v) for v in feeds.values()))
        assert rel_err(ours, ref.numpy()) < RTOL, (lengths, size)
        for b, n in enumerate(lengths):  # each padded row equals the same row alone, unpadded
            row = {k: v[b : b + 1, :, :n] if v.ndim == 3 else v[b : b + 1] for k, v in feeds.items()}
            assert rel_err(ours[b : b + 1, :, :n], sess.run(None, row)[0]) < RTOL, (lengths, b)
            assert not ours[b, :, n:].any()  # padded frames are zeroed


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("n_ctx", [0, 1, 3])
def test_encoder_streaming_context_matches_reference(flow, stage: CosyVoice2Flow, streaming: bool, n_ctx: int) -> None:
    gen = torch.Generator().manual_seed(n_ctx)
    prompt = torch.randint(0, 6561, (1, 11), generator=gen)
    tokens = torch.randint(0, 6561, (1, 43), generator=gen)
    emb = torch.randn(1, 192, generator=gen)
    ref = flow.encode(tokens, torch.tensor([43]), prompt, torch.tensor([11]), torch.zeros(1, 22, 80), emb,
                      finalize=n_ctx == 0, streaming=streaming)  # fmt: skip
    if n_ctx in (0, 3):  # the reference splits off exactly pre_lookahead_len context tokens
        toks, ctx = (tokens, None) if n_ctx == 0 else (tokens[:, :-n_ctx], tokens[:, -n_ctx:].numpy())
        mu, spks = stage.encode(toks.numpy(), prompt.numpy(), emb.numpy(), ctx, streaming)
        assert mu.shape == ref.mu.shape
        assert rel_err(mu, ref.mu.numpy()) < RTOL and rel_err(spks, ref.spks.numpy()) < RTOL
    else:  # a shorter context: the reference encoder with an explicit context of n_ctx tokens
        with torch.inference_mode():
            xs = flow.input_embedding(torch.cat([prompt, tokens], dim=1))
            h, _ = flow.encoder(xs[:, :-n_ctx], torch.tensor([54]), context=xs[:, -n_ctx:], streaming=streaming)
            ref_mu = flow.encoder_proj(h).transpose(1, 2).numpy()
        toks, ctx = tokens[:, :-n_ctx].numpy(), tokens[:, -n_ctx:].numpy()
        mu, _ = stage.encode(toks, prompt.numpy(), emb.numpy(), ctx, streaming)
        assert rel_err(mu, ref_mu) < RTOL


def test_encoder_relative_shift_is_a_strided_view(flow, flow_dir: Path, stage: CosyVoice2Flow) -> None:
    """The rel shift is a slice/reshape of the padded scores (no expanded int64 index in the graph), equal to its
    definition ``out[i, j] = scores[i, T-1-i+j]`` for every length, one token included (empty strides)."""
    import onnx

    from cosyvoice_cpu.export.flow.cosyvoice2 import EncoderGraph
    from cosyvoice_cpu.reference.flow.encoder import pad_rel_rows, rel_shift

    gen = torch.Generator().manual_seed(0)
    for size in (1, 2, 5, 33):
        scores = torch.randn(2, 3, size, 2 * size - 1, generator=gen)
        index = (size - 1 - torch.arange(size)).unsqueeze(1) + torch.arange(size).unsqueeze(0)  # (T, T)
        want = torch.gather(scores, -1, index.expand(2, 3, size, size))
        padded = pad_rel_rows(scores.transpose(-2, -1)).transpose(-2, -1)  # the zero row becomes a zero column
        assert torch.equal(rel_shift(padded), want), size
    ops = {n.op_type for n in onnx.load(str(flow_dir / FILES["flow_encoder"]), load_external_data=False).graph.node}
    assert "GatherElements" not in ops
    emb = torch.randn(1, 192, generator=gen)
    for size in (1, 2, 7):  # the graph at lengths other than the traced one, a single token included
        token = torch.randint(0, 6561, (1, size), generator=gen)
        with torch.inference_mode():
            ref_mu, _ = EncoderGraph(flow)(token, torch.zeros(1, 0, dtype=torch.int64), emb, torch.tensor(0))
        mu, _ = stage.encoder.run(None, {"token": token.numpy(), "context": np.zeros((1, 0), np.int64),
                                         "embedding": emb.numpy(), "chunk_size": np.array(0, np.int64)})  # fmt: skip
        assert mu.shape == (1, 80, 2 * size) and rel_err(mu, ref_mu.numpy()) < RTOL, size


def test_encoder_attention_in_query_blocks_is_the_same_attention(flow_dir: Path) -> None:
    """Query rows in blocks (what the export traces: ENCODER_QUERY_BLOCKS) give the attention of all rows at once,
    for lengths below the block count (empty blocks) and above, with the full and the chunk-causal masks."""
    import onnx

    from cosyvoice_cpu.export.flow.common import ENCODER_QUERY_BLOCKS
    from cosyvoice_cpu.reference.flow.encoder import RelPositionAttention, chunk_mask, relative_position_encoding

    gen = torch.Generator().manual_seed(0)
    att = RelPositionAttention(4, 32).eval()
    with torch.no_grad():
        att.pos_bias_u.normal_(generator=gen), att.pos_bias_v.normal_(generator=gen)
    for size in (1, 3, 4, 9, 33):
        x, pos = torch.randn(2, size, 32, generator=gen), relative_position_encoding(size, 32)
        keys = torch.ones(2, 1, size, dtype=torch.bool)
        keys[1, 0, -1] = size == 1  # a padded key in row 1 (none to hide with one position)
        for mask in (keys, keys & chunk_mask(size, 2).unsqueeze(0)):
            with torch.no_grad():
                want = att(x, mask, pos)
                att.query_blocks = ENCODER_QUERY_BLOCKS
                got = att(x, mask, pos)
                att.query_blocks = 1
            assert torch.allclose(got, want, rtol=0, atol=1e-6), size
    graph = onnx.load(str(flow_dir / FILES["flow_encoder"]), load_external_data=False).graph
    softmax = sum(n.op_type == "Softmax" for n in graph.node)  # one per block and layer: the export is blocked
    assert ENCODER_QUERY_BLOCKS > 1 and softmax % ENCODER_QUERY_BLOCKS == 0 and softmax >= 2 * ENCODER_QUERY_BLOCKS


@pytest.mark.parametrize("n_timesteps,cfg_rate", [(10, 0.7), (4, 0.0)])
@pytest.mark.parametrize("finalize", [True, False])
def test_stage_inference_matches_reference(flow, stage: CosyVoice2Flow, n_timesteps, cfg_rate, finalize) -> None:
    gen = torch.Generator().manual_seed(n_timesteps)
    prompt = torch.randint(0, 6561, (1, 15), generator=gen)
    tokens = torch.randint(0, 6561, (1, 40), generator=gen)
    emb, feat = torch.randn(1, 192, generator=gen), torch.randn(1, 30, 80, generator=gen)
    ref, _ = flow.inference(tokens, torch.tensor([40]), prompt, torch.tensor([15]), feat, None, emb, False,
                            finalize=finalize, n_timesteps=n_timesteps, cfg_rate=cfg_rate)  # fmt: skip
    toks, ctx = (tokens, None) if finalize else (tokens[:, :-3], tokens[:, -3:].numpy())
    mel = stage.inference(toks.numpy(), prompt.numpy(), feat.numpy(), emb.numpy(), context=ctx,
                          n_timesteps=n_timesteps, cfg_rate=cfg_rate)  # fmt: skip
    assert mel.shape == ref.shape
    assert rel_err(mel, ref.numpy()) < 3e-5


def test_stage_injected_noise_and_batch_solve(flow, stage: CosyVoice2Flow) -> None:
    rng = np.random.default_rng(0)
    mu, cond = rng.standard_normal((2, 80, 64)).astype(np.float32), np.zeros((2, 80, 64), np.float32)
    spks, noise = rng.standard_normal((2, 80)).astype(np.float32), rng.standard_normal((2, 80, 70)).astype(np.float32)
    mel = stage.solve(mu, spks, cond, n_timesteps=3, cfg_rate=0.5, noise=noise)
    with torch.inference_mode():
        ref = flow.decoder(*(torch.from_numpy(a) for a in (mu, np.ones((2, 1, 64), np.float32), spks, cond)), 3, 0.5,
                           noise=torch.from_numpy(noise)).numpy()  # fmt: skip
    assert rel_err(mel, ref) < RTOL
    with pytest.raises(ValueError, match="noise must be"):
        stage.solve(mu, spks, cond, noise=noise[:, :, :10])


def test_whole_sentences_run_on_the_stream_graph(flow_dir: Path) -> None:
    """A stage with the stream graph opens only that one for unpadded whole sentences (one copy of the weights
    in a process that does both modes); the result equals flow_estimator.onnx's; padded rows need the latter."""
    rng = np.random.default_rng(1)
    mu, cond = rng.standard_normal((2, 80, 57)).astype(np.float32), np.zeros((2, 80, 57), np.float32)
    spks, noise = rng.standard_normal((2, 80)).astype(np.float32), rng.standard_normal((1, 80, 57)).astype(np.float32)
    both = CosyVoice2Flow.from_dir(flow_dir, threads=2)
    whole_only = CosyVoice2Flow.from_dir(flow_dir, threads=2, streaming=False)
    mel = both.solve(mu, spks, cond, n_timesteps=3, noise=noise)
    assert set(both._sessions) == {"stream"}
    ref = whole_only.solve(mu, spks, cond, n_timesteps=3, noise=noise)
    assert set(whole_only._sessions) == {"whole"}
    assert rel_err(mel, ref) < 1e-5
    mask = np.ones((2, 1, 57), np.float32)
    mask[1, :, 40:] = 0
    padded = both.solve(mu, spks, cond, mask, n_timesteps=3, noise=noise)
    assert set(both._sessions) == {"stream", "whole"}
    assert rel_err(padded[:1], mel[:1]) < 1e-5 and rel_err(padded[1:, :, :40], mel[1:, :, :40]) > 1e-4


class _Keeping:
    """An estimator session of a backend that keeps (or not) its largest call's working memory; records each
    call's ``release_memory``."""

    def __init__(self, session, keeps: bool) -> None:
        self.session, self.keeps_working_memory, self.released = session, keeps, []

    def get_inputs(self):
        return self.session.get_inputs()

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, names, feeds, release_memory: bool = False):
        self.released.append(release_memory)
        return self.session.run(names, feeds)


@pytest.mark.parametrize("keeps", [True, False])
def test_a_sentence_gives_the_estimator_s_working_memory_back_where_the_backend_keeps_it(
    flow_dir: Path, keeps: bool
) -> None:
    """On a backend that keeps each graph's largest working memory (OpenVINO), the last Euler step of a sentence
    gives it back, so the longest sentence met does not set the process's size; ONNX Runtime's pooled arena is
    left as it was (no call releases)."""
    rng = np.random.default_rng(2)
    mu, cond = rng.standard_normal((1, 80, 33)).astype(np.float32), np.zeros((1, 80, 33), np.float32)
    spks = rng.standard_normal((1, 80)).astype(np.float32)
    stage = CosyVoice2Flow.from_dir(flow_dir, threads=1, streaming=False)
    want = stage.solve(mu, spks, cond, n_timesteps=4)
    session = stage._sessions["whole"] = _Keeping(stage.estimator, keeps)
    np.testing.assert_array_equal(stage.solve(mu, spks, cond, n_timesteps=4), want)
    assert session.released == [False, False, False, keeps]


def test_stage_rejects_bad_inputs_and_graphs(stage: CosyVoice2Flow, flow_dir: Path) -> None:
    with pytest.raises(ValueError, match="at most pre_lookahead_len"):
        stage.encode([1, 2, 3], [], np.zeros(192, np.float32), context=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="embedding must hold 192"):
        stage.encode([1, 2, 3], [], np.zeros(80, np.float32))
    with pytest.raises(ValueError, match="integer ids"):
        stage.encode([[1.5, 2.0]], [], np.zeros(192, np.float32))
    with pytest.raises(ValueError, match="prompt_feat has"):
        stage.inference([1, 2], [3], np.zeros((1, 10, 80), np.float32), np.ones(192, np.float32))
    with pytest.raises(ModelDirError, match="does not have the expected graph contract"):
        CosyVoice2Flow(flow_dir / FILES["flow_estimator"], flow_dir / FILES["flow_estimator"])
    with pytest.raises(ModelDirError, match="missing"):
        CosyVoice2Flow(flow_dir / "nope.onnx", flow_dir / FILES["flow_estimator"])


def test_a_graph_passes_the_check_by_any_of_its_roles_contracts(flow_dir: Path) -> None:
    from cosyvoice_cpu.flow.graphs import ENCODER_IO, ESTIMATOR_IO, open_checked

    encoder = flow_dir / FILES["flow_encoder"]
    assert open_checked(encoder, 1, ESTIMATOR_IO, ENCODER_IO).get_inputs()  # the alternative fits
    with pytest.raises(ModelDirError, match="missing input x"):  # none fits: the first contract's complaint
        open_checked(encoder, 1, ESTIMATOR_IO, ESTIMATOR_IO)


_CPU = read_cpuinfo()
# Without VNNI (an AVX2-only CPU such as a Zen 3 EPYC) ORT's u8s8 GEMM sums pairs of u8 x s8 products in int16
# (vpmaddubsw), which saturates with full 8-bit weights: velocity 8.7-12 % there (0.6-3.6 % with VNNI). That is
# why the recipe quantizes estimators with reduce_range (7-bit weights, exact on every ISA).
_SATURATES = _CPU is not None and _CPU.avx2 and not _CPU.vnni


@pytest.mark.parametrize(
    "reduce_range",
    [
        pytest.param(False, marks=pytest.mark.xfail(_SATURATES, strict=True, reason="u8s8 saturation without VNNI")),
        True,
    ],
)
def test_estimators_survive_dynamic_int8_quantization(flow, flow_dir: Path, reduce_range: bool) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    files = {}
    for key in ("flow_estimator", "flow_estimator_stream"):
        files[key] = f"{key}.int8{'.rr' if reduce_range else ''}.onnx"
        quantize_dynamic(flow_dir / FILES[key], flow_dir / files[key], op_types_to_quantize=["MatMul"],
                         per_channel=True, weight_type=QuantType.QInt8, reduce_range=reduce_range,
                         use_external_data_format=True)  # fmt: skip
    loose = {"estimator": 0.05, "mel": 0.05}  # measured 0.6 % .. 3.6 %
    results = [r for r in verify_flow(flow, flow_dir, files=files, tolerance=loose) if r.graph != "flow_encoder"]
    assert all(r.passed for r in results), "\n".join(str(r) for r in results)
    assert max(r.value for r in results) > 1e-4  # the quantized graphs were really used


def test_flow_stage_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\nimport cosyvoice_cpu.flow.cosyvoice2\n"
            "assert 'onnx' not in sys.modules, 'the runtime must not need the onnx package'\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
