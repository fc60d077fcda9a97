"""Export the Fun-CosyVoice3 (v3) flow to ONNX: token encoder, DiT estimator (whole and streamed), fixed noise.

Graphs (``export_flow``; runtime :class:`cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow`, whole sentences also run on the
v2
:class:`~cosyvoice_cpu.flow.cosyvoice2.CosyVoice2Flow` unchanged):

``flow_encoder.onnx`` (batch 1; exactly the CosyVoice2 contract)
    token (1, T) int64: prompt tokens + tokens to synthesise (negative ids count as 0)
    context (1, C) int64: C = 0 for a final chunk, else the 1 <= C <= 3 look-ahead tokens after ``token``
    embedding (1, 192) float32: raw x-vector (L2-normalised in the graph)
    chunk_size () int64: accepted for the v2 contract and ignored (v3 has no conformer; the DiT's streaming
        mask lives in the estimators)
    -> mu (1, 80, 2T) = repeat x2 of PreLookaheadLayer(Embedding(token)), spks (1, 80)
``flow_estimator.onnx`` (the official estimator contract, batch and time dynamic)
    x, mask, mu, t, spks, cond: (B, 80, T), (B, 1, T), (B, 80, T), (B,), (B, 80), (B, 80, T) float32
    -> estimator_out (B, 80, T): the DiT, full attention over the frames where mask = 1, zero on padded frames
    (the official output there is unused garbage; every other frame equals the row alone: all convs are causal)
``flow_estimator_stream.onnx``: a window of frames on cached keys/values (v3 contract:
    :mod:`cosyvoice_cpu.export.flow.cosyvoice3_stream`; runtime :mod:`cosyvoice_cpu.flow.cosyvoice3_stream`); it takes
    the DiT's time table of the step's t, which ``flow_time.onnx`` computes (t (N,) -> modulation (N, L x 6D + 2D)).
``flow_noise.npy``: the official fixed noise ``randn(1, 80, 15000)`` after seed 0 (the same table as v2).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.onnxruntime import make_session
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, gate, rel_err, torch_export, verify_setup
from cosyvoice_cpu.export.flow.common import estimator_inputs, export_encoder, export_estimator, pin_output_shape
from cosyvoice_cpu.export.flow.cosyvoice3_stream import (
    DiTRun,
    export_stream_estimator,
    stream_layout,
    verify_stream_estimator,
)
from cosyvoice_cpu.export.fused_ops import export_forms
from cosyvoice_cpu.flow.cosyvoice3 import FILES, CosyVoice3Flow
from cosyvoice_cpu.reference.flow.cfm import NOISE_FRAMES, NOISE_SEED, official_fixed_noise
from cosyvoice_cpu.reference.flow.cosyvoice3 import FlowV3
from cosyvoice_cpu.reference.flow.dit import DiT, apply_rope

logger = logging.getLogger(__name__)

# fp32 gates (max |ort - torch| / max |torch|): see tests/export/test_flow_graph_cosyvoice3.py for the measured values.
# Dynamic int8 (reduce_range) estimators need looser bounds: pass ``tolerance``
# (workshop/export_stages.QUANT_TOLERANCE).
TOLERANCE = {"encoder": 1e-5, "estimator": 2e-5, "mel": 3e-5}  # by check kind (both estimators share one)


class EncoderGraphV3(nn.Module):
    """``flow_encoder.onnx``: :meth:`FlowV3.encode` up to mu (the look-ahead context as a second input)."""

    def __init__(self, flow: FlowV3) -> None:
        super().__init__()
        self.flow = flow
        self.lookahead = flow.config.pre_lookahead_len
        self.ratio = flow.config.token_mel_ratio

    def forward(
        self, token: torch.Tensor, context: torch.Tensor, embedding: torch.Tensor, chunk_size: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1, T), context (1, C), embedding (1, 192), chunk_size () unused -> mu (1, 80, 2T), spks."""
        flow = self.flow
        spks = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        size = token.size(1)
        xs = flow.input_embedding(torch.cat([token, context], dim=1).clamp(min=0))  # (1, T+C, 80)
        pad = torch.zeros(1, self.lookahead, xs.size(2), dtype=xs.dtype)
        ahead = torch.cat([xs, pad], dim=1)[:, : size + self.lookahead].transpose(1, 2)  # context, then zeros
        la = flow.pre_lookahead_layer
        h = la.conv2(F.pad(F.leaky_relu(la.conv1(ahead)), (la.conv2.kernel_size[0] - 1, 0)))
        h = h + xs[:, :size].transpose(1, 2)  # (1, 80, T)
        mu = h.unsqueeze(3).expand(-1, -1, -1, self.ratio).reshape(1, h.size(1), size * self.ratio)
        # keep chunk_size a graph input (the v2 contract) without changing anything
        return mu + 0.0 * chunk_size.to(mu.dtype), spks


class EstimatorGraphV3(nn.Module):
    """``flow_estimator.onnx``: :meth:`DiT.forward` (``streaming=False``) with a key-padding bias."""

    def __init__(self, est: DiT) -> None:
        super().__init__()
        self.est = est
        self.run = DiTRun(est)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """The official ONNX estimator contract; shapes as :meth:`DiT.forward`."""
        return self.on_table(x, mask, mu, self.run.time_table(t), spks, cond)

    def on_table(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        table: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """The DiT on its time table ``table`` (B or 1, L x 6D + 2D) (:meth:`DiTRun.time_table`) instead of t."""
        run = self.run
        h, _ = run.embed(x, cond, mu, spks, None)
        residual = h
        freqs = run.freqs(torch.zeros((), dtype=torch.int64), x.size(2))
        visible = mask[:, 0]  # (B, T): padded keys hidden
        keep = mask.transpose(1, 2)  # (B, T, 1): attention output zeroed on padded frames (as upstream)
        for i, block in enumerate(self.est.transformer_blocks):

            def attention(n: torch.Tensor, a: nn.Module = block.attn) -> torch.Tensor:
                q, k = apply_rope(a.to_q(n), freqs), apply_rope(a.to_k(n), freqs)
                return a.to_out[0](run.attend(q, k, a.to_v(n), key_mask=visible)) * keep

            h = run.block(block, h, run.block_mods(table, i), attention)
        return run.head(h, residual, table) * mask


class TableEstimatorGraphV3(EstimatorGraphV3):
    """The whole-sentence DiT taking the step's time table ``modulation`` (1, L x 6D + 2D) in place of ``t`` (the
    OpenVINO form, ``flow_estimator.ov.xml``): the AdaLN weights that map t to every block's modulation, 42 % of
    the DiT's, stay in ``flow_time.onnx``, which the runtime runs once per schedule, so the compiled model holds
    only the rest (as the stream graph does: :mod:`cosyvoice_cpu.flow.cosyvoice3`)."""

    time_input = "modulation"  # what export.openvino_graphs.export_plain_estimator names the time input

    def time_feed(self, t: torch.Tensor) -> torch.Tensor:
        """The ``modulation`` input for the rows' t (B,): row 0's table (1, L x 6D + 2D); the rows of one call
        share t."""
        return self.run.time_table(t[:1])

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        modulation: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """The official contract with ``modulation`` (1, L x 6D + 2D) in place of ``t``; -> (B, 80, T)."""
        return self.on_table(x, mask, mu, modulation, spks, cond)


# the family's estimator graph for OpenVINO (export.openvino_graphs traces it outside export_forms: plain attention)
ESTIMATOR_GRAPH = TableEstimatorGraphV3


def settings_of(flow: FlowV3) -> dict[str, Any]:
    """The :class:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3FlowSettings` fields of a reference flow (as the artifacts'
    attrs)."""
    cfg = flow.config
    return {
        "token_mel_ratio": cfg.token_mel_ratio,
        "pre_lookahead_len": cfg.pre_lookahead_len,
        "static_chunk_size": cfg.estimator.static_chunk_size // cfg.token_mel_ratio,
        "chunk_frames": cfg.estimator.static_chunk_size,
        "n_timesteps": cfg.cfm.n_timesteps,
        "cfg_rate": cfg.cfm.inference_cfg_rate,
        "t_scheduler": cfg.cfm.t_scheduler,
    }


def _artifact(out_dir: Path, key: str, attrs: dict[str, Any]) -> GraphArtifact:
    return GraphArtifact.of(out_dir, key, FILES[key], attrs)


@torch.inference_mode()
def export_flow(flow: FlowV3, out_dir: Path) -> list[GraphArtifact]:
    """Write ``flow_encoder.onnx``, ``flow_estimator.onnx``, ``flow_estimator_stream.onnx``, ``flow_time.onnx``
    (each with its ``.data``) and ``flow_noise.npy`` into ``out_dir``; return the four graph artifacts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    flow = flow.eval()
    cfg = flow.config
    t0 = time.perf_counter()
    est = flow.decoder.estimator
    export_encoder(EncoderGraphV3(flow), cfg, out_dir / FILES["flow_encoder"], 0)  # chunk_size unused by v3
    with export_forms(est):  # one-Exp Mish in the conv position embedding (fused_ops.py)
        export_estimator(EstimatorGraphV3(est), out_dir / FILES["flow_estimator"])
        export_stream_estimator(est, out_dir / FILES["flow_estimator_stream"])
    export_time_graph(est, out_dir / FILES["flow_time"])
    layers, width, state, hist = stream_layout(est)
    for name in ("new_k", "new_v"):  # the tracer names the key width after a Concat
        pin_output_shape(out_dir / FILES["flow_estimator_stream"], name, [layers, "batch", "kept", width])
    pin_output_shape(out_dir / FILES["flow_estimator_stream"], "velocity", ["batch", 80, "time"])  # fused ops
    np.save(out_dir / FILES["flow_noise"], official_fixed_noise().numpy().astype(np.float32))  # v2's table
    logger.info("exported the v3 flow to %s in %.1f s", out_dir, time.perf_counter() - t0)

    settings = settings_of(flow)
    encoder = {
        **settings,
        "chunk_unit": "tokens (chunk_size input unused: v3 has no conformer)",
        "vocab_size": cfg.vocab_size,
        "spk_embed_dim": cfg.spk_embed_dim,
        "output_size": cfg.output_size,
    }
    solver = {
        **settings,
        "noise_file": FILES["flow_noise"],
        "noise_frames": NOISE_FRAMES,
        "noise_seed": NOISE_SEED,
        "estimator": "DiT",
        "depth": est.cfg.depth,
        "dim": est.cfg.dim,
        "heads": est.cfg.heads,
        "dim_head": est.cfg.dim_head,
    }
    stream = {
        **solver,
        "attention": "cached keys/values + chunk-causal window (absolute positions)",
        "cache_layers": layers,
        "cache_width": width,
        "conv_state_channels": state,
        "conv_state_frames": hist,
    }
    return [
        _artifact(out_dir, "flow_encoder", encoder),
        _artifact(out_dir, "flow_estimator", {"attention": "full", **solver}),
        _artifact(out_dir, "flow_estimator_stream", stream),
        _artifact(
            out_dir,
            "flow_time",
            {"depth": est.cfg.depth, "dim": est.cfg.dim, "columns": (6 * est.cfg.depth + 2) * est.cfg.dim},
        ),
    ]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@torch.inference_mode()
def verify_flow(
    flow: FlowV3,
    out_dir: Path,
    seed: int = 0,
    files: dict[str, str] | None = None,
    tolerance: dict[str, float] | None = None,
    threads: int = 1,
) -> list[GateResult]:
    """ONNX Runtime vs the PyTorch reference on random inputs (max relative errors).

    Gates (15): encoder mu (final; non-final with look-ahead context) and spks; the estimator at batch 2 with a
    padded row (valid frames) and the padded row vs the row alone; the stream estimator on three windows vs
    the reference DiT with the official chunk mask, its ``keep_frames`` and a whole sentence on it (full
    attention), given the exact time table; ``flow_time.onnx``'s table; the whole flow
    (:class:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow`, on the stream graph, 10 steps, CFG 0.7) vs
    ``FlowV3.inference``;
    :class:`~cosyvoice_cpu.flow.cosyvoice3_stream.CosyVoice3FlowStream` in three chunks vs the official prefix recompute
    (``FlowV3.inference(streaming=True, finalize=...)`` per chunk).

    Args:
        files: overrides of the file names by key (relative to ``out_dir``), e.g. a quantized estimator.
        tolerance: overrides of :data:`TOLERANCE` by check kind (``encoder``, ``estimator``, ``mel``).
    """
    from cosyvoice_cpu.flow.cosyvoice3_stream import CosyVoice3FlowStream

    paths, tol = verify_setup(out_dir, files, tolerance, FILES, TOLERANCE, "verify_flow")
    flow = flow.eval()
    cfg = flow.config
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    stage = CosyVoice3Flow(
        paths["flow_encoder"],
        paths["flow_estimator"],
        paths["flow_estimator_stream"],
        paths["flow_noise"],
        settings=settings_of(flow),
        threads=threads,
        time_graph=paths["flow_time"],
    )
    n_prompt, n_tok, look = 40, 60, cfg.pre_lookahead_len
    prompt = torch.randint(0, cfg.vocab_size, (1, n_prompt), generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (1, n_tok), generator=gen)
    emb = torch.randn(1, cfg.spk_embed_dim, generator=gen)
    feat = torch.randn(1, 2 * n_prompt, 80, generator=gen)
    results: list[GateResult] = []

    for finalize in (True, False):
        ref = flow.encode(tokens, torch.tensor([n_tok]), prompt, torch.tensor([n_prompt]), feat, emb, finalize)
        toks, ctx = (tokens, None) if finalize else (tokens[:, :-look], tokens[:, -look:])
        mu, spks = stage.encode(toks.numpy(), prompt.numpy(), emb.numpy(), None if ctx is None else ctx.numpy())
        what = "final" if finalize else f"non-final, {look} look-ahead tokens"
        results.append(gate("flow_encoder", "mu rel err", mu, ref.mu.numpy(), tol["encoder"], what))
    results.append(gate("flow_encoder", "spks rel err", spks, ref.spks.numpy(), tol["encoder"]))

    est = flow.decoder.estimator
    sess = make_session(paths["flow_estimator"], SessionConfig(threads=threads))
    for size in (64, 131):
        lengths = [size, size - 17]
        feeds = estimator_inputs(rng, lengths, size)
        ours = sess.run(None, feeds)[0]
        ref = est(*(_t(v) for v in feeds.values())).numpy() * feeds["mask"]
        what = f"batch 2, T={size}, lengths {lengths} (valid frames)"
        results.append(gate("flow_estimator", "velocity rel err", ours, ref, tol["estimator"], what))
        row = {k: v[1:2, :, : lengths[1]] if v.ndim == 3 else v[1:2] for k, v in feeds.items()}
        single = sess.run(None, row)[0]
        results.append(
            gate(
                "flow_estimator",
                "padded row vs single row",
                ours[1:2, :, : lengths[1]],
                single,
                tol["estimator"],
                f"T={size}",
            )
        )
    stream_sess = make_session(paths["flow_estimator_stream"], SessionConfig(threads=threads))
    for r in verify_stream_estimator(est, stream_sess, rng, tol["estimator"], "flow_estimator_stream"):
        logger.info("%s", r)
        results.append(r)
    time_sess = make_session(paths["flow_time"], SessionConfig(threads=threads))
    results.append(verify_time_graph(est, time_sess, rng, tol["estimator"]))

    ref, _ = flow.inference(tokens, torch.tensor([n_tok]), prompt, torch.tensor([n_prompt]), feat, None, emb)
    mel = stage.inference(tokens.numpy(), prompt.numpy(), feat.numpy(), emb.numpy())
    results.append(gate("flow", "mel rel err", mel, ref.numpy(), tol["mel"], "whole sentence, 10 steps, cfg 0.7"))

    fs = CosyVoice3FlowStream(stage, prompt.numpy()[0], feat.numpy()[0], emb.numpy(), context_tokens=None)
    ours_chunks, ref_chunks = [], []
    for a, b in ((0, 7), (7, 30), (30, n_tok)):
        final = b == n_tok
        ours_chunks.append(fs.push(tokens[0, a:b].numpy(), None if final else tokens[0, b : b + look].numpy()))
        upto = b if final else b + look
        ref, _ = flow.inference(
            tokens[:, :upto],
            torch.tensor([upto]),
            prompt,
            torch.tensor([n_prompt]),
            feat,
            None,
            emb,
            streaming=True,
            finalize=final,
        )
        ref_chunks.append(ref.numpy()[:, :, cfg.token_mel_ratio * a :])
    results.append(
        gate(
            "flow",
            "mel rel err",
            np.concatenate(ours_chunks, axis=2),
            np.concatenate(ref_chunks, axis=2),
            tol["mel"],
            "streamed in 3 chunks vs the official prefix recompute",
        )
    )
    return results


class TimeGraphV3(nn.Module):
    """``flow_time.onnx``: t (N,) -> modulation (N, L * 6D + 2D) (:meth:`DiTRun.time_table`)."""

    def __init__(self, est: DiT) -> None:
        super().__init__()
        self.est = est  # registered, so the tracer sees its weights as parameters
        self.run = DiTRun(est)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.run.time_table(t)


def export_time_graph(est: DiT, path: Any) -> None:
    """Write the v3 ``flow_time.onnx`` (+ ``.data``) at ``path``."""
    t = torch.tensor([0.0, 0.25, 0.7], dtype=torch.float32)
    torch_export(
        TimeGraphV3(est),
        (t,),
        path,
        input_names=["t"],
        output_names=["modulation"],
        dynamic_axes={"t": {0: "steps"}, "modulation": {0: "steps"}},
    )


def verify_time_graph(est: DiT, sess: Any, rng: np.random.Generator, tol: float) -> GateResult:
    """``flow_time.onnx`` vs :meth:`DiTRun.time_table` on 10 random times."""
    t = rng.uniform(0, 1, 10).astype(np.float32)
    ours = sess.run(None, {"t": t})[0]
    ref = DiTRun(est).time_table(torch.from_numpy(t)).numpy()
    return GateResult("flow_time", "modulation rel err", rel_err(ours, ref), tol, "10 random t")
