"""What every family's LM graph is checked with: the numerics gate (:func:`verify_lm`, run by the export) and the
teacher-forced comparison (:func:`compare_lm`, for quantization reports), both through the runtime's
:class:`~cosyvoice_cpu.lm.session.LMSession` and both given the family's :class:`~cosyvoice_cpu.export.common.LMGate`
(the ``GATE`` of its graph module); and the graph facts every family's LM graph shares (:data:`IR_VERSION`,
:data:`IO_DOCS`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import GateResult, LMGate, io_specs, rel_err
from cosyvoice_cpu.lm.kv_spec import past_names
from cosyvoice_cpu.lm_files import GRAPH_FILE, TEXT_ENCODER_FILE

logger = logging.getLogger(__name__)

IR_VERSION = 8  # opset 17's IR; keeps the graph loadable by older onnxruntime releases

IO_DOCS = {
    "inputs_embeds": "float32 (B, S, D): embeddings of the S new positions of each row",
    "seqlens_k": "int32 (B,): valid cache positions of each row after this call, minus one",
    "total_sequence_length": "int32 scalar: max over rows of seqlens_k + 1",
    "logp": "float32 (B, V): log-softmax of the speech head at position S-1 of each row",
    "past": "float32 (B, Hkv, max_len, Dh): layer cache before the call; bind the same buffer as the present",
    "present": "float32 (B, Hkv, max_len, Dh): layer cache after the call (the past buffer, updated in place)",
}


# fp32 on the tiny and the full-size random fixtures: logp rel err ~2e-7 vs the reference, 0 batch vs single,
# KL ~1e-13, embeddings exact. Real checkpoints have larger activations, hence the margin.
FP32_TOLERANCES = {
    "embeddings": 0.0,  # rel err of the gathered prompt embeddings (an exact copy of the tables)
    "prefill_logp": 1e-4,  # rel err of logp after a 20-40 position prompt
    "decode_logp": 1e-4,  # max rel err of logp over 8 cached decode steps
    "batch_vs_single": 1e-5,  # rel err of a 2-row ragged batch vs the same rows run alone (graph vs graph)
    "greedy_mismatch": 0.0,  # fraction of the 9 teacher-forced steps whose argmax differs from the reference
    "decode_kl": 1e-6,  # mean KL(ref || graph) over those 9 steps, nats
}
# Any explicit ``tolerance`` starts from these (a quantized graph, perhaps fp16 tables): "not broken" bounds.
# Full-size random fixture, int8 dynamic / 4-bit MatMulNBits: logp 4.4e-3 / 2.8e-2, batch 4.7e-3 / 0 (dynamic
# int8 quantizes activations per tensor, so rows of a batch change each other), mismatch 0 / 0.11, KL 5e-5 / 2e-3.
LOOSE_TOLERANCES = {
    "embeddings": 1e-3,  # fp16 tables round at 2^-11
    "prefill_logp": 0.05,
    "decode_logp": 0.05,
    "batch_vs_single": 0.05,
    "greedy_mismatch": 0.5,  # random-weight distributions are flat, so argmax flips easily
    "decode_kl": 0.1,
}
LOGP_GATES = ("prefill_logp", "decode_logp", "batch_vs_single")
# CosyVoice-300M prompt embeddings pass through the text-encoder graph, so they are computed, not copied: fp32
# 1.1e-7 on the tiny fixture; a quantized text encoder (the LM recipe's precision) is bounded like the logp.
V1_EMBEDDINGS = {"fp32": 1e-5, "quantized": 0.05}
DECODE_STEPS = 8


def tolerances(tolerance: float | Mapping[str, float] | None) -> dict[str, float]:
    """None: :data:`FP32_TOLERANCES`. A number or a mapping: :data:`LOOSE_TOLERANCES` overridden by it; a number
    (or the key ``logp``) sets the three logp gates, other keys set one gate each."""
    if tolerance is None:
        return dict(FP32_TOLERANCES)
    tol = dict(LOOSE_TOLERANCES)
    given = {"logp": float(tolerance)} if isinstance(tolerance, (int, float)) else dict(tolerance)
    unknown = sorted(set(given) - set(tol) - {"logp"})
    if unknown:
        raise ConfigError(f"unknown LM gate(s) {', '.join(unknown)}; known: logp, {', '.join(tol)}")
    if "logp" in given:
        tol.update(dict.fromkeys(LOGP_GATES, given.pop("logp")))
    tol.update(given)
    return tol


def runtime_session(lm: Any, out_dir: Path, graph_file: str, gate: LMGate) -> tuple[Any, Any]:
    """The runtime session on a written graph and its prompt builder ``(text ids, speech ids, speaker) -> (T, D)``."""
    from cosyvoice_cpu.lm.prompt import TextEncoder, assemble
    from cosyvoice_cpu.lm.session import LMSession

    inputs, _ = io_specs(Path(out_dir) / graph_file)
    max_len = next(int(s.shape[2]) for s in inputs if s.name == past_names(0)[0])
    sess = LMSession.from_dir(out_dir, gate.attrs(lm, max_len), graph_file=graph_file, threads=2)
    if gate.text_encoder:
        encoder = TextEncoder(Path(out_dir) / TEXT_ENCODER_FILE, (sess.spec.text_dim, sess.spec.hidden), 2)
        return sess, partial(assemble, sess, encoder=encoder)
    return sess, partial(assemble, sess)


def random_prompt(lm: Any, build: Any, rng: np.random.Generator, gate: LMGate) -> tuple[Any, np.ndarray]:
    """A random 20-40 position prompt: the reference's embeddings (1, T, D) and the runtime's (T, D) (with a
    random speaker row where the family's LM takes the x-vector: v1)."""
    import torch

    speaker_row = gate.facts.lm_speaker
    total = int(rng.integers(20, 41)) - speaker_row
    n_text = int(rng.integers(4, total - 6))
    text = rng.integers(0, gate.text_vocab(lm), n_text)
    speech = rng.integers(0, lm.cfg.speech_token_size, total - 2 - n_text)
    args = [torch.from_numpy(text)[None], torch.zeros(1, 0, dtype=torch.long), torch.from_numpy(speech)[None]]
    speaker = rng.standard_normal(192).astype(np.float32) if speaker_row else None
    ref = lm.prompt_embeddings(*args, *([torch.from_numpy(speaker)[None]] if speaker_row else []))
    return ref.detach(), build(text, speech, speaker=speaker)


def kl_rows(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(ref || ours) per row of log-probabilities (..., V), nats (both renormalised in float64 first)."""

    def norm(lp: np.ndarray) -> np.ndarray:
        lp = np.asarray(lp, np.float64)
        m = lp.max(-1, keepdims=True)
        return lp - m - np.log(np.sum(np.exp(lp - m), axis=-1, keepdims=True))

    ref, ours = norm(ref), norm(ours)
    return np.sum(np.exp(ref) * (ref - ours), axis=-1)


def verify_lm(
    lm: Any,
    out_dir: Path,
    gate: LMGate,
    seed: int = 0,
    graph_file: str = GRAPH_FILE,
    tolerance: float | Mapping[str, float] | None = None,
) -> list[GateResult]:
    """Check a written LM graph (fp32 or quantized) through :class:`~cosyvoice_cpu.lm.session.LMSession`
    (``gate``: the family's, the ``GATE`` of its graph module).

    Gates (names and fp32 defaults in :data:`FP32_TOLERANCES`): prompt embeddings, prefill logp, 8 decode steps
    fed the reference's greedy tokens, argmax mismatch and mean KL over those 9 distributions, and a 2-row batch of
    different lengths vs the rows run alone. For a quantized graph pass ``tolerance``: a number or
    ``{"logp": x}`` for the logp gates, or gate names; the rest then come from :data:`LOOSE_TOLERANCES`.
    """
    tol = tolerances(tolerance)
    if gate.text_encoder:  # computed prompt embeddings, not copied rows
        tol["embeddings"] = max(tol["embeddings"], V1_EMBEDDINGS["fp32" if tolerance is None else "quantized"])
    rng = np.random.default_rng(seed)
    sess, build = runtime_session(lm, out_dir, graph_file, gate)
    ref_emb, emb = random_prompt(lm, build, rng, gate)
    total = emb.shape[0]
    ref = [lm.prefill(ref_emb, total + DECODE_STEPS + 1).numpy()]
    tokens = []
    for k in range(DECODE_STEPS):  # greedy over the rows that can be fed back (v3/v1: not the stop ids)
        tokens.append(int(ref[-1][: sess.spec.speech_rows].argmax()))
        ref.append(lm.decode_step(tokens[-1], total + k).numpy())
    # the same prompt and tokens alone (row 0 of a 1-row cache), then with a shorter second prompt in a batch
    emb2 = random_prompt(lm, build, rng, gate)[1][: max(2, total - 7)]
    tokens2 = [int(t) for t in rng.integers(0, lm.cfg.speech_token_size, DECODE_STEPS)]
    single: list[list[np.ndarray]] = []
    for e, toks in ((emb, tokens), (emb2, tokens2)):
        cache = sess.new_cache(1)
        single.append([sess.prefill(cache, 0, e)] + [sess.decode(cache, [0], [t])[0] for t in toks])
    cache = sess.new_cache(2)
    batch = [np.stack([sess.prefill(cache, 0, emb), sess.prefill(cache, 1, emb2)])]
    batch += [sess.decode(cache, [0, 1], [a, b]) for a, b in zip(tokens, tokens2)]
    ours, ref = np.stack(single[0]), np.stack(ref)
    name = Path(graph_file).stem
    values = {
        "embeddings": (rel_err(emb, ref_emb[0].numpy()), f"{total} positions"),
        "prefill_logp": (rel_err(ours[0], ref[0]), f"prompt of {total} positions"),
        "decode_logp": (max(rel_err(o, r) for o, r in zip(ours[1:], ref[1:])), f"{DECODE_STEPS} steps"),
        "batch_vs_single": (rel_err(np.stack(batch), np.stack(single, 1)), f"rows of {total}, {len(emb2)}"),
        "greedy_mismatch": (float(np.mean(ours.argmax(-1) != ref.argmax(-1))), f"{len(ref)} steps"),
        "decode_kl": (float(np.mean(kl_rows(ref, ours))), "mean nats"),
    }
    return [GateResult(name, check, v, tol[check], detail) for check, (v, detail) in values.items()]


def compare_lm(
    lm: Any, out_dir: Path, gate: LMGate, graph_file: str = GRAPH_FILE, steps: int = 200, seed: int = 0
) -> dict:
    """Teacher-force ``steps`` next-token predictions of a graph (``gate``: see :func:`verify_lm`) against the
    reference.

    A random 20-40 position prompt is prefilled, then steps - 1 random speech tokens are decoded one at a time;
    the reference scores the same sequence in one uncached ``forward_full``. Returns a dict with ``steps``,
    ``agreement`` (fraction of equal argmax), ``mean_kl`` / ``max_kl`` (KL(ref || graph), nats) and
    ``max_rel_err`` (of logp).
    """
    import torch

    if steps <= 0:
        raise ConfigError(f"steps must be positive, got {steps}")
    rng = np.random.default_rng(seed)
    sess, build = runtime_session(lm, out_dir, graph_file, gate)
    ref_emb, emb = random_prompt(lm, build, rng, gate)
    tokens = [int(t) for t in rng.integers(0, lm.cfg.speech_token_size, steps - 1)]
    cache = sess.new_cache(1)
    ours = [sess.prefill(cache, 0, emb)] + [sess.decode(cache, [0], [t])[0] for t in tokens]
    seq = torch.cat([ref_emb, lm.speech_embedding.weight[torch.tensor(tokens, dtype=torch.long)][None]], dim=1)
    ref = lm.forward_full(seq)[0, emb.shape[0] - 1 :].numpy()
    ours = np.stack(ours)
    kl = kl_rows(ref, ours)
    return {
        "graph": graph_file,
        "steps": steps,
        "agreement": float(np.mean(ours.argmax(-1) == ref.argmax(-1))),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "max_rel_err": float(max(rel_err(o, r) for o, r in zip(ours, ref))),
    }
