"""The LM graph (GroupQueryAttention, shared KV cache) and its torch-free driver ``cosyvoice_cpu.lm.session``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.export.common import rel_err

MAX_LEN = 64
RTOL = 1e-5  # fp32 graph vs reference measured ~2e-7


@pytest.fixture(scope="module")
def exported(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(reference Qwen2LM, model directory with lm.onnx, GraphArtifact)."""
    from cosyvoice_cpu.export.lm.cosyvoice2 import export_lm
    from cosyvoice_cpu.workshop.parts import load_reference

    lm = load_reference(tiny_model_dir, stages=("lm",)).lm.eval()
    out = tmp_path_factory.mktemp("lm")
    (artifact,) = export_lm(lm, out, max_len=MAX_LEN)
    return lm, out, artifact


@pytest.fixture(scope="module")
def session(exported):
    from cosyvoice_cpu.lm.session import LMSession

    _, out, artifact = exported
    return LMSession.from_dir(out, artifact.attrs, threads=1)


def test_artifact_and_files(exported) -> None:
    lm, out, a = exported
    assert (a.key, a.file, a.data, a.precision) == ("lm", "lm.onnx", ["lm.onnx.data"], "fp32")
    assert a.attrs["max_len"] == MAX_LEN and a.attrs["num_layers"] == 2 and a.attrs["hidden"] == 64
    assert a.attrs["speech_vocab"] == lm.cfg.speech_token_size + 3
    names = {s.name for s in a.inputs}
    assert {"inputs_embeds", "seqlens_k", "total_sequence_length", "past_key_1", "past_value_0"} <= names
    assert a.outputs[0].name == "logp" and a.outputs[0].shape == ["batch", a.attrs["speech_vocab"]]
    assert all(s.doc for s in (*a.inputs, *a.outputs))
    text = np.load(out / a.attrs["embeddings"]["text"], mmap_mode="r")
    assert text.shape == (lm.cfg.qwen.vocab_size, 64)


def test_verify_gates_pass(exported) -> None:
    from cosyvoice_cpu.export.lm.common import FP32_TOLERANCES
    from cosyvoice_cpu.export.lm.cosyvoice2 import verify_lm

    lm, out, _ = exported
    results = verify_lm(lm, out)
    assert {r.check for r in results} == set(FP32_TOLERANCES)
    assert all(r.passed for r in results), "\n".join(map(str, results))
    with pytest.raises(ConfigError, match="unknown LM gate"):
        verify_lm(lm, out, tolerance={"decode": 1.0})


def test_cached_decode_equals_full_recompute(exported, session) -> None:
    """Catches a broken cache (wrong positions, overwritten rows, RoPE offsets) independently of decode_step."""
    import torch

    lm = exported[0]
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((11, 64)).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, lm.cfg.speech_token_size, 9)]
    cache = session.new_cache(1)
    ours = [session.prefill(cache, 0, prompt)] + [session.decode(cache, [0], [t])[0] for t in tokens]
    assert cache.lengths[0] == 11 + len(tokens)
    seq = np.concatenate([prompt, session.embed_speech(tokens)])
    full = lm.forward_full(torch.from_numpy(seq)[None])[0, 10:].numpy()
    assert rel_err(np.stack(ours), full) < RTOL


def test_prefill_appends_to_a_non_empty_row(exported, session) -> None:
    """Two prefill chunks (e.g. a prompt cached per voice, then the request's text) equal one prefill."""
    rng = np.random.default_rng(3)
    prompt = rng.standard_normal((17, 64)).astype(np.float32)
    whole = session.prefill(session.new_cache(1), 0, prompt)
    cache = session.new_cache(1)
    session.prefill(cache, 0, prompt[:9])
    split = session.prefill(cache, 0, prompt[9:])
    assert cache.lengths[0] == 17
    assert rel_err(split, whole) < RTOL


def test_ragged_batch_and_idle_rows_equal_single_rows(session) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.standard_normal((n, 64)).astype(np.float32) for n in (5, 12, 9)]
    tokens = rng.integers(0, 6561, (6, 3))
    plan = [[0, 2], [0, 2], [0, 1, 2], [2, 0], [1], [0, 1, 2]]  # row 1 idle in the middle of the range
    single = []
    for r, p in enumerate(prompts):
        cache = session.new_cache(1)
        out = [session.prefill(cache, 0, p)]
        out += [session.decode(cache, [0], [tokens[k, r]])[0] for k, rows in enumerate(plan) if r in rows]
        single.append(out)
    cache = session.new_cache(3)
    got = [[session.prefill(cache, r, p)] for r, p in enumerate(prompts)]
    for k, rows in enumerate(plan):
        for r, lp in zip(rows, session.decode(cache, rows, [tokens[k, r] for r in rows])):
            got[r].append(lp)
    for r in range(3):
        assert len(got[r]) == len(single[r])
        assert rel_err(np.stack(got[r]), np.stack(single[r])) < RTOL
    assert list(cache.lengths) == [len(p) + len(g) - 1 for p, g in zip(prompts, got)]


def test_empty_idle_row_is_unharmed(session) -> None:
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((n, 64)).astype(np.float32) for n in (6, 8))
    cache = session.new_cache(3)
    session.prefill(cache, 0, a)
    session.prefill(cache, 2, a)
    for t in (7, 8):
        session.decode(cache, [0, 2], [t, t])  # row 1 is empty: its scratch position 0 is written
    assert list(cache.lengths) == [8, 0, 8]
    alone = session.new_cache(1)
    assert rel_err(session.prefill(cache, 1, b), session.prefill(alone, 0, b)) < RTOL
    assert rel_err(session.decode(cache, [1], [9]), session.decode(alone, [0], [9])) < RTOL


def test_input_errors_are_clear(session) -> None:
    cache = session.new_cache(2)
    with pytest.raises(ConfigError, match="shape"):
        session.prefill(cache, 0, np.zeros((3, 65), np.float32))
    with pytest.raises(ConfigError, match="out of range"):
        session.prefill(cache, 2, np.zeros((3, 64), np.float32))
    with pytest.raises(ConfigError, match="speech token ids"):
        session.decode(cache, [0], [6564])
    with pytest.raises(ConfigError, match="distinct rows"):
        session.decode(cache, [0, 0], [1, 2])
    session.prefill(cache, 1, np.zeros((MAX_LEN, 64), np.float32))
    with pytest.raises(ConfigError, match="max_len"):
        session.decode(cache, [1], [3])
    session.prefill(cache, 0, np.zeros((4, 64), np.float32))
    session.decode(cache, [0], [3])  # a full idle row elsewhere does not get in the way
    with pytest.raises(ConfigError, match="max_len"):
        session.prefill(cache, 0, np.zeros((MAX_LEN, 64), np.float32))


def test_mismatched_graph_is_refused(exported, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    from cosyvoice_cpu.lm.session import LMSession

    _, out, artifact = exported
    with pytest.raises(ModelDirError, match=r"missing input past_key_2.*cosyvoice-cpu export"):
        LMSession.from_dir(out, {**artifact.attrs, "num_layers": 3})
    with pytest.raises(ModelDirError, match=r"input past_key_0 is tensor\(float\) \['batch', 2, 64, 16\]"):
        LMSession.from_dir(out, {**artifact.attrs, "head_dim": 64, "kv_heads": 2, "hidden": 64})
    other = tmp_path / "other.onnx"
    vi = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [vi],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), other)
    embeddings = {k: out / v for k, v in artifact.attrs["embeddings"].items()}
    with pytest.raises(ModelDirError, match=r"unexpected input x.*missing input inputs_embeds"):
        LMSession(other, embeddings, artifact.attrs)
    with pytest.raises(ModelDirError, match="lack max_len"):
        LMSession(out / "lm.onnx", embeddings, {"hidden": 64})


def test_quantizers_accept_the_graph(exported) -> None:
    """onnxruntime.quantization's int8 and 4-bit weight quantizers work on the graph as written."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from cosyvoice_cpu.export.lm.cosyvoice2 import compare_lm, verify_lm

    lm, out, _ = exported
    quantize_dynamic(out / "lm.onnx", out / "lm.int8.onnx", op_types_to_quantize=["MatMul"], per_channel=True,
                     weight_type=QuantType.QInt8, reduce_range=True, use_external_data_format=True)  # fmt: skip
    q = MatMulNBitsQuantizer(onnx.load(str(out / "lm.onnx")), block_size=32, is_symmetric=True, accuracy_level=4)
    q.process()
    q.model.save_model_to_file(str(out / "lm.int4.onnx"), use_external_data_format=True)
    for graph, floor in (("lm.int8.onnx", 0.9), ("lm.int4.onnx", 0.6)):  # tiny measured: 0.985 (8-bit, VNNI), 0.845
        m = compare_lm(lm, out, graph, steps=24)
        assert m["agreement"] >= floor and m["mean_kl"] < 0.01, m
    results = verify_lm(lm, out, graph_file="lm.int8.onnx", tolerance={"logp": 0.05})
    assert all(r.passed for r in results), "\n".join(map(str, results))
    assert {r.check: r.tolerance for r in results}["decode_logp"] == 0.05


def test_int4_lone_rows_run_beside_an_idle_row(exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``int4`` graph says ``min_rows=2``, so a lone row (decode or a 1-position prefill) runs in a 2-row call,
    on the many-row 4-bit kernel, and gets the same bits alone as beside other rows. (AVX2's one-row kernel rounds
    differently: the full-size int4 LM's batched rows differed from lone ones by 1.9e-3 on an AMD Zen 3.)"""
    from cosyvoice_cpu.export.quantize import quantize_nbits
    from cosyvoice_cpu.lm.kv_cache import KVCache
    from cosyvoice_cpu.lm.session import LMSession
    from cosyvoice_cpu.lm_files import MIN_ROWS_KEY

    _, out, artifact = exported
    quantize_nbits(out / "lm.onnx", out / "lm.q4.onnx", bits=4, metadata={MIN_ROWS_KEY: "2"})
    s4 = LMSession.from_dir(out, artifact.attrs, graph_file="lm.q4.onnx", threads=2)
    assert s4.min_rows == 2 and LMSession.from_dir(out, artifact.attrs, threads=1).min_rows == 1
    calls: list[tuple[int, int]] = []
    real = s4.runner._run
    monkeypatch.setattr(s4.runner, "_run", lambda cache, r0, embeds, *a, **k: calls.append(embeds.shape[:2])
                        or real(cache, r0, embeds, *a, **k))  # fmt: skip
    rng = np.random.default_rng(5)
    prompts = [rng.standard_normal((n, 64)).astype(np.float32) for n in (7, 12, 4)]
    tokens = rng.integers(0, 6561, (5, 3))
    alone = []
    for r, p in enumerate(prompts):
        cache = s4.new_cache(1)
        assert cache.rows == 1 and len(cache.lengths) == 2  # one spare row to pad with
        out_r = [s4.prefill(cache, 0, p[:1]), s4.prefill(cache, 0, p[1:])]
        out_r += [s4.decode(cache, [0], [t])[0] for t in tokens[:, r]]
        assert list(cache.lengths) == [len(p) + len(tokens), 0]
        alone.append(np.stack(out_r))
        with pytest.raises(ConfigError, match="row 1 is out of range"):
            s4.decode(cache, [1], [0])
    assert all(b * s >= 2 for b, s in calls) and (2, 1) in calls
    cache = s4.new_cache(3)
    got = [[s4.prefill(cache, r, p[:1]), s4.prefill(cache, r, p[1:])] for r, p in enumerate(prompts)]
    for k in range(len(tokens)):
        for r, lp in enumerate(s4.decode(cache, [0, 1, 2], tokens[k])):
            got[r].append(lp)
    for r in range(3):  # bit for bit
        assert np.array_equal(np.stack(got[r]), alone[r]), float(np.abs(np.stack(got[r]) - alone[r]).max())
    cache = s4.new_cache(3)  # a lone last row is padded with the row before it, which keeps its positions
    s4.prefill(cache, 1, prompts[0])
    s4.prefill(cache, 2, prompts[1][:1])
    s4.prefill(cache, 2, prompts[1][1:])
    before = [k[1, :, : len(prompts[0])].copy() for k in cache.keys]
    assert np.array_equal(s4.decode(cache, [2], [int(tokens[0, 1])])[0], alone[1][2])
    assert list(cache.lengths) == [0, len(prompts[0]), len(prompts[1]) + 1]
    assert all(np.array_equal(k[1, :, : len(prompts[0])], b) for k, b in zip(cache.keys, before))
    with pytest.raises(ConfigError, match="at least 2 rows per call"):
        s4.decode(KVCache(s4.spec, 1), [0], [0])


def test_fp16_tables_are_widened(exported, tmp_path: Path) -> None:
    from cosyvoice_cpu.lm.session import LMSession

    _, out, artifact = exported
    tables = {}
    for key, name in artifact.attrs["embeddings"].items():
        tables[key] = tmp_path / name
        np.save(tables[key], np.load(out / name).astype(np.float16))
    s16 = LMSession(out / "lm.onnx", tables, artifact.attrs, threads=1)
    s32 = LMSession.from_dir(out, artifact.attrs, threads=1)
    e16, e32 = s16.embed_text([5, 7]), s32.embed_text([5, 7])
    assert e16.dtype == np.float32 and 0 < rel_err(e16, e32) < 1e-3


def test_runtime_runs_without_torch(exported) -> None:
    _, out, artifact = exported
    code = (
        "import sys, json; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from cosyvoice_cpu.lm.session import LMSession\n"
        f"s = LMSession.from_dir(r'{out}', json.loads(sys.argv[1]), threads=1)\n"
        "c = s.new_cache(1)\n"
        "e = np.concatenate([s.special('sos')[None], s.embed_text([1, 2, 3]), s.special('task_id')[None]])\n"
        "lp = s.prefill(c, 0, e)\n"
        "lp = s.decode(c, [0], [int(lp.argmax())])\n"
        "assert lp.shape == (1, 6564) and abs(np.exp(lp).sum() - 1) < 1e-4\n"
        "assert 'onnx' not in sys.modules and sys.modules['torch'] is None\n"
    )
    r = subprocess.run([sys.executable, "-c", code, json.dumps(artifact.attrs)], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
