"""The LM as an OpenVINO stateful model (``cosyvoice_cpu.export.lm.openvino_stateful``) on the tiny fixture: the
reference's greedy tokens, rows of different lengths in one state, rows dropped by ``beam_idx``, a state copied
into a fresh request (what a prefix cache does), and NNCF int8 weights within a stated tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err

pytest.importorskip("openvino")

STEPS = 12
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": 1}
RTOL = 1e-5  # fp32 weights, f32 inference: measured 1.7e-7 against the reference
INT8_RTOL = 0.05  # NNCF INT8_ASYM weights, f32 inference, tiny fixture: measured 1.6e-3, 11 of 13 argmax equal
INT4_RTOL = 0.05  # NNCF INT4_SYM, groups of 64 (int4_group), f32 inference, tiny fixture: measured 5.3e-3, 12 of 13


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path):
    from cosyvoice_cpu.workshop.parts import load_reference

    return load_reference(tiny_model_dir, stages=("lm",)).lm.eval()


def _compile(lm, tmp: Path, weights: str):
    from cosyvoice_cpu.backends.openvino import import_openvino
    from cosyvoice_cpu.export.lm.openvino_stateful import export_stateful_lm

    path = export_stateful_lm(lm, tmp, weights=weights)
    return import_openvino().Core().compile_model(path, "CPU", F32)


@pytest.fixture(scope="module")
def compiled(lm, tmp_path_factory: pytest.TempPathFactory):
    return _compile(lm, tmp_path_factory.mktemp("ov_lm"), "none")


def _feed(embeds: np.ndarray, mask: np.ndarray, positions: np.ndarray, beam: np.ndarray) -> dict:
    return {
        "inputs_embeds": np.asarray(embeds, np.float32),
        "attention_mask": np.asarray(mask, np.int64),
        "position_ids": np.asarray(positions, np.int64),
        "beam_idx": np.asarray(beam, np.int32),
    }


def _run_alone(req, embeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One row: prefill embeds (T, D), then one position per row of steps (K, D); logp (K + 1, V)."""
    req.reset_state()
    n = len(embeds)
    out = [req.infer(_feed(embeds[None], np.ones((1, n)), np.arange(n)[None], [0]))["logp"][0].copy()]
    for k, x in enumerate(steps):
        feed = _feed(x[None, None], np.ones((1, n + k + 1)), [[n + k]], [0])
        out.append(req.infer(feed)["logp"][0].copy())
    return np.stack(out)


def _greedy_vs_reference(lm, compiled) -> tuple[list[int], list[int], float]:
    """(reference greedy tokens, ours fed the reference's, max logp rel err) over a 25-position prompt."""
    import torch

    torch.manual_seed(0)
    emb = torch.randn(1, 25, lm.cfg.qwen.hidden_size)
    ref = [lm.prefill(emb, 25 + STEPS + 1).numpy()]
    tokens = []
    for k in range(STEPS):
        tokens.append(int(ref[-1].argmax()))
        ref.append(lm.decode_step(tokens[-1], 25 + k).numpy())
    steps = lm.speech_embedding.weight[torch.tensor(tokens)].detach().numpy()
    ours = _run_alone(compiled.create_infer_request(), emb[0].numpy(), steps)
    err = max(rel_err(o, r) for o, r in zip(ours, ref))
    return [int(r.argmax()) for r in ref], [int(o.argmax()) for o in ours], err


def test_greedy_tokens_equal_the_reference(lm, compiled) -> None:
    ref, ours, err = _greedy_vs_reference(lm, compiled)
    assert ours == ref
    assert err < RTOL


def test_fun_cosyvoice3s_lm_gives_the_reference_greedy_tokens(tiny_v3_model_dir: Path, tmp_path: Path) -> None:
    """The same graph module over Fun-CosyVoice3's LM (its head wider than the speech table, no head bias)."""
    from cosyvoice_cpu.workshop.parts import load_reference

    v3 = load_reference(tiny_v3_model_dir, stages=("lm",)).lm.eval()
    ref, ours, err = _greedy_vs_reference(v3, _compile(v3, tmp_path, "none"))
    assert ours == ref
    assert err < RTOL


def test_contract_names(compiled) -> None:
    assert [p.get_any_name() for p in compiled.inputs] == [
        "inputs_embeds",
        "attention_mask",
        "position_ids",
        "beam_idx",
    ]
    assert [p.get_any_name() for p in compiled.outputs] == ["logp"]
    assert len(compiled.create_infer_request().query_state()) == 2 * 2  # 2 layers, keys and values


def test_rows_of_different_lengths_share_one_state(lm, compiled) -> None:
    """Two rows prefilled alone, their states left-padded into one batch: every step gives each row its lone
    logp; then beam_idx drops row 0 and row 1 goes on alone."""
    from cosyvoice_cpu.backends.openvino import import_openvino

    ov = import_openvino()
    rng = np.random.default_rng(1)
    d, lens = lm.cfg.qwen.hidden_size, (21, 14)
    prompts = [rng.standard_normal((n, d)).astype(np.float32) for n in lens]
    steps = [rng.standard_normal((5, d)).astype(np.float32) for _ in lens]
    alone, states = [], []
    for p, s in zip(prompts, steps):
        req = compiled.create_infer_request()
        alone.append(_run_alone(req, p, s[:0]))
        states.append({st.name: st.state.data.copy() for st in req.query_state()})
        alone[-1] = _run_alone(req, p, s)
    req, width = compiled.create_infer_request(), max(lens)
    for st in req.query_state():
        padded = [np.pad(s[st.name], ((0, 0), (0, 0), (width - n, 0), (0, 0))) for s, n in zip(states, lens)]
        st.state = ov.Tensor(np.concatenate(padded))
    mask = np.array([[0] * (width - n) + [1] * n for n in lens])
    for k in range(4):
        mask = np.pad(mask, ((0, 0), (0, 1)), constant_values=1)
        x = np.stack([steps[0][k], steps[1][k]])[:, None]
        logp = req.infer(_feed(x, mask, [[lens[0] + k], [lens[1] + k]], [0, 1]))["logp"]
        for row in range(2):
            assert rel_err(logp[row], alone[row][k + 1]) < 1e-6
    mask = np.pad(mask[1:], ((0, 0), (0, 1)), constant_values=1)
    logp = req.infer(_feed(steps[1][4][None, None], mask, [[lens[1] + 4]], [1]))["logp"]
    assert logp.shape[0] == 1 and rel_err(logp[0], alone[1][5]) < 1e-6
    assert req.query_state()[0].state.shape[0] == 1


def test_a_copied_state_goes_on_like_the_original(lm, compiled) -> None:
    """A prefix cache's move: the state after a prefill, written into a fresh request, continues identically."""
    from cosyvoice_cpu.backends.openvino import import_openvino

    rng = np.random.default_rng(2)
    d = lm.cfg.qwen.hidden_size
    prompt, steps = rng.standard_normal((18, d)).astype(np.float32), rng.standard_normal((3, d)).astype(np.float32)
    src = compiled.create_infer_request()
    want = _run_alone(src, prompt, steps)
    _run_alone(src, prompt, steps[:0])
    saved = {st.name: st.state.data.copy() for st in src.query_state()}
    dst = compiled.create_infer_request()
    dst.infer(_feed(prompt[:1][None], [[1]], [[0]], [0]))  # something else in it first
    for st in dst.query_state():
        st.state = import_openvino().Tensor(saved[st.name])
    for k, x in enumerate(steps):
        logp = dst.infer(_feed(x[None, None], np.ones((1, 18 + k + 1)), [[18 + k]], [0]))["logp"][0]
        assert rel_err(logp, want[k + 1]) < 1e-6


def test_int8_weights_within_tolerance(lm, tmp_path: Path) -> None:
    pytest.importorskip("nncf")
    ref, ours, err = _greedy_vs_reference(lm, _compile(lm, tmp_path, "int8"))
    assert err < INT8_RTOL
    assert np.mean(np.array(ref) == np.array(ours)) >= 0.75


def test_unknown_weights_are_refused(lm, tmp_path: Path) -> None:
    from cosyvoice_cpu.export.lm.openvino_stateful import export_stateful_lm

    with pytest.raises(ConfigError, match="int8"):
        export_stateful_lm(lm, tmp_path, weights="int3")


def test_int4_weights_fit_a_small_lm(lm, tmp_path: Path) -> None:
    """NNCF int4 groups of 128 do not divide the tiny LM's width 64: the group shrinks to one that does."""
    pytest.importorskip("nncf")
    from cosyvoice_cpu.export.lm.openvino_stateful import INT4_GROUP, int4_group

    assert INT4_GROUP == 128 and int4_group(lm) == 64
    ref, ours, err = _greedy_vs_reference(lm, _compile(lm, tmp_path, "int4"))
    assert np.mean(np.array(ref) == np.array(ours)) >= 0.75
    assert err < INT4_RTOL


def test_projections_of_one_input_are_one_weight_layer(lm) -> None:
    """Query/key/value and gate/up are stacked: 4 weight layers per decoder layer (qkv, o, gate_up, down) and the
    head, the stacked ones as wide as their parts together (the logp equal the reference's: the tests above)."""
    from cosyvoice_cpu.export.lm.openvino_stateful import convert_stateful

    q = lm.cfg.qwen
    widths = []
    for op in convert_stateful(lm).get_ops():
        weight = op.input_value(1).get_node() if op.get_type_name() == "MatMul" else None
        if weight is not None and weight.get_type_name() == "Constant":
            widths.append(int(weight.get_output_shape(0)[0]))
    qkv = (q.num_attention_heads + 2 * q.num_key_value_heads) * q.head_dim
    per_layer = [qkv, q.hidden_size, 2 * q.intermediate_size, q.hidden_size]
    head = lm.llm_decoder.out_features
    assert sorted(widths) == sorted(per_layer * q.num_hidden_layers + [head])
