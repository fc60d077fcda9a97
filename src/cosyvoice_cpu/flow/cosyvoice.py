"""The CosyVoice-300M (v1) flow at run time (NumPy + ONNX Runtime, no torch): 50 Hz speech tokens -> 80-bin mel.

    [prompt tokens, tokens] (1, T) --flow_encoder.onnx (embedding, Conformer, encoder_proj; h (1, 80, T) @
      stretch (T, F); the length regulator's conv stack)--> mu (1, 80, F), spks (1, 80)
    F = mel_len1 + mel_len2: mel_len1 = the prompt mel's frames (0 for an SFT voice), mel_len2 =
      ``int(T2 / 50 * 22050 / 256)``; ``stretch`` is built here by :func:`stretch_matrix`
    x_0 = fresh Gaussian noise (1, 80, F) per call (``rng``), or caller noise; a streaming ``flow_cache``
      (1, 80, n, 2) of [noise, mu] overwrites the first n frames of both (:func:`start_noise`)
    Euler/CFG over ``flow_estimator.onnx`` (the official contract) = :meth:`FlowStage.solve
        <cosyvoice_cpu.flow.base.FlowStage.solve>`
    -> mel (1, 80, mel_len2) without the prompt frames, and the next cache (1, 80, mel_len1 + 34, 2)

Numerically this is :meth:`cosyvoice_cpu.reference.flow.cosyvoice.FlowV1.inference` with ``noise=`` (graph contracts in
:mod:`cosyvoice_cpu.export.flow.cosyvoice`). The official v1 streaming (``token_hop_len`` windows overlapping by
20 tokens, the 34-frame Hamming cross-fade of the mel) is :class:`CosyVoiceFlowStream` in
:mod:`cosyvoice_cpu.flow.cosyvoice_stream`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES, SessionConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.base import Attrs, FlowSettings, FlowStage, prompt_mel, token_ids
from cosyvoice_cpu.flow.graphs import IO, ShapedGraph

logger = logging.getLogger(__name__)

FILES = {"flow_encoder": "flow_encoder.onnx", "flow_estimator": "flow_estimator.onnx"}
ENCODER_IO: IO = ({"token": ("int64", 2), "embedding": ("float", 2), "stretch": ("float", 2)}, ("mu", "spks"))
MEL_FRAMES_PER_SECOND = 22050 / 256  # hard-coded by the official v1 flow and length regulator
OVERLAP_TOKENS = 20  # the official token_overlap_len; also the regulator's head/tail split
SPLIT_ABOVE_TOKENS = 2 * OVERLAP_TOKENS  # more new tokens than this: stretched as head / middle / tail
CACHE_TAIL_FRAMES = 34  # the official ConditionalCFM keeps the last 34 frames (= 20 tokens) in the flow cache


@dataclass
class CosyVoiceFlowSettings(FlowSettings):
    """CosyVoice-300M stage facts (the graph artifacts' attrs). Of the shared fields only ``n_timesteps``,
    ``cfg_rate`` and ``t_scheduler`` matter (the chunk/look-ahead fields are unused)."""

    token_mel_ratio: int = 0  # no fixed ratio: the regulator stretches tokens to the mel length
    pre_lookahead_len: int = 0
    static_chunk_size: int = 0
    input_frame_rate: int = 50
    overlap_tokens: int = OVERLAP_TOKENS
    cache_tail_frames: int = CACHE_TAIL_FRAMES


def frames_for_tokens(n_tokens: int, input_frame_rate: int = 50) -> int:
    """Mel frames for ``n_tokens`` tokens: the official ``int(n / rate * 22050 / 256)`` (same float ops)."""
    return int(n_tokens / input_frame_rate * 22050 / 256)


def interpolation_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_in, n_out) float32 weights of ``F.interpolate(mode='linear', align_corners=False)`` from n_in to n_out
    positions: ``y = x @ W`` for x (C, n_in).

    Bit-exact with PyTorch's CPU kernel: scale = float32(n_in) / n_out; the source position
    ``scale * (i + 0.5) - 0.5`` is rounded once (the kernel's fused multiply-add; float64 here, then float32),
    clamped at 0; lambda = src - floor(src) in float32 and the left weight ``1 - lambda``; the last input
    position takes both weights. Equal sizes copy (identity).
    """
    if n_in <= 0 or n_out <= 0:
        raise ConfigError(f"interpolation needs >= 1 input and output position, got {n_in} -> {n_out}")
    w = np.zeros((n_in, n_out), np.float32)
    cols = np.arange(n_out)
    if n_in == n_out:
        w[cols, cols] = 1.0
        return w
    scale = np.float32(n_in) / np.float32(n_out)
    src = (np.float64(scale) * (cols + 0.5) - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    lam = np.clip(src - i0.astype(np.float32), np.float32(0.0), np.float32(1.0)).astype(np.float32)
    i1 = i0 + (i0 < n_in - 1)
    np.add.at(w, (i0, cols), (np.float32(1.0) - lam).astype(np.float32))
    np.add.at(w, (i1, cols), lam)  # float32: at the last position (1 - lam) + lam, as the kernel sums
    return w


def stretch_matrix(n_prompt: int, n_new: int, mel_len1: int, mel_len2: int, rate: int = 50) -> np.ndarray:
    """The v1 length regulator's interpolation as a (T, F) float32 matrix, T = n_prompt + n_new tokens,
    F = mel_len1 + mel_len2 frames (``InterpolateRegulator.stretch``, before its conv stack).

    Block diagonal: prompt tokens -> the first mel_len1 frames (empty prompt: no block); new tokens -> the next
    mel_len2 frames, in one piece for <= 40 new tokens, else head 20 tokens -> ``frames_for_tokens(20, rate)``
    (34) frames, middle -> the rest, tail 20 tokens -> 34 frames.
    """
    if n_new <= 0 or mel_len2 <= 0:
        raise ConfigError(
            f"need new tokens and mel frames, got {n_new} tokens -> {mel_len2} frames; give at least one more token"
        )
    if (n_prompt > 0) != (mel_len1 > 0) or n_prompt < 0 or mel_len1 < 0:
        raise ConfigError(
            f"prompt tokens ({n_prompt}) and prompt mel frames ({mel_len1}) must be both empty "
            "(an SFT voice) or both present"
        )
    w = np.zeros((n_prompt + n_new, mel_len1 + mel_len2), np.float32)
    if n_prompt:
        w[:n_prompt, :mel_len1] = interpolation_matrix(n_prompt, mel_len1)
    if n_new > SPLIT_ABOVE_TOKENS:
        k, edge = OVERLAP_TOKENS, frames_for_tokens(OVERLAP_TOKENS, rate)
        middle = mel_len2 - 2 * edge
        if middle <= 0:
            raise ConfigError(f"{mel_len2} mel frames leave no middle for {n_new} tokens (input_frame_rate {rate})")
        parts = [(k, edge), (n_new - 2 * k, middle), (k, edge)]
    else:
        parts = [(n_new, mel_len2)]
    row, col = n_prompt, mel_len1
    for tokens, frames in parts:
        w[row : row + tokens, col : col + frames] = interpolation_matrix(tokens, frames)
        row, col = row + tokens, col + frames
    return w


def start_noise(
    mu: np.ndarray,
    flow_cache: np.ndarray | None,
    mel_len1: int,
    noise: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    tail: int = CACHE_TAIL_FRAMES,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The official v1 noise and cache bookkeeping (as :meth:`FlowV1.start_noise`).

    Args:
        mu: (1, 80, T) float32 (not modified).
        flow_cache: (1, 80, n, 2) [noise, mu] from the previous chunk, or None / n = 0.
        mel_len1: prompt frames (kept at the head of the new cache).
        noise: (1, 80, >= T) starting noise, or None to draw ``standard_normal`` float32 from ``rng``.
    Returns:
        (noise (1, 80, T), mu (1, 80, T) with the cached frames put in, new cache (1, 80, mel_len1 + tail, 2)).
    """
    size = mu.shape[2]
    if noise is None:
        if rng is None:
            raise ConfigError("v1 flow noise: pass noise= or an np.random.Generator as rng=")
        z = rng.standard_normal(mu.shape, dtype=np.float32)
    else:
        noise = np.asarray(noise, dtype=np.float32)
        if noise.ndim != 3 or noise.shape[:2] != mu.shape[:2] or noise.shape[2] < size:
            raise ConfigError(f"noise must be (1, {mu.shape[1]}, >= {size}), got {noise.shape}")
        z = noise[:, :, :size].copy()
    mu = mu.copy()
    n = 0 if flow_cache is None else flow_cache.shape[2]
    if n:
        if flow_cache.ndim != 4 or flow_cache.shape[:2] != mu.shape[:2] or flow_cache.shape[3] != 2 or n > size:
            raise ConfigError(
                f"flow_cache must be (1, {mu.shape[1]}, n <= {size}, 2), got {flow_cache.shape}; pass "
                "the cache of the previous chunk of the same utterance"
            )
        z[:, :, :n] = flow_cache[..., 0]
        mu[:, :, :n] = flow_cache[..., 1]
    keep = np.r_[0:mel_len1, max(size - tail, 0) : size]  # prompt frames, then the last `tail` frames
    cache = np.stack([z[:, :, keep], mu[:, :, keep]], axis=-1)
    return z, mu, np.ascontiguousarray(cache, dtype=np.float32)


class CosyVoiceFlow(FlowStage):
    """Tokens -> mel with the exported v1 flow graphs (encoder with a stretch input; the official estimator).

    The solve is :meth:`FlowStage.solve <cosyvoice_cpu.flow.base.FlowStage.solve>`; there is no fixed noise
    table (fresh noise per call from ``rng``) and no chunk estimator (``can_stream`` is False: CosyVoice-300M
    streams whole windows, see :class:`cosyvoice_cpu.flow.cosyvoice_stream.CosyVoiceFlowStream`).

    Args:
        encoder, estimator: ``flow_encoder.onnx`` and ``flow_estimator.onnx`` paths.
        settings: :class:`CosyVoiceFlowSettings` or the artifacts' attrs dict.
        threads: ORT intra-op threads per session.
    """

    encoder_io: ClassVar[IO] = ENCODER_IO
    settings: CosyVoiceFlowSettings

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        settings: FlowSettings | Attrs | None = None,
        threads: int | SessionConfig = 1,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> None:
        if not isinstance(settings, CosyVoiceFlowSettings):
            settings = CosyVoiceFlowSettings.from_attrs(settings)
        super().__init__(encoder, estimator, None, settings, threads, arena_shrink_frames, whole)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        settings: FlowSettings | Attrs | None = None,
        threads: int | SessionConfig = 1,
        streaming: bool = False,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> CosyVoiceFlow:
        """The stage from the standard file names (:data:`FILES`); ``streaming`` is accepted for symmetry with the
        other families' ``from_dir`` (CosyVoice-300M's streaming needs no extra graph)."""
        d = Path(model_dir)
        return cls(
            d / FILES["flow_encoder"], d / FILES["flow_estimator"], settings, threads, arena_shrink_frames, whole
        )

    def encode(
        self, tokens: ArrayLike, prompt_tokens: ArrayLike, prompt_mel_frames: int, embedding: ArrayLike
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Encode prompt + tokens and stretch them to mel frames.

        Args:
            tokens: (T2,) or (1, T2) ids to synthesise; prompt_tokens: (T1,) or (1, T1), may be empty (SFT).
            prompt_mel_frames: mel_len1, the prompt mel's frames (0 with no prompt tokens).
            embedding: (1, 192) or (192,) raw x-vector.
        Returns:
            mu (1, 80, mel_len1 + mel_len2) float32, spks (1, 80) float32, mel_len1.
        """
        new, prompt = token_ids(tokens, "tokens"), token_ids(prompt_tokens, "prompt_tokens")
        rate = self.settings.input_frame_rate
        mel_len1, mel_len2 = int(prompt_mel_frames), frames_for_tokens(new.shape[1], rate)
        stretch = stretch_matrix(prompt.shape[1], new.shape[1], mel_len1, mel_len2, rate)
        emb = self.embedding_row(embedding)
        token = np.concatenate([prompt, new], axis=1)
        feeds = {"token": token, "embedding": emb, "stretch": stretch}
        mu, spks = self.encoder.run(None, feeds, self.releases_memory(mel_len2))
        return mu, spks, mel_len1

    def inference(
        self,
        tokens: ArrayLike,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        *,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
    ) -> np.ndarray:
        """Tokens -> mel (1, 80, mel_len2), as :meth:`FlowStage.inference
        <cosyvoice_cpu.flow.base.FlowStage.inference>`: ``noise`` None draws fresh Gaussian noise from ``rng``
        (required then). Streaming is :meth:`inference_cached` on overlapping windows
        (:mod:`cosyvoice_cpu.flow.cosyvoice_stream`)."""
        mel, _ = self.inference_cached(
            tokens,
            prompt_tokens,
            prompt_feat,
            embedding,
            n_timesteps=n_timesteps,
            cfg_rate=cfg_rate,
            noise=noise,
            rng=rng,
        )
        return mel

    def inference_cached(
        self,
        tokens: ArrayLike,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        *,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
        flow_cache: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens -> mel and the flow cache of the official streaming, as :meth:`FlowV1.inference`.

        Args:
            prompt_feat: (T_pm, 80) or (1, T_pm, 80) prompt mel; (0, 80) for an SFT voice (no prompt tokens).
            noise: (1, 80, >= F) starting noise; None draws fresh Gaussian noise from ``rng`` (required then).
            flow_cache: the previous chunk's cache (streaming), or None.
            others: as :meth:`encode` and :meth:`FlowStage.solve <cosyvoice_cpu.flow.base.FlowStage.solve>`.
        Returns:
            (mel (1, 80, mel_len2) float32 without the prompt frames, the new cache (1, 80, mel_len1 + 34, 2)).
        """
        feat = prompt_mel(prompt_feat)
        mu, spks, mel_len1 = self.encode(tokens, prompt_tokens, feat.shape[1], embedding)
        z, mu, cache = start_noise(mu, flow_cache, mel_len1, noise, rng, self.settings.cache_tail_frames)
        cond = np.zeros_like(mu)
        cond[:, :, :mel_len1] = feat.transpose(0, 2, 1)
        mel = self.solve(mu, spks, cond, None, n_timesteps, cfg_rate, noise=z)
        return mel[:, :, mel_len1:], cache
