"""Export the CosyVoice-300M (v1) flow to ONNX: token encoder with the length regulator, UNet estimator.

Graphs (``export_flow``; the runtime side is :class:`cosyvoice_cpu.flow.cosyvoice.CosyVoiceFlow`):

``flow_encoder.onnx`` (batch 1)
    token (1, T) int64: prompt tokens then tokens to synthesise (negative ids count as 0)
    embedding (1, 192) float32: raw x-vector (L2-normalised in the graph)
    stretch (T, F) float32: the length regulator's linear interpolation as a matrix
        (:func:`cosyvoice_cpu.flow.cosyvoice.stretch_matrix`: prompt -> mel_len1 frames, new tokens -> mel_len2 frames,
        head/middle/tail above 40 new tokens), so all of its length logic lives in one NumPy function
    -> mu (1, 80, F) float32 (embedding -> Conformer, full attention -> encoder_proj -> (1, 80, T) @ stretch ->
       the regulator's conv stack), spks (1, 80) float32
``flow_estimator.onnx`` (the official estimator contract, batch and time dynamic)
    x, mask, mu, t, spks, cond: (B, 80, T), (B, 1, T), (B, 80, T), (B,), (B, 80), (B, 80, T) float32
    -> estimator_out (B, 80, T) float32; the UNet (T and T/2 resolutions), full attention over real frames.
    Unlike v2's, a padded row differs from the same row alone (the official UNet's GroupNorm statistics include
    the padded frames): batch only rows of one length (e.g. the CFG pair).

v1 has no fixed noise table: the runtime draws fresh Gaussian noise per call, as the official code does.
"""

from __future__ import annotations

import copy
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
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, gate, torch_export, verify_setup
from cosyvoice_cpu.export.flow.common import (
    ENCODER_QUERY_BLOCKS,
    estimator_inputs,
    export_estimator,
    pin_output_shape,
    query_blocks,
    rel_position_encoding,
)
from cosyvoice_cpu.export.fused_ops import export_forms
from cosyvoice_cpu.flow.cosyvoice import (
    CACHE_TAIL_FRAMES,
    FILES,
    MEL_FRAMES_PER_SECOND,
    OVERLAP_TOKENS,
    CosyVoiceFlow,
    stretch_matrix,
)
from cosyvoice_cpu.reference.flow.causal_unet import MASK_BIAS, FlowEstimator, timestep_embedding
from cosyvoice_cpu.reference.flow.cosyvoice import FlowV1
from cosyvoice_cpu.reference.flow.length_regulator import frames_for_tokens
from cosyvoice_cpu.reference.flow.unet import Block1D, UNetEstimator

logger = logging.getLogger(__name__)

# fp32 gates (max |ort - torch| / max |torch|), measured with 1 thread on the tiny fixture: see the test module.
# Dynamic int8 MatMul estimators need looser bounds: pass ``tolerance`` (workshop/export_stages.QUANT_TOLERANCE).
TOLERANCE = {"encoder": 2e-5, "estimator": 5e-5, "mel": 1e-4}  # by check kind
# (new tokens, prompt tokens) of the encoder gates: one stretch, head/mid/tail, 41 (2-frame middle), SFT
ENCODER_CASES = ((30, 15), (57, 15), (41, 15), (45, 0))


class EncoderGraphV1(nn.Module):
    """``flow_encoder.onnx``: :meth:`FlowV1.encode` up to mu, the interpolation given as a matrix."""

    def __init__(self, flow: FlowV1) -> None:
        super().__init__()
        self.flow = flow

    def forward(
        self, token: torch.Tensor, embedding: torch.Tensor, stretch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token (1, T), embedding (1, 192), stretch (T, F) -> mu (1, 80, F), spks (1, 80)."""
        flow, enc = self.flow, self.flow.encoder
        spks = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        xs = enc.embed(flow.input_embedding(token.clamp(min=0)))  # (1, T, D); batch 1: no padding
        size = token.size(1)
        mask = torch.ones_like(token, dtype=torch.bool).unsqueeze(1)  # (1, 1, T) full attention
        pos_emb = rel_position_encoding(size, enc.output_size)
        for layer in enc.encoders:
            xs = layer(xs, mask, pos_emb)
        h = flow.encoder_proj(enc.after_norm(xs)).transpose(1, 2)  # (1, 80, T)
        mu = flow.length_regulator.model(torch.matmul(h, stretch))
        return mu, spks


def _run(stage: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
    """One UNet stage (resnet + transformer blocks) with the key-padding bias of this resolution's mask."""
    return FlowEstimator._run(stage, x, mask, t_emb, (1.0 - mask) * MASK_BIAS)


class EstimatorGraphV1(nn.Module):
    """``flow_estimator.onnx``: :meth:`UNetEstimator.forward` with a key-padding bias per resolution.

    The reference's (B, T, T) bias opens an all-padding row entirely; a (B, 1, T) key bias gives that row
    uniform attention instead. Both only touch padded frames, which every block masks and the output zeroes.
    """

    def __init__(self, estimator: UNetEstimator) -> None:
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
        """The official estimator contract; shapes as :meth:`UNetEstimator.forward`."""
        est = self.est
        t_emb = est.time_mlp(timestep_embedding(t, est.cfg.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(2)), cond], dim=1)

        skips: list[torch.Tensor] = []
        masks = [mask]
        for stage in est.down_blocks:
            m = masks[-1]
            h = _run(stage, h, m, t_emb)
            skips.append(h)
            h = stage[2](h * m)
            masks.append(m[:, :, ::2])
        masks.pop()
        for stage in est.mid_blocks:
            h = _run(stage, h, masks[-1], t_emb)
        for stage in est.up_blocks:
            m, skip = masks.pop(), skips.pop()
            h = _run(stage, torch.cat([h[:, :, : skip.size(-1)], skip], dim=1), m, t_emb)
            h = stage[2](h * m)
        h = est.final_block(h, m)
        return est.final_proj(h * m) * mask


class MaskedBlock1D(nn.Module):
    """:class:`~cosyvoice_cpu.reference.flow.unet.Block1D` with its GroupNorm statistics taken over the real
    (mask 1) frames only: the same function on an unpadded input (the mask is all ones there), and on an input
    padded with mask 0 the real frames' output is what they give alone. Its conv reads ``x * mask``, so the frame
    after the last real one is 0 either way, and every other step is per frame."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.conv, self.norm, self.act = block.block[0], block.block[1], block.block[2]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, C_in, T), mask (B, 1, T) -> (B, C_out, T)."""
        h = self.conv(x * mask)
        c, g = h.shape[1], self.norm.num_groups
        hg, mg = h.reshape(h.shape[0], g, c // g, -1), mask.unsqueeze(1)  # (B, G, C/G, T), (B, 1, 1, T)
        n = mg.sum(dim=(2, 3), keepdim=True).clamp(min=1.0) * (c // g)
        mean = (hg * mg).sum(dim=(2, 3), keepdim=True) / n
        var = (((hg - mean) * mg) ** 2).sum(dim=(2, 3), keepdim=True) / n  # biased, as GroupNorm's
        h = ((hg - mean) / torch.sqrt(var + self.norm.eps)).reshape(h.shape)
        h = h * self.norm.weight.view(1, c, 1) + self.norm.bias.view(1, c, 1)
        return self.act(h) * mask


def padded_estimator_graph(estimator: UNetEstimator) -> EstimatorGraphV1:
    """The estimator graph of the OpenVINO export: :class:`EstimatorGraphV1` on a copy of ``estimator`` whose
    GroupNorm blocks are :class:`MaskedBlock1D`, so a call padded to a shared shape (with mask 0) gives the real
    frames the unpadded call's output, as the v2/v3 estimators do, and the runtime can pad it to its buckets.
    On unpadded input it is the official function (the export gate compares it with the fp32 ONNX graph)."""
    est = copy.deepcopy(estimator)
    for module in list(est.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Block1D):
                setattr(module, name, MaskedBlock1D(child))
    return EstimatorGraphV1(est)


# the family's estimator graph for export.openvino_graphs (traced outside export_forms: plain attention)
ESTIMATOR_GRAPH = padded_estimator_graph


def _artifact(out_dir: Path, key: str, attrs: dict[str, Any]) -> GraphArtifact:
    return GraphArtifact.of(out_dir, key, FILES[key], attrs)


def settings_of(flow: FlowV1) -> dict[str, Any]:
    """The :class:`~cosyvoice_cpu.flow.cosyvoice.CosyVoiceFlowSettings` fields of a reference flow (as the artifacts'
    attrs)."""
    cfg = flow.config
    return {
        "input_frame_rate": cfg.input_frame_rate,
        "overlap_tokens": OVERLAP_TOKENS,
        "cache_tail_frames": CACHE_TAIL_FRAMES,
        "n_timesteps": cfg.cfm.n_timesteps,
        "cfg_rate": cfg.cfm.inference_cfg_rate,
        "t_scheduler": cfg.cfm.t_scheduler,
    }


@torch.inference_mode()
def export_flow(flow: FlowV1, out_dir: Path) -> list[GraphArtifact]:
    """Write ``flow_encoder.onnx`` and ``flow_estimator.onnx`` (each with its ``.data``) into ``out_dir``.

    Returns:
        the two graph artifacts (contracts in the module doc); their attrs carry :func:`settings_of` plus the
        length regulator's facts (``mel_frames_per_second`` 22050/256, ``split_above_tokens`` 40, ...).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    flow = flow.eval()
    cfg = flow.config
    t0 = time.perf_counter()
    n_prompt, n_new = 11, 45  # > 40 new tokens: the trace sees the split matrix (any T, F work)
    mel_len1, mel_len2 = 19, frames_for_tokens(n_new, cfg.input_frame_rate)
    enc_args = (
        torch.randint(0, cfg.vocab_size, (1, n_prompt + n_new)),
        torch.randn(1, cfg.spk_embed_dim),
        torch.from_numpy(stretch_matrix(n_prompt, n_new, mel_len1, mel_len2, cfg.input_frame_rate)),
    )
    with query_blocks(flow.encoder, ENCODER_QUERY_BLOCKS):  # as CosyVoice2's (export.flow.common)
        torch_export(
            EncoderGraphV1(flow),
            enc_args,
            out_dir / FILES["flow_encoder"],
            input_names=["token", "embedding", "stretch"],
            output_names=["mu", "spks"],
            dynamic_axes={"token": {1: "tokens"}, "stretch": {0: "tokens", 1: "frames"}, "mu": {2: "frames"}},
        )
    pin_output_shape(out_dir / FILES["flow_encoder"], "mu", [1, cfg.output_size, "frames"])
    with export_forms(flow.decoder.estimator) as est:  # fused attention, one-Exp Mish (fused_ops.py)
        export_estimator(EstimatorGraphV1(est), out_dir / FILES["flow_estimator"])
    logger.info("exported the v1 flow to %s in %.1f s", out_dir, time.perf_counter() - t0)

    solver = settings_of(flow)
    encoder = {
        "vocab_size": cfg.vocab_size,
        "spk_embed_dim": cfg.spk_embed_dim,
        "output_size": cfg.output_size,
        "mel_frames_per_second": MEL_FRAMES_PER_SECOND,
        "split_above_tokens": 2 * OVERLAP_TOKENS,
        "stretch": "linear, align_corners=False (flow.cosyvoice.stretch_matrix)",
        **solver,
    }
    estimator = {"attention": "full", "noise": "fresh Gaussian per call", **solver}
    return [_artifact(out_dir, "flow_encoder", encoder), _artifact(out_dir, "flow_estimator", estimator)]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@torch.inference_mode()
def verify_flow(
    flow: FlowV1,
    out_dir: Path,
    seed: int = 0,
    files: dict[str, str] | None = None,
    tolerance: dict[str, float] | None = None,
    threads: int = 1,
) -> list[GateResult]:
    """ONNX Runtime vs the PyTorch reference on random inputs (max relative errors).

    Gates: encoder mu for <= 40, > 40 and 41 new tokens with a prompt and > 40 without (SFT), and spks; the
    estimator at batch 2 with a padded row and at batch 1 (odd lengths too); the whole flow
    (:class:`~cosyvoice_cpu.flow.cosyvoice.CosyVoiceFlow`, 10 steps, CFG) vs ``FlowV1.inference`` with the same
    injected noise: with a prompt, SFT, and a second window on the first one's ``flow_cache``.

    Args:
        files: overrides of :data:`~cosyvoice_cpu.flow.cosyvoice.FILES` by key, e.g. a quantized estimator.
        tolerance: overrides of :data:`TOLERANCE` by check kind (``encoder``, ``estimator``, ``mel``).
    Returns:
        the gates; ``GateResult.graph`` is the file key or ``flow`` for the whole-flow mel.
    """
    paths, tol = verify_setup(out_dir, files, tolerance, FILES, TOLERANCE, "verify_flow")
    flow = flow.eval()
    cfg = flow.config
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    stage = CosyVoiceFlow(paths["flow_encoder"], paths["flow_estimator"], settings_of(flow), threads)
    prompt = torch.randint(0, cfg.vocab_size, (1, 15), generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (1, 57), generator=gen)
    emb = torch.randn(1, cfg.spk_embed_dim, generator=gen)
    feat = torch.randn(1, 27, 80, generator=gen)  # any length: the prompt tokens are stretched to it
    results: list[GateResult] = []

    def case(n_new: int, n_prompt: int) -> tuple:
        pt, pf = prompt[:, :n_prompt], feat[:, : 27 if n_prompt else 0]
        return tokens[:, :n_new], torch.tensor([n_new]), pt, torch.tensor([n_prompt]), pf, emb

    for n_new, n_prompt in ENCODER_CASES:
        tok, _, pt, _, pf, _ = args = case(n_new, n_prompt)
        ref = flow.encode(*args)
        mu, spks, _ = stage.encode(tok.numpy(), pt.numpy(), pf.shape[1], emb.numpy())
        what = f"{n_new} new tokens, {n_prompt} prompt tokens -> {ref.mu.shape[2]} frames"
        results.append(gate("flow_encoder", "mu rel err", mu, ref.mu.numpy(), tol["encoder"], what))
    results.append(gate("flow_encoder", "spks rel err", spks, ref.spks.numpy(), tol["encoder"]))

    est = flow.decoder.estimator
    sess = make_session(paths["flow_estimator"], SessionConfig(threads=threads))
    for size in (64, 121):
        lengths = [size, size - 17]
        feeds = estimator_inputs(rng, lengths, size)
        ours = sess.run(None, feeds)[0]
        ref = est(*(_t(v) for v in feeds.values())).numpy()
        what = f"batch 2, T={size}, lengths {lengths}"
        results.append(gate("flow_estimator", "velocity rel err", ours, ref, tol["estimator"], what))
        # a padded row is NOT the row alone (GroupNorm statistics span the padded frames, in the official model
        # too): v1 rows of different lengths must not share a padded batch; so gate the unpadded row itself
        row = {k: v[1:2, :, : lengths[1]] if v.ndim == 3 else v[1:2] for k, v in feeds.items()}
        single = sess.run(None, row)[0]
        ref = est(*(_t(v) for v in row.values())).numpy()
        results.append(
            gate(
                "flow_estimator",
                "velocity rel err",
                single,
                ref,
                tol["estimator"],
                f"batch 1, T={lengths[1]}, unpadded",
            )
        )

    cache = None
    for n_new, n_prompt, cached in ((57, 15, False), (30, 0, False), (45, 15, True)):
        tok, tok_len, pt, pt_len, pf, _ = case(n_new, n_prompt)
        frames = pf.shape[1] + frames_for_tokens(n_new, cfg.input_frame_rate)
        noise = rng.standard_normal((1, 80, frames), dtype=np.float32)
        ref, ref_cache = flow.inference(
            tok, tok_len, pt, pt_len, pf, None, emb, flow_cache=cache if cached else None, noise=_t(noise)
        )
        mel, new_cache = stage.inference_cached(
            tok.numpy(),
            pt.numpy(),
            pf.numpy()[0],
            emb.numpy(),
            noise=noise,
            flow_cache=None if cache is None or not cached else cache.numpy(),
        )
        what = f"{n_new} new, {n_prompt} prompt tokens, {'on the previous flow_cache' if cached else 'no cache'}"
        results.append(gate("flow", "mel rel err", mel, ref.numpy(), tol["mel"], what))
        if n_prompt and not cached:
            cache = ref_cache
            results.append(gate("flow", "flow_cache rel err", new_cache, ref_cache.numpy(), tol["mel"], what))
    return results
