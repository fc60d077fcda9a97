"""Streaming: incremental chunk-causal flow, chunk plan, seamless vocoder joins, streamed Engine output.

Tolerances (tiny fixture, fp32 export; measured values in brackets, see docs/streaming.md):
- incremental flow (cached prompt and context activations, unbounded context) vs the reference solver over all
  frames at once with the same chunk-causal ids: rel 1e-5 [3e-7];
- bounded context (50 tokens) vs unbounded: mel L1 0.01; the error shrinks as the context grows [see print];
- a vocoder that is a local function of the mel streams to exactly its one-shot output (no dropped, doubled or
  misaligned samples at joins; the cross-fade weights sum to 1);
- the real HiFT streamed vs one-shot on the same mel: log-mel L1 of the audio below that between two one-shot
  runs with different source-noise seeds [0.16 vs 0.19], and no join among the 0.1 % largest sample steps.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.common import ChunkPlan
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream
from cosyvoice_cpu.vocoder.overlap_stream import VocoderStream, crossfade_weights
from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
from tests.export.onnx_nodes import nbits_accuracy


@pytest.fixture(scope="module")
def fp32_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "fp32"
    export_model(tiny_model_dir, out, ExportOptions(recipe="fp32", verify=False, max_len=512))
    return out


@pytest.fixture(scope="module")
def engine(fp32_dir: Path) -> Engine:
    return Engine.load(fp32_dir, EngineConfig(threads=2))


def _inputs(n_prompt: int = 40, n_tok: int = 170, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 6561, n_prompt), rng.integers(0, 6561, n_tok),
            (0.5 * rng.standard_normal((2 * n_prompt, 80))).astype(np.float32),
            rng.standard_normal(192).astype(np.float32))  # fmt: skip


def _stream(
    stage: CosyVoice2Flow, context: int | None, sizes: tuple[int, ...] = (15, 30, 50)
) -> tuple[np.ndarray, CosyVoice2FlowStream]:
    prompt, toks, feat, emb = _inputs()
    fs = CosyVoice2FlowStream(stage, prompt, feat, emb, context_tokens=context)
    plan = ChunkPlan(sizes[0], sizes[-1], fs.lookahead)
    mels = []
    while plan.ready(len(toks)):
        a, b = plan.cut()
        mels.append(fs.push(toks[a:b], toks[b : b + fs.lookahead]))
        assert mels[-1].shape == (1, 80, 2 * (b - a))
    mels.append(fs.push(toks[plan.offset :], None))
    with pytest.raises(ConfigError, match="finished"):
        fs.push(toks[:3], None)
    return np.concatenate(mels, axis=2), fs


def test_chunk_plan_grows_and_waits_for_the_lookahead() -> None:
    plan = ChunkPlan(15, 50, 3)
    assert not plan.ready(17) and plan.ready(18)
    cuts = []
    while plan.ready(200):
        cuts.append(plan.cut())
    assert cuts[:4] == [(0, 15), (15, 45), (45, 95), (95, 145)]
    assert plan.offset == 195 and not plan.ready(200)  # the rest (5 tokens) is the final chunk
    with pytest.raises(ConfigError):
        ChunkPlan(20, 10, 3)


def test_chunk_plan_moves_later_chunks_onto_the_flows_grid() -> None:
    """Fun-CosyVoice3's attention chunks are 25 tokens from the prompt's start: chunks after the first end on
    their boundaries (phase = the prompt's tokens), so no push leaves a chunk half done for the next one."""

    def cuts(plan: ChunkPlan, available: int = 400) -> list[tuple[int, int]]:
        out = []
        while plan.ready(available):
            out.append(plan.cut())
        return out

    assert cuts(ChunkPlan(10, 50, 3, grid=(75, 25)))[:5] == [(0, 10), (10, 25), (25, 50), (50, 100), (100, 150)]
    assert cuts(ChunkPlan(10, 50, 3, grid=(80, 25)))[:4] == [(0, 10), (10, 20), (20, 45), (45, 95)]
    # no grid line in the back half of a planned chunk: as planned (a chunk never grows), the next one aligns
    assert cuts(ChunkPlan(10, 50, 3, grid=(81, 25)))[:4] == [(0, 10), (10, 30), (30, 69), (69, 119)]
    assert cuts(ChunkPlan(5, 20, 3, grid=(0, 25)))[:5] == [(0, 5), (5, 15), (15, 25), (25, 45), (45, 65)]
    for phase in range(25):  # the default plan, any voice length: from the third chunk on, all on the grid
        got = cuts(ChunkPlan(10, 50, 3, grid=(phase, 25)))
        assert all((phase + end) % 25 == 0 for _, end in got[2:]), (phase, got)
        planned = [10, 20, 40] + [50] * len(got)
        assert all(end - start <= size for (start, end), size in zip(got, planned)), (phase, got)  # none grows
    assert cuts(ChunkPlan(10, 50, 3)) == cuts(ChunkPlan(10, 50, 3, grid=None))  # CosyVoice2: plain doubling
    assert cuts(ChunkPlan(10, 50, 3))[:4] == [(0, 10), (10, 30), (30, 70), (70, 120)]
    with pytest.raises(ConfigError, match="grid"):
        ChunkPlan(10, 50, 3, grid=(0, 0))


def test_incremental_flow_equals_the_one_shot_chunk_causal_solve(engine: Engine, tiny_model_dir: Path) -> None:
    import torch

    from cosyvoice_cpu.workshop.parts import load_reference

    mel, fs = _stream(engine.flow, None)
    n_prompt = fs.n_prompt
    mu = np.concatenate([fs.prompt.mu, fs.ctx_mu], axis=2)  # unbounded: the context holds every frame
    cond = np.zeros_like(mu)
    cond[0, :, :n_prompt] = _inputs()[2].T
    sizes = [15, 30, 50, 50, 25]  # the chunk plan for 170 tokens: 15, 30, 50, 50, then the rest
    ids = np.concatenate([np.zeros(n_prompt, np.int64), *[np.full(2 * n, i + 1) for i, n in enumerate(sizes)]])
    decoder = load_reference(tiny_model_dir, ("flow",)).flow.decoder
    with torch.inference_mode():
        one_shot = decoder(
            torch.from_numpy(mu),
            torch.ones(1, 1, mu.shape[2]),
            torch.from_numpy(fs.prompt.spks),
            torch.from_numpy(cond),
            streaming=True,
            chunk_id=torch.from_numpy(ids)[None],
        ).numpy()
    one_shot = one_shot[:, :, n_prompt:]
    assert mel.shape == one_shot.shape == (1, 80, 340)
    err = np.abs(mel - one_shot).max() / np.abs(one_shot).max()
    print(f"incremental vs one-shot: rel {err:.2e}")
    assert err < 1e-5


def test_prompt_cache_is_shared_and_changes_nothing(engine: Engine, fp32_dir: Path, tmp_path: Path) -> None:
    voice = _voice(engine, tmp_path)
    config = SynthesisConfig(seed=2, normalize=False, stream=True, first_chunk_tokens=10)
    caches = engine.prompt_caches
    hits, misses = caches.hits, caches.misses
    first = engine.synthesize_wav("One two three.", voice, config)
    second = engine.synthesize_wav("One two three.", voice, config)
    assert caches.misses == misses + 1 and caches.hits == hits + 1  # built once, reused
    assert np.array_equal(first, second)
    engine.synthesize_wav("One.", voice, config.with_(flow_steps=3))  # other settings: another entry
    assert caches.misses == misses + 2
    uncached = Engine.load(fp32_dir, EngineConfig(threads=2, prompt_cache_mb=0))
    assert np.array_equal(uncached.synthesize_wav("One two three.", voice, config), first)
    assert uncached.prompt_caches.nbytes == 0
    # kept by none, built once per request: a request's sentences, and a text stream's passages, share it
    from cosyvoice_cpu.text import prepare

    misses = uncached.prompt_caches.misses
    text = "The pump on line three is running hot and the valve beside it is stuck open again, so send someone. " * 3
    assert len(list(prepare(text, uncached.tokenizer, normalize=False))) == 2  # two sentences of the LM
    uncached.synthesize_wav(text, voice, config)
    assert uncached.prompt_caches.misses == misses + 1
    stream = uncached.open_text_stream(voice, config)
    for piece in ["One two three. ", "Four five six seven. ", "Eight nine."]:
        stream.feed(piece)
    stream.close()
    passages = {c.text for c in stream if len(c.samples)}
    assert len(passages) >= 2, passages  # spoken as more than one passage, each asking for the voice's cache
    assert uncached.prompt_caches.misses == misses + 2 and uncached.prompt_caches.nbytes == 0
    # float16 storage: half the bytes, the same audio up to the rounding of the cached activations
    half = Engine.load(fp32_dir, EngineConfig(threads=2, prompt_cache_fp16=True))
    wave = half.synthesize_wav("One two three.", voice, config)
    key = next(k for k in half.prompt_caches._items if k[0] == voice.fingerprint)
    h16, h32 = half.prompt_caches._items[key].h, caches._items[key].h
    assert {a.dtype for a in h16} == {np.dtype(np.float16)} and {a.dtype for a in h32} == {np.dtype(np.float32)}
    assert sum(a.nbytes for a in h16) * 2 == sum(a.nbytes for a in h32)
    err = np.linalg.norm(wave - first) / np.linalg.norm(first)
    print(f"float16 prompt cache: wave rel err {err:.2e}")
    assert 0 < err < 2e-2


def test_int8_stream_graph_takes_float16_caches(fp32_dir: Path, tmp_path: Path) -> None:
    """The int8 recipes' stream graph takes and returns its caches in float16 (half_cache_io): the prompt cache
    and the context take half the memory, whole sentences still run on it, and streamed mel moves by the
    rounding of the cached activations only (against the same int8 graph with float32 caches)."""
    import shutil

    from cosyvoice_cpu.export.flow.common import half_cache_io
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic
    from cosyvoice_cpu.flow.cosyvoice2 import FILES
    from cosyvoice_cpu.flow.graphs import cache_dtype

    src = fp32_dir / FILES["flow_estimator_stream"]
    wide, half = tmp_path / "wide.onnx", tmp_path / "half.onnx"
    quantize_int8_dynamic(src, wide, reduce_range=True)
    shutil.copy(wide, half)
    shutil.copy(f"{wide}.data", f"{half}.data")
    half_cache_io(half, ("prompt_h", "context_h"), ("new_h",))
    stages = [CosyVoice2Flow(fp32_dir / FILES["flow_encoder"], fp32_dir / FILES["flow_estimator"], g,
                        fp32_dir / FILES["flow_noise"], threads=2) for g in (wide, half)]  # fmt: skip
    assert [cache_dtype(st.stream_estimator) for st in stages] == [np.float32, np.float16]
    (mel32, fs32), (mel16, fs16) = (_stream(st, 25) for st in stages)
    assert fs16.prompt.nbytes < 0.6 * fs32.prompt.nbytes and fs16.ctx_h[0].dtype == np.float16
    err = np.abs(mel16 - mel32).max() / np.abs(mel32).max()
    print(f"float16 caches vs float32 caches (same int8 graph): mel rel {err:.2e}")
    assert 0 < err < 1e-2
    prompt, toks, feat, emb = _inputs()
    whole = [st.inference(toks, prompt, feat, emb) for st in stages]  # empty float16 caches, keep_frames = 0
    assert np.array_equal(whole[0], whole[1])


def test_split_rows_stream_as_one_call_does(fp32_dir: Path, tmp_path: Path) -> None:
    """The stream estimator's CFG rows as two calls at once (``split_rows``, the default) against one call:
    the fp32 graph's mel up to kernel rounding; the int8 graph's (one activation scale per call, so one per row
    there) no farther from the fp32 mel than the one-call int8 mel is."""
    from cosyvoice_cpu.backends.row_groups import RowGroupSession
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic
    from cosyvoice_cpu.flow.cosyvoice2 import FILES

    int8 = tmp_path / "int8.onnx"
    quantize_int8_dynamic(fp32_dir / FILES["flow_estimator_stream"], int8, reduce_range=True)
    mels = {}
    for name, graph in (("fp32", fp32_dir / FILES["flow_estimator_stream"]), ("int8", int8)):
        for split in (True, False):
            stage = CosyVoice2Flow(fp32_dir / FILES["flow_encoder"], fp32_dir / FILES["flow_estimator"], graph,
                                   fp32_dir / FILES["flow_noise"], threads=2)  # fmt: skip
            stage.split_rows = split
            mels[name, split], fs = _stream(stage, 25)
            assert isinstance(stage.stream_estimator, RowGroupSession) == split
            # the caches as the session takes them without a copy: each CFG row contiguous where the rows split
            for cache in (fs.prompt.h[0], fs.ctx_h[0]):
                assert cache[:, 1].flags.c_contiguous == split and cache.flags.c_contiguous != split
    rel = {k: float(np.abs(m - mels["fp32", False]).max() / np.abs(mels["fp32", False]).max()) for k, m in mels.items()}
    print(f"mel rel to the fp32 one-call stream: {rel}")
    assert rel["fp32", True] < 1e-4  # measured: bitwise equal here
    assert not np.array_equal(mels["int8", True], mels["int8", False])  # the split ran: its own scales per row
    assert rel["int8", True] < 1.25 * rel["int8", False]


def test_bounded_context_is_close_and_converges(engine: Engine) -> None:
    full, _ = _stream(engine.flow, None)
    errors = {ctx: float(np.abs(_stream(engine.flow, ctx)[0] - full).mean()) for ctx in (0, 10, 50)}
    print("mel L1 vs unbounded context by context tokens:", errors)
    assert errors[50] < 0.01
    assert errors[50] < errors[10] < errors[0]


class _LocalVocoder:
    """A stand-in HiFT whose sample n depends only on mel frame n // 480 (so joins can be checked exactly)."""

    class source_cfg:
        upsample = 480

    def __call__(self, mel: np.ndarray, rng=None, cache_source=None):
        wave = np.repeat(mel[:, 0, :] + 0.1 * mel[:, 1, :], 480, axis=1).astype(np.float32)
        return wave, wave[:, None, :]


def test_vocoder_stream_joins_are_exact_for_a_local_vocoder() -> None:
    fade_in, fade_out = crossfade_weights(64)
    assert np.allclose(fade_in + fade_out, 1.0) and fade_in[0] < 0.01 and fade_in[-1] > 0.99
    mel = np.random.default_rng(1).standard_normal((1, 80, 157)).astype(np.float32)
    voc = _LocalVocoder()
    stream = VocoderStream(voc, np.random.default_rng(0))  # type: ignore[arg-type]
    bounds = [0, 5, 30, 90, 157]  # a first chunk shorter than the 8-frame overlap is held back whole
    out = [stream.push(mel[:, :, a:b], final=b == 157) for a, b in itertools.pairwise(bounds)]
    assert len(out[0]) == 0
    np.testing.assert_allclose(np.concatenate(out), voc(mel)[0][0], atol=1e-6)


def _log_mel(wave: np.ndarray) -> np.ndarray:
    from cosyvoice_cpu.audio.features import matcha_mel

    return matcha_mel(wave.astype(np.float32))


def test_streamed_hift_matches_one_shot_and_joins_are_continuous(engine: Engine) -> None:
    rng = np.random.default_rng(3)
    mel = np.cumsum(rng.standard_normal((1, 80, 200)).astype(np.float32) * 0.3, axis=2) / 6 - 3  # smooth-ish
    one_shot = engine.vocoder(mel, rng=np.random.default_rng(0))[0][0]
    stream = VocoderStream(engine.vocoder, np.random.default_rng(0))
    bounds = [0, 30, 90, 200]
    pieces = [stream.push(mel[:, :, a:b], final=b == 200) for a, b in itertools.pairwise(bounds)]
    wave = np.concatenate(pieces)
    assert wave.shape == one_shot.shape
    err = float(np.abs(_log_mel(wave) - _log_mel(one_shot)).mean())
    jumps = np.abs(np.diff(wave))
    joins = np.cumsum([len(p) for p in pieces[:-1]])
    at_joins = max(jumps[j - 2 : j + 2].max() for j in joins)
    print(f"streamed vs one-shot HiFT: log-mel L1 {err:.3f}; largest jump at a join {at_joins:.4f}, "
          f"99.9th percentile of all jumps {np.quantile(jumps, 0.999):.4f}")  # fmt: skip
    other_seed = engine.vocoder(mel, rng=np.random.default_rng(1))[0][0]
    floor = float(np.abs(_log_mel(other_seed) - _log_mel(one_shot)).mean())
    print(f"  (one-shot with another source-noise seed differs by log-mel L1 {floor:.3f})")
    assert err < floor  # streaming changes the audio less than the vocoder's own randomness does
    assert at_joins <= np.quantile(jumps, 0.999)  # no click: a join is not among the 0.1 % largest steps


def _voice(engine: Engine, tmp_path: Path):
    t = np.arange(16000 * 3) / 16000
    sf.write(tmp_path / "p.wav", (0.3 * np.sin(2 * np.pi * 190 * t)).astype(np.float32), 16000)
    return engine.make_voice(tmp_path / "p.wav", "Good morning everyone.", name="p")


def test_engine_streams_a_sentence_in_growing_chunks_close_to_whole_sentence_output(
    engine: Engine, tmp_path: Path
) -> None:
    voice = _voice(engine, tmp_path)
    text = "Hello there, how are you doing today"
    whole = engine.synthesize_wav(text, voice, SynthesisConfig(seed=4, normalize=False))
    chunks = list(engine.synthesize(text, voice, SynthesisConfig(seed=4, normalize=False, stream=True,
                                                                 first_chunk_tokens=10, chunk_tokens=20)))  # fmt: skip
    assert len(chunks) >= 3 and [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c.text == text for c in chunks)
    streamed = np.concatenate([c.samples for c in chunks])
    assert streamed.shape == whole.shape  # the same tokens (the LM's draws do not depend on streaming)
    assert len(chunks[0].samples) < len(streamed) / 3
    err = float(np.abs(_log_mel(streamed) - _log_mel(whole)).mean())
    print(f"engine streamed vs whole sentence: {len(chunks)} chunks, log-mel L1 {err:.3f}")
    assert err < 0.3


def test_streaming_needs_the_chunk_estimator(fp32_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(fp32_dir, EngineConfig(threads=1, streaming_estimator=False))
    voice = _voice(engine, tmp_path)
    with pytest.raises(ConfigError, match="streaming_estimator"):
        engine.synthesize("Hello", voice, SynthesisConfig(stream=True))
    with pytest.raises(ConfigError, match="streaming_estimator"):
        CosyVoice2FlowStream(engine.flow, voice.speech_tokens, voice.mel, voice.embedding)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        SynthesisConfig(first_chunk_tokens=30, chunk_tokens=20).validate()


def test_the_encoder_forms_probe_times_every_weight_form(fp32_dir: Path, tmp_path: Path) -> None:
    """``bench/encoder_forms.py`` (how the int8w encoder's compute was chosen) quantizes the fp32 encoder into every
    form and times each at chunk and whole-sentence token counts; fp32 is its own reference."""
    script = Path(__file__).resolve().parents[2] / "bench" / "encoder_forms.py"
    out = subprocess.run([sys.executable, str(script), str(fp32_dir), "--tokens", "12", "--whole", "20", "--runs", "1",
                          "--work", str(tmp_path)], check=True, capture_output=True, text=True).stdout  # fmt: skip
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 12 ") or line.startswith("| 20 ")]
    assert [r[0] for r in rows] == ["| 12 (+ 3)", "| 20 (+ 0)"]
    for row in rows:
        errors = [float(cell.split("mu error ")[1].rstrip(") |")) for cell in row[1:]]
        assert len(errors) == 4 and errors[0] == 0 and all(0 < e < 0.1 for e in errors[1:]), row
    import onnx

    for level in (1, 4):  # the forms are what their labels say
        assert nbits_accuracy(tmp_path / f"int8w_acc{level}" / "flow_encoder.onnx") == {level}
    dynamic = onnx.load(str(tmp_path / "int8_dynamic" / "flow_encoder.onnx"), load_external_data=False).graph
    assert any(n.op_type == "DynamicQuantizeLinear" for n in dynamic.node)
