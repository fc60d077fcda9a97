"""Export the CosyVoice2 flow to ONNX: token encoder, estimator (whole and streamed chunks), fixed noise.

Graphs (``export_flow``; the runtime side is :class:`cosyvoice_cpu.flow.cosyvoice2.CosyVoice2Flow`):

``flow_encoder.onnx`` (batch 1)
    token (1, T) int64: prompt tokens + tokens to synthesise, concatenated (negative ids count as 0)
    context (1, C) int64: C = 0 for a final chunk (zero look-ahead padding, ``finalize=True``), else the
        1 <= C <= pre_lookahead_len look-ahead tokens that follow ``token`` and only feed the PreLookaheadLayer
    embedding (1, 192) float32: raw x-vector (L2-normalised in the graph)
    chunk_size () int64: encoder attention chunk in tokens; <= 0 full attention, ``static_chunk_size`` for
        the official streaming (chunk-causal) mode (the frame-level chunk after the x2 upsampling is doubled)
    -> mu (1, 80, 2T) float32, spks (1, 80) float32
``flow_estimator.onnx`` (the official estimator contract, batch and time dynamic)
    x, mask, mu, t, spks, cond: (B, 80, T), (B, 1, T), (B, 80, T), (B,), (B, 80), (B, 80, T) float32
    -> estimator_out (B, 80, T) float32; full attention over the frames where mask = 1
``flow_estimator_stream.onnx``: one streamed chunk on cached activations of the prompt and the context
    (contract in :mod:`cosyvoice_cpu.export.flow.cosyvoice2_stream`; runtime
    :mod:`cosyvoice_cpu.flow.cosyvoice2_stream`).
``flow_noise.npy``: the official fixed noise ``randn(1, 80, 15000)`` after seed 0, float32.
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
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, gate, verify_setup
from cosyvoice_cpu.export.flow.common import (
    ENCODER_QUERY_BLOCKS,
    chunk_visibility,
    estimator_inputs,
    export_encoder,
    export_estimator,
    query_blocks,
    rel_position_encoding,
)
from cosyvoice_cpu.export.flow.cosyvoice2_stream import export_stream_estimator, stream_layout, verify_stream_estimator
from cosyvoice_cpu.export.fused_ops import export_forms
from cosyvoice_cpu.flow.cosyvoice2 import FILES, CosyVoice2Flow
from cosyvoice_cpu.reference.flow.causal_unet import MASK_BIAS, FlowEstimator, timestep_embedding
from cosyvoice_cpu.reference.flow.cfm import NOISE_FRAMES, NOISE_SEED, official_fixed_noise
from cosyvoice_cpu.reference.flow.cosyvoice2 import Flow

logger = logging.getLogger(__name__)

# fp32 gates (max |ort - torch| / max |torch|), measured with 2 threads on the tiny / full-size random fixtures:
# encoder mu 7.4e-7 .. 8.0e-7 / 6.1e-7 .. 7.0e-7, spks 2.9e-7; estimators 7.4e-7 .. 8.5e-7 / 1.1e-6 .. 1.4e-6,
# padded row vs the same row alone 0 .. 6.9e-7; whole flow (10 steps, CFG 0.7) 2.8e-7 .. 4.4e-7. Dynamic int8
# MatMul estimators (full size) reach 1.8e-2 .. 3.6e-2 and a mel error of 5e-3 .. 1e-2: pass ``tolerance``.
TOLERANCE = {"encoder": 1e-5, "estimator": 2e-5, "mel": 3e-5}  # by check kind (both estimators share one)
_FULL_CHUNK = 1 << 30  # a chunk longer than any input: chunk-causal visibility degenerates to full attention


class EncoderGraph(nn.Module):
    """``flow_encoder.onnx``: the reference ``Flow`` token path and speaker projection with in-graph masks."""

    def __init__(self, flow: Flow) -> None:
        super().__init__()
        self.flow = flow
        self.lookahead = flow.config.pre_lookahead_len
        self.stride = flow.encoder.up_layer.stride

    def forward(
        self, token: torch.Tensor, context: torch.Tensor, embedding: torch.Tensor, chunk_size: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1, T), context (1, C), embedding (1, 192), chunk_size () -> mu (1, 80, 2T), spks (1, 80)."""
        flow, enc = self.flow, self.flow.encoder
        spks = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        size = token.size(1)
        # Embedding + LinearEmbed are per position, so the context is embedded with the tokens.
        xs = enc.embed(flow.input_embedding(torch.cat([token, context], dim=1).clamp(min=0)))  # (1, T+C, D)
        pad = torch.zeros(1, self.lookahead, xs.size(2), dtype=xs.dtype)
        ahead = torch.cat([xs, pad], dim=1)[:, : size + self.lookahead].transpose(1, 2)  # context, then zeros
        la = enc.pre_lookahead_layer
        h = la.conv2(F.pad(F.leaky_relu(la.conv1(ahead)), (la.conv2.kernel_size[0] - 1, 0)))
        xs = h.transpose(1, 2) + xs[:, :size]

        chunk = torch.where(chunk_size > 0, chunk_size, torch.full_like(chunk_size, _FULL_CHUNK))
        mask = chunk_visibility(size, chunk).unsqueeze(0)
        pos_emb = rel_position_encoding(size, enc.output_size)
        for layer in enc.encoders:
            xs = layer(xs, mask, pos_emb)

        s = self.stride
        h = xs.transpose(1, 2)
        h = h.unsqueeze(3).expand(-1, -1, -1, s).reshape(1, h.size(1), size * s)  # repeat_interleave
        xs = enc.up_embed(enc.up_layer.conv(F.pad(h, (2 * s, 0))).transpose(1, 2))
        mask = chunk_visibility(size * s, chunk * s).unsqueeze(0)
        pos_emb = rel_position_encoding(size * s, enc.output_size)
        for layer in enc.up_encoders:
            xs = layer(xs, mask, pos_emb)
        mu = flow.encoder_proj(enc.after_norm(xs)).transpose(1, 2)
        return mu, spks


class EstimatorGraph(nn.Module):
    """``flow_estimator.onnx``: :meth:`FlowEstimator.forward` (full attention) with a key-padding bias."""

    def __init__(self, estimator: FlowEstimator) -> None:
        super().__init__()
        self.est = estimator

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """The official ONNX estimator contract; shapes as :meth:`FlowEstimator.forward`."""
        est = self.est
        t_emb = est.time_mlp(timestep_embedding(t, est.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(2)), cond], dim=1)
        bias = (1.0 - mask) * MASK_BIAS  # (B, 1, T): padded keys hidden
        down, up = est.down_blocks[0], est.up_blocks[0]
        h = est._run(down, h, mask, t_emb, bias)
        skip = h
        h = down[2](h * mask)
        for mid in est.mid_blocks:
            h = est._run(mid, h, mask, t_emb, bias)
        h = est._run(up, torch.cat([h, skip], dim=1), mask, t_emb, bias)
        h = up[2](h * mask)
        h = est.final_block(h, mask)
        return est.final_proj(h * mask) * mask


# the family's estimator graph (export.openvino_graphs traces it outside export_forms: plain attention)
ESTIMATOR_GRAPH = EstimatorGraph


def _artifact(out_dir: Path, key: str, attrs: dict[str, Any]) -> GraphArtifact:
    return GraphArtifact.of(out_dir, key, FILES[key], attrs)


def export_flow(flow: Flow, out_dir: Path) -> list[GraphArtifact]:
    """Write ``flow_encoder.onnx``, ``flow_estimator.onnx``, ``flow_estimator_stream.onnx`` (each with its
    ``.data``) and ``flow_noise.npy`` into ``out_dir``.

    Returns:
        the three graph artifacts (contracts in the module doc). The noise table is a plain array, not a graph:
        the estimators' attrs name it (``noise_file``); the exporter lists ``*.npy`` files as arrays.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    flow = flow.eval()
    cfg = flow.config
    t0 = time.perf_counter()
    with query_blocks(flow.encoder, ENCODER_QUERY_BLOCKS):
        export_encoder(EncoderGraph(flow), cfg, out_dir / FILES["flow_encoder"], cfg.encoder.static_chunk_size)
    with export_forms(flow.decoder.estimator) as est:  # fused attention, one-Exp Mish (fused_ops.py)
        export_estimator(EstimatorGraph(est), out_dir / FILES["flow_estimator"])
        export_stream_estimator(est, out_dir / FILES["flow_estimator_stream"])
    np.save(out_dir / FILES["flow_noise"], official_fixed_noise().numpy().astype(np.float32))
    logger.info("exported the flow to %s in %.1f s", out_dir, time.perf_counter() - t0)

    common = {"token_mel_ratio": cfg.token_mel_ratio, "pre_lookahead_len": cfg.pre_lookahead_len}
    encoder = {
        "static_chunk_size": cfg.encoder.static_chunk_size,
        "chunk_unit": "tokens",
        "vocab_size": cfg.vocab_size,
        "spk_embed_dim": cfg.spk_embed_dim,
        "output_size": cfg.output_size,
        **common,
    }
    solver = {
        "n_timesteps": cfg.cfm.n_timesteps,
        "cfg_rate": cfg.cfm.inference_cfg_rate,
        "t_scheduler": cfg.cfm.t_scheduler,
        "noise_file": FILES["flow_noise"],
        "noise_frames": NOISE_FRAMES,
        "noise_seed": NOISE_SEED,
        **common,
    }
    layers, width, conv_channels = stream_layout(flow.decoder.estimator)
    stream = {
        "attention": "cached past + chunk",
        "cache_layers": layers,
        "cache_width": width,
        "conv_state_channels": conv_channels,
        **solver,
    }
    return [
        _artifact(out_dir, "flow_encoder", encoder),
        _artifact(out_dir, "flow_estimator", {"attention": "full", **solver}),
        _artifact(out_dir, "flow_estimator_stream", stream),
    ]


@torch.inference_mode()
def verify_flow(
    flow: Flow,
    out_dir: Path,
    seed: int = 0,
    files: dict[str, str] | None = None,
    tolerance: dict[str, float] | None = None,
    threads: int = 1,
) -> list[GateResult]:
    """ONNX Runtime vs the PyTorch reference on random inputs (max relative errors).

    Gates: encoder mu/spks (final and non-final with look-ahead context, full and chunk attention); the
    estimator at batch 2 (a padded row, two lengths) plus padded rows vs single unpadded rows; the stream
    estimator on a prompt pass and two cached chunks vs the reference over the whole window; the whole flow
    (ORT encoder + :class:`~cosyvoice_cpu.flow.cosyvoice2.CosyVoice2Flow` Euler/CFG loop + estimator) vs
    ``Flow.inference`` with the official noise, and streamed in chunks vs the reference solver with chunk-causal ids.

    Args:
        files: overrides of :data:`FILES` by key (names relative to ``out_dir``), e.g. a quantized estimator.
        tolerance: overrides of :data:`TOLERANCE` by check kind: ``encoder`` (mu, spks), ``estimator`` (both
            estimator graphs), ``mel`` (whole flow, whole and streamed).
    Returns:
        the gates; ``GateResult.graph`` is the file key (``flow_encoder``, ``flow_estimator``,
        ``flow_estimator_stream``) or ``flow`` for the whole-flow mel.
    """
    paths, tol = verify_setup(out_dir, files, tolerance, FILES, TOLERANCE, "verify_flow")
    flow = flow.eval()
    cfg = flow.config
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    stage = CosyVoice2Flow(
        paths["flow_encoder"],
        paths["flow_estimator"],
        paths["flow_estimator_stream"],
        paths["flow_noise"],
        settings=_settings(flow),
        threads=threads,
    )
    n_prompt, n_tok, n_ctx = 20, 37, cfg.pre_lookahead_len  # 57 tokens: > 2 encoder chunks of 25
    prompt = torch.randint(0, cfg.vocab_size, (1, n_prompt), generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (1, n_tok + n_ctx), generator=gen)
    emb = torch.randn(1, cfg.spk_embed_dim, generator=gen)
    feat = torch.randn(1, 2 * n_prompt, 80, generator=gen)
    results: list[GateResult] = []

    for finalize in (True, False):
        for streaming in (False, True):
            ref = flow.encode(
                tokens,
                torch.tensor([tokens.size(1)]),
                prompt,
                torch.tensor([n_prompt]),
                feat,
                emb,
                finalize=finalize,
                streaming=streaming,
            )
            toks, ctx = (tokens, None) if finalize else (tokens[:, :n_tok], tokens[:, n_tok:])
            mu, spks = stage.encode(
                toks.numpy(),
                prompt.numpy(),
                emb.numpy(),
                context=None if ctx is None else ctx.numpy(),
                streaming=streaming,
            )
            what = f"{'final' if finalize else 'non-final+context'}, {'chunk' if streaming else 'full'} attention"
            results.append(gate("flow_encoder", "mu rel err", mu, ref.mu.numpy(), tol["encoder"], what))
    results.append(gate("flow_encoder", "spks rel err", spks, ref.spks.numpy(), tol["encoder"]))

    est = flow.decoder.estimator
    sess = make_session(paths["flow_estimator"], SessionConfig(threads=threads))
    for size in (64, 131):
        lengths = [size, size - 17]
        feeds = estimator_inputs(rng, lengths, size)
        ours = sess.run(None, feeds)[0]
        ref = est(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        what = f"batch 2, T={size}, lengths {lengths}"
        results.append(gate("flow_estimator", "velocity rel err", ours, ref, tol["estimator"], what))
        row = {k: v[1:2, :, : lengths[1]] if v.ndim == 3 else v[1:2] for k, v in feeds.items()}
        single = sess.run(None, row)[0]
        ours = ours[1:2, :, : lengths[1]]
        results.append(gate("flow_estimator", "padded row vs single row", ours, single, tol["estimator"], f"T={size}"))
    stream_sess = make_session(paths["flow_estimator_stream"], SessionConfig(threads=threads))
    for r in verify_stream_estimator(est, stream_sess, rng, tol["estimator"], "flow_estimator_stream"):
        logger.info("%s", r)
        results.append(r)

    for finalize, streaming in ((True, False), (False, True)):
        ref, _ = flow.inference(
            tokens,
            torch.tensor([tokens.size(1)]),
            prompt,
            torch.tensor([n_prompt]),
            feat,
            None,
            emb,
            streaming=streaming,
            finalize=finalize,
        )
        if streaming:  # the official non-final call: chunk-causal encoder and estimator, a grid from frame 0
            continue  # (our runtime streams differently; its whole-flow gate follows)
        mel = stage.inference(tokens.numpy(), prompt.numpy(), feat.numpy(), emb.numpy())
        results.append(gate("flow", "mel rel err", mel, ref.numpy(), tol["mel"], "whole sentence, 10 steps, cfg 0.7"))
    results.append(
        _gate_stream(flow, stage, prompt.numpy()[0], tokens.numpy()[0], feat.numpy()[0], emb.numpy(), tol["mel"])
    )
    return results


def _gate_stream(
    flow: Flow, stage: Any, prompt: np.ndarray, tokens: np.ndarray, feat: np.ndarray, emb: np.ndarray, tol: float
) -> GateResult:
    """:class:`~cosyvoice_cpu.flow.cosyvoice2_stream.CosyVoice2FlowStream` (unbounded context, three chunks) vs the
    reference solver over the same frames with chunk-causal ids [0 prompt, 1, 2, 3] in one call."""
    from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream

    fs = CosyVoice2FlowStream(stage, prompt, feat, emb, context_tokens=None)
    look = fs.lookahead
    cuts = [(0, 10), (10, 25), (25, len(tokens))]
    mel = np.concatenate(
        [fs.push(tokens[a:b], None if b == len(tokens) else tokens[b : b + look]) for a, b in cuts], axis=2
    )
    mu = np.concatenate([fs.prompt.mu, fs.ctx_mu], axis=2)
    n_prompt = fs.n_prompt
    cond = np.zeros_like(mu)
    cond[0, :, :n_prompt] = feat.T
    ids = np.concatenate(
        [np.zeros(n_prompt, np.int64), *[np.full(2 * (b - a), i + 1) for i, (a, b) in enumerate(cuts)]]
    )[None]
    size = mu.shape[2]
    ref = flow.decoder(
        torch.from_numpy(mu),
        torch.ones(1, 1, size),
        torch.from_numpy(fs.prompt.spks),
        torch.from_numpy(cond),
        streaming=True,
        chunk_id=torch.from_numpy(ids),
    ).numpy()
    return gate("flow", "mel rel err", mel, ref[:, :, n_prompt:], tol, "streamed in 3 chunks on cached activations")


def _settings(flow: Flow) -> dict[str, Any]:
    """The :class:`~cosyvoice_cpu.flow.cosyvoice2.FlowSettings` fields of a reference flow (as the artifacts' attrs)."""
    cfg = flow.config
    return {
        "token_mel_ratio": cfg.token_mel_ratio,
        "pre_lookahead_len": cfg.pre_lookahead_len,
        "static_chunk_size": cfg.encoder.static_chunk_size,
        "n_timesteps": cfg.cfm.n_timesteps,
        "cfg_rate": cfg.cfm.inference_cfg_rate,
        "t_scheduler": cfg.cfm.t_scheduler,
    }
