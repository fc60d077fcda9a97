"""Fun-CosyVoice3 flow export (``export.flow.cosyvoice3``) and its torch-free runtime (``flow.cosyvoice3``,
``flow.cosyvoice3_stream``) on the tiny v3 fixture: every gate (fp32 and int8), whole-sentence parity on the v2
``CosyVoice2Flow``, streamed chunks vs the official prefix recompute (``FlowV3.inference(streaming=True,
finalize=...)``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err
from cosyvoice_cpu.export.flow.cosyvoice3 import FILES, export_flow, settings_of, verify_flow
from cosyvoice_cpu.flow.common import ChunkedStream, ChunkPlan
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.flow.cosyvoice3 import CosyVoice3Flow
from cosyvoice_cpu.flow.cosyvoice3_stream import (
    CosyVoice3FlowStream,
    CosyVoice3PromptCache,
    cheapest_prompt_lengths,
    stable_prompt_frames,
)
from cosyvoice_cpu.workshop.parts import load_reference

RTOL = 1e-5  # measured 2.8e-7 .. 5e-7 (fp32 ORT vs torch, whole and streamed flow)


@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory):
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    src = write_fixture(FixtureSpec("cosyvoice3", "tiny", 0), tmp_path_factory.mktemp("fixtures") / "tiny-v3")
    return load_reference(src, stages=("flow",)).flow


@pytest.fixture(scope="module")
def flow_dir(flow, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flow_v3_onnx")
    artifacts = export_flow(flow, out)
    assert [a.key for a in artifacts] == ["flow_encoder", "flow_estimator", "flow_estimator_stream", "flow_time"]
    assert all((out / a.file).is_file() and all((out / d).is_file() for d in a.data) for a in artifacts)
    assert (out / FILES["flow_noise"]).is_file()
    return out


@pytest.fixture(scope="module")
def stage(flow_dir: Path, flow) -> CosyVoice3Flow:
    return CosyVoice3Flow.from_dir(flow_dir, settings=settings_of(flow), threads=2)


def _inputs(flow, n_prompt: int, n_tok: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, flow.config.vocab_size, (1, n_prompt), generator=gen)
    tokens = torch.randint(0, flow.config.vocab_size, (1, n_tok), generator=gen)
    emb = torch.randn(1, 192, generator=gen)
    feat = torch.randn(1, 2 * n_prompt, 80, generator=gen)
    return prompt, tokens, emb, feat


def test_all_verification_gates_pass(flow, flow_dir: Path) -> None:
    results = verify_flow(flow, flow_dir, seed=3, threads=2)
    assert len(results) == 15
    assert all(r.passed for r in results), "\n".join(str(r) for r in results)


def test_int8_estimators_pass_the_recipe_gate(flow, flow_dir: Path, tmp_path: Path) -> None:
    """The recipe's int8 (dynamic, reduce_range) on both estimator graphs, gated with QUANT_TOLERANCE."""
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic
    from cosyvoice_cpu.workshop.export_stages import QUANT_TOLERANCE

    for name in ("flow_encoder.onnx", "flow_encoder.onnx.data", "flow_noise.npy", "flow_time.onnx",
                 "flow_time.onnx.data"):  # fmt: skip
        if (flow_dir / name).exists():
            shutil.copy(flow_dir / name, tmp_path / name)
    for key in ("flow_estimator", "flow_estimator_stream"):
        quantize_int8_dynamic(flow_dir / FILES[key], tmp_path / FILES[key], reduce_range=True)
    results = verify_flow(flow, tmp_path, seed=0, threads=2, tolerance=QUANT_TOLERANCE["flow_estimator:int8"])
    assert all(r.passed for r in results), "\n".join(str(r) for r in results)
    # measured on this fixture: velocity 1.4e-2 .. 2.1e-2, mel 8e-3 .. 1.0e-2
    assert max(r.value for r in results if r.graph == "flow") < 0.03


def test_artifact_contracts(flow, tmp_path: Path) -> None:
    artifacts = {a.key: a for a in export_flow(flow, tmp_path)}
    enc = artifacts["flow_encoder"]
    assert [(s.name, s.dtype, s.shape) for s in enc.inputs] == [
        ("token", "int64", [1, "tokens"]), ("context", "int64", [1, "context"]),
        ("embedding", "float32", [1, 192]), ("chunk_size", "int64", []),
    ]  # fmt: skip
    assert [(s.name, s.shape) for s in enc.outputs] == [("mu", [1, 80, "frames"]), ("spks", [1, 80])]
    assert enc.attrs["chunk_frames"] == 50 and enc.attrs["pre_lookahead_len"] == 3
    est = artifacts["flow_estimator"]
    assert [s.name for s in est.inputs] == ["x", "mask", "mu", "t", "spks", "cond"]
    assert [(s.name, s.shape) for s in est.outputs] == [("estimator_out", ["batch", 80, "time"])]
    stream = artifacts["flow_estimator_stream"]
    layers, width = stream.attrs["cache_layers"], stream.attrs["cache_width"]
    assert (layers, width, stream.attrs["conv_state_frames"]) == (2, 64, 30)
    assert [s.name for s in stream.inputs] == ["x", "mu", "modulation", "spks", "cond", "prompt_k", "prompt_v",
                                               "context_k", "context_v", "conv_state", "offset", "keep_frames",
                                               "chunk_frames"]  # fmt: skip
    columns = (6 * layers + 2) * flow.decoder.estimator.cfg.dim
    assert next(s.shape for s in stream.inputs if s.name == "modulation") == ["time_rows", columns]
    time_graph = artifacts["flow_time"]
    assert [(s.name, s.shape) for s in time_graph.inputs] == [("t", ["steps"])]
    assert [(s.name, s.shape) for s in time_graph.outputs] == [("modulation", ["steps", columns])]
    assert time_graph.attrs["columns"] == columns
    assert [(s.name, s.shape) for s in stream.outputs] == [
        ("velocity", ["batch", 80, "time"]), ("new_k", [layers, "batch", "kept", width]),
        ("new_v", [layers, "batch", "kept", width]), ("conv_in", ["batch", 128, "kept"]),
    ]  # fmt: skip


def test_encoder_ignores_chunk_size(stage: CosyVoice3Flow) -> None:
    tokens = np.arange(1, 30)
    a, _ = stage.encode(tokens, [], np.ones(192, np.float32), streaming=False)
    b, _ = stage.encode(tokens, [], np.ones(192, np.float32), streaming=True)
    assert a.shape == (1, 80, 58) and np.array_equal(a, b)


@pytest.mark.parametrize("n_prompt", [23, 0])
def test_v2_flow_stage_runs_v3_whole_sentences(flow, flow_dir: Path, n_prompt: int) -> None:
    """The unchanged CosyVoice2 ``CosyVoice2Flow`` (no stream graph) on a v3 directory = ``FlowV3.inference``."""
    plain = CosyVoice2Flow.from_dir(flow_dir, settings=settings_of(flow), threads=2, streaming=False)
    prompt, tokens, emb, feat = _inputs(flow, n_prompt, 41, seed=n_prompt)
    ref, _ = flow.inference(tokens, torch.tensor([41]), prompt, torch.tensor([n_prompt]), feat, None, emb)
    mel = plain.inference(tokens.numpy(), prompt.numpy(), feat.numpy(), emb.numpy())
    assert mel.shape == tuple(ref.shape) == (1, 80, 82)
    assert rel_err(mel, ref.numpy()) < RTOL


def test_whole_sentences_run_on_the_stream_graph(flow, flow_dir: Path) -> None:
    """A v3 stage with its stream graph serves whole sentences on it (one copy of the DiT's weights):
    ``flow_estimator.onnx`` is never opened, the mel equals ``FlowV3.inference``; a padded batch opens it."""
    stage = CosyVoice3Flow.from_dir(flow_dir, settings=settings_of(flow), threads=2)
    prompt, tokens, emb, feat = _inputs(flow, 23, 41, seed=5)
    ref, _ = flow.inference(tokens, torch.tensor([41]), prompt, torch.tensor([23]), feat, None, emb)
    mel = stage.inference(tokens.numpy(), prompt.numpy(), feat.numpy(), emb.numpy())
    assert rel_err(mel, ref.numpy()) < RTOL
    assert set(stage._sessions) == {"stream"}
    mu, spks = stage.encode(tokens.numpy(), prompt.numpy(), emb.numpy())
    mu2, cond = np.concatenate([mu, mu]), np.zeros((2, 80, mu.shape[2]), np.float32)
    mask = np.ones((2, 1, mu.shape[2]), np.float32)
    mask[1, :, 60:] = 0
    padded = stage.solve(mu2, np.concatenate([spks, spks]), cond, mask)
    assert set(stage._sessions) == {"stream", "whole"}
    alone = stage.solve(mu, spks, cond[:1])
    assert rel_err(padded[:1], alone) < RTOL


def test_the_time_table_is_made_once_per_schedule_and_its_graph_closed(flow, flow_dir: Path, monkeypatch) -> None:
    """``flow_time.onnx`` runs once per Euler schedule (the table is kept, equal to the reference's time table)
    and its session is dropped at once: a synthesizing process never holds those weights."""
    import weakref

    from cosyvoice_cpu.export.flow.cosyvoice3_stream import DiTRun
    from cosyvoice_cpu.flow import cosyvoice3 as flow_v3

    opened: list[weakref.ref] = []

    def spy(path, *args):
        sess = real(path, *args)
        opened.append(weakref.ref(sess))
        return sess

    real = flow_v3.open_checked
    monkeypatch.setattr(flow_v3, "open_checked", spy)
    stage = CosyVoice3Flow.from_dir(flow_dir, settings=settings_of(flow), threads=2)
    prompt, tokens, emb, feat = _inputs(flow, 23, 41, seed=5)
    for steps in (10, 4, 10):
        stage.inference(tokens.numpy(), prompt.numpy(), feat.numpy(), emb.numpy(), n_timesteps=steps)
    assert len(opened) == 2 and all(ref() is None for ref in opened)  # 10 steps, then 4; both closed
    schedule = stage.schedule(10)
    t = torch.tensor([float(t) for t, _ in schedule])
    ref = DiTRun(flow.decoder.estimator).time_table(t).detach().numpy()
    assert stage.time_table(schedule).shape == ref.shape and rel_err(stage.time_table(schedule), ref) < RTOL
    assert len(opened) == 2


def _official_stream(flow, prompt, tokens, emb, feat, cuts, look=3) -> list[np.ndarray]:
    out = []
    n = tokens.size(1)
    for a, b in cuts:
        final = b == n
        upto = b if final else b + look
        ref, _ = flow.inference(tokens[:, :upto], torch.tensor([upto]), prompt, torch.tensor([prompt.size(1)]), feat,
                                None, emb, streaming=True, finalize=final)  # fmt: skip
        out.append(ref.numpy()[:, :, 2 * a :])
    return out


def _our_stream(fs: CosyVoice3FlowStream, tokens, cuts, look=3) -> list[np.ndarray]:
    n = tokens.size(1)
    return [fs.push(tokens[0, a:b].numpy(), None if b == n else tokens[0, b : b + look].numpy()) for a, b in cuts]


@pytest.mark.parametrize(
    ("n_prompt", "cuts"),
    [
        (75, [(0, 10), (10, 40), (40, 90), (90, 97)]),  # the official 25-token grid after a 3 s prompt
        (40, [(0, 7), (7, 30), (30, 31), (31, 60)]),  # open chunks, a one-token push
        (12, [(0, 5), (5, 44)]),  # short prompt: no prompt chunk is cached
        (0, [(0, 30), (30, 55), (55, 80)]),  # no prompt
    ],
)
def test_stream_equals_official_prefix_recompute(flow, stage: CosyVoice3Flow, n_prompt: int, cuts) -> None:
    prompt, tokens, emb, feat = _inputs(flow, n_prompt, cuts[-1][1], seed=n_prompt + 1)
    fs = CosyVoice3FlowStream(stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy(), context_tokens=None)
    ours = _our_stream(fs, tokens, cuts)
    ref = _official_stream(flow, prompt, tokens, emb, feat, cuts)
    for (a, b), o, r in zip(cuts, ours, ref):
        assert o.shape == r.shape == (1, 80, 2 * (b - a))
        assert rel_err(o, r) < RTOL, (a, b)
    assert fs.finished and fs.frames_done == 2 * cuts[-1][1]
    assert fs.prompt.frames == max(0, n_prompt - 3) * 2 // 50 * 50


def test_the_engines_chunks_end_on_attention_chunks(flow, stage: CosyVoice3Flow) -> None:
    """The engine's chunk plan (``ChunkedStream``) asks the stream for its grid: after the first push, every push
    ends on a 50-frame attention chunk, so no frame is left to compute again, and the chunks still equal the
    official recompute at those cuts. The plain doubling (no grid) leaves frames to recompute in later pushes."""
    prompt, tokens, emb, feat = _inputs(flow, 75, 200, seed=11)
    args = (stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy())

    def pushes(plan: ChunkPlan) -> tuple[list[tuple[int, int]], list[int], np.ndarray]:
        fs = CosyVoice3FlowStream(*args, context_tokens=None)
        chunks = ChunkedStream(fs, plan.first, plan.largest)
        chunks.plan = plan
        cuts, left, mels, t = [], [], [], tokens[0].numpy()
        while (window := chunks.next_window(len(t), False)) is not None:
            mels.append(chunks.render(t, *window))
            cuts.append(window[:2])
            left.append(fs.n_prompt + fs.frames_done - fs.committed)  # returned frames not yet committed
        return cuts, left, np.concatenate(mels, axis=2)

    fs = CosyVoice3FlowStream(*args, context_tokens=None)
    assert fs.grid == (75, 25) and ChunkedStream(fs, 10, 50).plan.grid == (75, 25)
    cuts, left, mel = pushes(ChunkPlan(10, 50, 3, grid=fs.grid))
    assert cuts == [(0, 10), (10, 25), (25, 50), (50, 100), (100, 150)]
    assert left == [20, 0, 0, 0, 0]
    ref = np.concatenate(_official_stream(flow, prompt, tokens[:, :153], emb, feat, cuts), axis=2)
    assert rel_err(mel, ref) < RTOL
    cuts, left, _ = pushes(ChunkPlan(10, 50, 3))
    assert cuts[:4] == [(0, 10), (10, 30), (30, 70), (70, 120)] and left[1:4] == [10, 40, 40]


@pytest.mark.parametrize(("n_prompt", "again"), [(75, 50), (78, 6)])
def test_the_first_push_computes_the_prompts_open_frames_again(
    flow, stage: CosyVoice3Flow, n_prompt: int, again: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first push's window is the prompt frames the prompt cache does not hold (6 for a prompt of 25k + 3
    tokens, up to 54) plus its new frames, at every Euler step; a cache whose voice computes over half a chunk
    again carries the advice the engine logs, with the prompt lengths that would compute least (docs/streaming.md)."""
    prompt, tokens, emb, feat = _inputs(flow, n_prompt, 13, seed=3)
    fs = CosyVoice3FlowStream(stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy(), context_tokens=None)
    assert 2 * n_prompt - fs.prompt.frames == 2 * n_prompt - stable_prompt_frames(n_prompt, 2, 3, 50) == again
    assert cheapest_prompt_lengths(n_prompt, 2, 3, 50) == ((53, 78) if n_prompt == 75 else (78, 103))
    sizes: list[int] = []
    run = fs.sess.run
    monkeypatch.setattr(fs.sess, "run", lambda names, feeds: sizes.append(feeds["x"].shape[2]) or run(names, feeds))
    t = tokens[0].numpy()
    fs.push(t[:10], t[10:13])
    assert sizes == [again + 20] * stage.settings.n_timesteps
    assert fs.prompt.advice == ("its prompt is 75 speech tokens: the first streamed chunk of every request computes 50 "
                                "of the prompt's mel frames again at each Euler step; a prompt of 53 or 78 tokens "
                                "would compute 6 (first audio: docs/streaming.md, \"First audio depends on the "
                                "voice's length\")" if again > 25 else None)  # fmt: skip


def test_a_provisional_complete_chunk_is_not_committed(flow, stage: CosyVoice3Flow) -> None:
    """A push with a short look-ahead completes the chunk [150, 200) with provisional mu (its last token's
    look-ahead is missing): the chunk serves that push only. The next push must equal a stream that never
    computed it (the same committed past, one look-ahead token fewer pushed before)."""
    prompt, tokens, emb, feat = _inputs(flow, 60, 120, seed=9)
    args = (stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy())
    t = tokens[0].numpy()
    a = CosyVoice3FlowStream(*args, context_tokens=None)
    a.push(t[:40], t[40:41])  # window [100, 200): frames up to 196 stable, commit 150
    assert a.committed == 150 and all(k.shape[2] == 50 for k in a.ctx_k)
    # the stage splits its calls by CFG row (2 threads): every cache keeps each row contiguous, so a row's call
    # takes it as a view (backends.row_groups.rows_apart)
    assert stage.stream_estimator.rows_apart
    for cache in (a.prompt.k[0], a.prompt.v[0], a.ctx_k[0], a.ctx_v[0]):
        assert all(cache[:, r].flags.c_contiguous for r in range(2)) and not cache.flags.c_contiguous
    b = CosyVoice3FlowStream(*args, context_tokens=None)
    b.push(t[:38], t[38:41])  # window [100, 196): all stable, commit 150
    assert b.committed == 150
    rest_a, rest_b = a.push(t[40:]), b.push(t[38:])
    assert rest_a.shape == (1, 80, 160) and rest_b.shape == (1, 80, 164)
    assert rel_err(rest_a, rest_b[:, :, 4:]) < RTOL


def test_prompt_cache_is_shared_and_context_bound_is_cheap(flow, stage: CosyVoice3Flow) -> None:
    prompt, tokens, emb, feat = _inputs(flow, 60, 80, seed=7)
    cache = CosyVoice3PromptCache.build(stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy())
    assert cache.frames == 100 and cache.k[0].shape == (2, 2, 100, 64) and cache.nbytes > 0
    cuts = [(0, 10), (10, 40), (40, 80)]
    args = (stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy())
    exact = np.concatenate(_our_stream(CosyVoice3FlowStream(*args, context_tokens=None), tokens, cuts), axis=2)
    shared = CosyVoice3FlowStream(*args, context_tokens=None, prompt_cache=cache)
    again = np.concatenate(_our_stream(shared, tokens, cuts), axis=2)
    assert np.array_equal(exact, again)
    fs = CosyVoice3FlowStream(*args, context_tokens=0, prompt_cache=cache)
    bounded = np.concatenate(_our_stream(fs, tokens, cuts), axis=2)
    assert all(k.shape[2] == 0 for k in fs.ctx_k)  # nothing generated is kept
    assert bounded.shape == exact.shape and np.isfinite(bounded).all()
    assert np.array_equal(bounded[:, :, :20], exact[:, :, :20])  # the first chunk sees only the prompt anyway
    # float16 storage of the keys/values: half the bytes, the same mel up to their rounding
    half = CosyVoice3PromptCache.build(*args, dtype=np.float16)
    assert {a.dtype for a in half.k + half.v} == {np.dtype(np.float16)}
    assert sum(a.nbytes for a in half.k + half.v) * 2 == sum(a.nbytes for a in cache.k + cache.v)
    stream = CosyVoice3FlowStream(*args, context_tokens=None, prompt_cache=half)
    rounded = np.concatenate(_our_stream(stream, tokens, cuts), axis=2)
    assert 0 < rel_err(rounded, exact) < 1e-2, rel_err(rounded, exact)


def test_stream_errors(flow, stage: CosyVoice3Flow, flow_dir: Path) -> None:
    prompt, tokens, emb, feat = _inputs(flow, 10, 20)
    fs = CosyVoice3FlowStream(stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy())
    with pytest.raises(ConfigError, match="pre_lookahead_len"):
        fs.push(tokens[0, :5].numpy(), tokens[0, 5:10].numpy())
    fs.push(tokens[0].numpy())
    with pytest.raises(ConfigError, match="finished"):
        fs.push(tokens[0].numpy())
    plain = CosyVoice2Flow.from_dir(flow_dir, settings=settings_of(flow))
    with pytest.raises(ConfigError, match="CosyVoice3Flow"):
        CosyVoice3FlowStream(plain, prompt.numpy()[0], feat.numpy()[0], emb.numpy())
    with pytest.raises(ConfigError, match="chunk_frames"):
        CosyVoice3Flow.from_dir(flow_dir, settings={"chunk_frames": 25})
    from cosyvoice_cpu.errors import ModelDirError

    paths = [flow_dir / FILES[k] for k in ("flow_encoder", "flow_estimator", "flow_estimator_stream", "flow_noise")]
    with pytest.raises(ModelDirError, match=r"flow_time\.onnx is missing.*export the model directory again"):
        CosyVoice3Flow(*paths, settings=settings_of(flow), time_graph=flow_dir / "nowhere" / "flow_time.onnx")
    CosyVoice3Flow(*paths[:2], None, paths[3], settings=settings_of(flow))  # whole sentences only: not needed


def test_v3_flow_runs_without_torch(flow, flow_dir: Path) -> None:
    code = f"""
import sys; sys.modules['torch'] = None
import numpy as np
from cosyvoice_cpu.flow.cosyvoice3 import CosyVoice3Flow
from cosyvoice_cpu.flow.cosyvoice3_stream import CosyVoice3FlowStream
assert 'onnx' not in sys.modules, 'the runtime must not need the onnx package'
stage = CosyVoice3Flow.from_dir({str(flow_dir)!r}, settings={settings_of(flow)!r})
emb, feat = np.ones(192, np.float32), np.zeros((20, 80), np.float32)
mel = stage.inference(np.arange(30), np.arange(10), feat, emb)
fs = CosyVoice3FlowStream(stage, np.arange(10), feat, emb, context_tokens=25)
parts = [fs.push(np.arange(12), np.arange(12, 15)), fs.push(np.arange(12, 30))]
assert mel.shape == (1, 80, 60) and sum(p.shape[2] for p in parts) == 60
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
