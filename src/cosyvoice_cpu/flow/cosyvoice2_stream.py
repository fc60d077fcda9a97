"""Incremental (streaming) flow: speech tokens arrive chunk by chunk, mel frames leave chunk by chunk.

The official streaming re-runs the encoder and all Euler steps of the estimator over the prompt *and the whole
prefix* for every new chunk (O(n^2) in the utterance length). Here the estimator runs on the new chunk's frames
only (``flow_estimator_stream.onnx``), on cached activations of what came before:

* attention is chunk-causal: the prompt is chunk 0 and sees only itself, each streamed chunk sees the prompt, the
  earlier chunks and itself; the estimator's convolutions are causal. So the past's contribution to a new chunk
  is fixed once computed: per Euler step and CFG row, every transformer block's ``norm1`` output for the past
  frames (keys/values are linear in it) and every causal convolution's last two input frames;
* the prompt's part depends only on the voice and the solver settings (steps, CFG rate): a
  :class:`CosyVoice2PromptCache`, computed once with the prompt alone and shared by every request with that voice;
* the context is the latest ``context_tokens`` of generated frames (``None``: all of them, which reproduces the
  one-shot chunk-causal solve exactly; a test checks it). Older frames leave the attention window; the
  convolution states always continue from the frame just before the chunk, so nothing else is approximated;
* a frame's starting noise is the official fixed noise at its absolute position, as in a one-shot call.

Memory: the prompt cache holds ``steps x rows x L x T_prompt x 256`` values (CosyVoice2: L = 56; for a 3 s prompt
at 10 steps with CFG 87 MB in float16, the int8 exports' cache type, 172 MB in float32); each stream holds the same
for its context window (28 / 57 MB for 50 frames). The graph returns only the frames the window keeps
(``keep_frames``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.base import N_MELS, token_ids
from cosyvoice_cpu.flow.common import chunk_ids, prompt_frames, stream_session
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow, stream_layout
from cosyvoice_cpu.flow.graphs import cache_dtype, cache_storage, extend_cache
from cosyvoice_cpu.flow.guidance import guidance_rows, guide, guided_rows

logger = logging.getLogger(__name__)


@dataclass
class CosyVoice2PromptCache:
    """Everything the prompt contributes to streamed chunks, for one voice and one (steps, cfg_rate).

    Attributes:
        mu: (1, 80, P) prompt encoder output; spks: (1, 80) projected speaker vector.
        h: per Euler step, (L, rows, P, width) cached ``norm1`` outputs of the prompt frames: float16 when the
            graph takes float16 caches (the int8 recipes), else float32 or float16 storage as ``build(dtype=)``
            asks (float16: half the memory, widened to float32 for each call of a float32 graph).
        conv: per Euler step, (rows, S, 2) float32 causal-convolution states at the prompt's end.
        advice: None (the whole prompt is cached: its length costs no streamed chunk anything again).
    """

    mu: np.ndarray
    spks: np.ndarray
    h: list[np.ndarray]
    conv: list[np.ndarray]
    advice: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.h) + sum(a.nbytes for a in self.conv) + self.mu.nbytes

    @classmethod
    def build(
        cls,
        stage: CosyVoice2Flow,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        dtype: type[np.floating] = np.float32,
    ) -> CosyVoice2PromptCache:
        """Integrate the prompt frames alone (chunk 0) and keep their activations at every step (stored as
        ``dtype``: float32, or float16 for half the memory; always float16 for a graph that takes float16)."""
        sess = stream_session(stage)
        wire, dtype = cache_storage(sess, "prompt_h", dtype)
        steps, cfg_rate = stage.solver_params(n_timesteps, cfg_rate)
        tokens = token_ids(prompt_tokens, "prompt_tokens")
        feat = prompt_frames(prompt_feat, tokens.shape[1] * stage.settings.token_mel_ratio)
        mu, spks = _encode(stage, tokens, embedding)
        layers, width, state = stream_layout(sess)
        rows, n = guidance_rows(cfg_rate), feat.shape[2]
        empty = np.zeros((layers, rows, 0, width), wire)
        feeds = {
            **guided_rows(mu, spks, feat, rows),
            "context_h": empty,
            "prompt_h": empty,
            "conv_state": np.zeros((rows, state, 2), np.float32),
            "keep_frames": np.array(n, np.int64),
        }
        x = stage.initial_noise(None, 1, n)
        cache = cls(mu, spks, [], [])
        for t, dt in stage.schedule(steps):
            feeds["x"] = np.concatenate([x] * rows)
            feeds["t"] = np.full(rows, t, np.float32)
            v, new_h, conv = sess.run(None, feeds)
            x = x + dt * guide(v, cfg_rate, 1)
            cache.h.append(new_h.astype(dtype, copy=False))
            cache.conv.append(conv)
        logger.debug("prompt cache: %d frames, %d steps, %.1f MB", n, steps, cache.nbytes / 1e6)
        return cache


class CosyVoice2FlowStream:
    """One utterance's incremental flow state (not thread-safe; one per request).

    Args:
        stage: the loaded :class:`~cosyvoice_cpu.flow.cosyvoice2.CosyVoice2Flow` (with its stream estimator).
        prompt_tokens: (T_p,) prompt speech tokens; prompt_feat: (T_p * ratio, 80) prompt mel.
        embedding: (192,) or (1, 192) x-vector.
        n_timesteps, cfg_rate: solver settings (None: the stage defaults).
        context_tokens: tokens of history each chunk attends to (None: all of it).
        prompt_cache: a :class:`CosyVoice2PromptCache` built for the same voice and settings (built here if None).
    """

    grid = None  # a chunk's attention is its own push's frames: any chunk end costs the same

    def __init__(
        self,
        stage: CosyVoice2Flow,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        context_tokens: int | None = 25,
        prompt_cache: CosyVoice2PromptCache | None = None,
    ) -> None:
        if context_tokens is not None and context_tokens < 0:
            raise ConfigError(f"context_tokens must be >= 0 or None, got {context_tokens}")
        self.sess = stream_session(stage)
        self.stage = stage
        self.ratio = stage.settings.token_mel_ratio
        self.lookahead = stage.settings.pre_lookahead_len
        self.steps, self.cfg_rate = stage.solver_params(n_timesteps, cfg_rate)
        self.rows = guidance_rows(self.cfg_rate)
        self.schedule = stage.schedule(self.steps)
        self.context_tokens = context_tokens
        self.prompt_tokens = token_ids(prompt_tokens, "prompt_tokens")
        self.n_prompt = self.prompt_tokens.shape[1] * self.ratio
        self.embedding = np.asarray(embedding, dtype=np.float32)
        if prompt_cache is None:
            prompt_cache = CosyVoice2PromptCache.build(
                stage, self.prompt_tokens, prompt_feat, self.embedding, self.steps, self.cfg_rate
            )
        if len(prompt_cache.h) != self.steps or prompt_cache.h[0].shape[1:3] != (self.rows, self.n_prompt):
            raise ConfigError("the prompt cache was built for other solver settings or another voice")
        self.prompt = prompt_cache
        layers, width, _ = stream_layout(self.sess)
        self.h_dtype = cache_dtype(self.sess)  # what the graph takes and returns the caches in
        # per Euler step: the context's cached activations and the convolution states after the latest frame
        self.ctx_h = [np.zeros((layers, self.rows, 0, width), self.h_dtype) for _ in range(self.steps)]
        self.conv = list(prompt_cache.conv)
        self.history = np.zeros((1, 0), np.int64)  # every token already turned into mel
        self.ctx_mu = np.zeros((1, N_MELS, 0), np.float32)  # the context frames' encoder output (for checks)
        self.chunks = 0
        self.finished = False

    @property
    def frames_done(self) -> int:
        """Mel frames produced so far."""
        return self.history.shape[1] * self.ratio

    def push(self, tokens: ArrayLike, lookahead: ArrayLike | None = None) -> np.ndarray:
        """Turn the next tokens into mel.

        Args:
            tokens: (C,) new speech tokens (C >= 1).
            lookahead: the next ``1..pre_lookahead_len`` tokens (a non-final chunk), or None for the last chunk.
        Returns:
            (1, 80, C * token_mel_ratio) float32 mel of the new tokens.
        """
        new, lookahead = chunk_ids(tokens, lookahead, self.finished, "CosyVoice2FlowStream")
        self.finished = lookahead is None
        done = self.history.shape[1]
        keep = done if self.context_tokens is None else min(self.context_tokens, done)
        window = np.concatenate([self.history[:, done - keep :], new], axis=1)
        mu, _ = self.stage.encode(window, self.prompt_tokens, self.embedding, context=lookahead)
        n_new = new.shape[1] * self.ratio
        mu_new = mu[:, :, mu.shape[2] - n_new :]
        mel = self._integrate(mu_new)
        self.chunks += 1
        self.history = np.concatenate([self.history, new], axis=1)
        self.ctx_mu = self._trim(np.concatenate([self.ctx_mu, mu_new], axis=2))
        logger.debug(
            "flow chunk %d: %d tokens done, context %d frames",
            self.chunks,
            self.history.shape[1],
            self.ctx_h[0].shape[2],
        )
        return mel

    def _integrate(self, mu_new: np.ndarray) -> np.ndarray:
        """Euler over the new frames on the cached past; updates the context caches. Returns (1, 80, C)."""
        n_new = mu_new.shape[2]
        feeds = guided_rows(mu_new, self.prompt.spks, np.zeros_like(mu_new), self.rows)
        # the graph returns only the frames the context window keeps
        keep = n_new if self.context_tokens is None else min(n_new, self.context_tokens * self.ratio)
        feeds["keep_frames"] = np.array(keep, np.int64)
        x = self.stage.initial_noise(None, 1, n_new, offset=self.n_prompt + self.frames_done)
        for k, (t, dt) in enumerate(self.schedule):
            feeds.update(
                x=np.concatenate([x] * self.rows),
                t=np.full(self.rows, t, np.float32),
                prompt_h=self.prompt.h[k].astype(self.h_dtype, copy=False),
                context_h=self.ctx_h[k],
                conv_state=self.conv[k],
            )
            v, new_h, self.conv[k] = self.sess.run(None, feeds)
            x = x + dt * guide(v, self.cfg_rate, 1)
            self.ctx_h[k] = extend_cache(self.sess, self.ctx_h[k], new_h, self._context_frames)
        return x

    @property
    def _context_frames(self) -> int | None:
        """Frames of history the caches keep (None: all)."""
        return None if self.context_tokens is None else self.context_tokens * self.ratio

    def _trim(self, a: np.ndarray) -> np.ndarray:
        """Keep the last ``context_tokens * ratio`` frames along axis 2 (the time axis of mu)."""
        frames = self._context_frames
        if frames is None or a.shape[2] <= frames:
            return a
        return np.ascontiguousarray(a[:, :, a.shape[2] - frames :])


def _encode(stage: CosyVoice2Flow, prompt_tokens: np.ndarray, embedding: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's own encoder output (no generated tokens after it: zero look-ahead) and spks."""
    if prompt_tokens.shape[1] == 0:
        _, spks = stage.encode(np.zeros((1, 1), np.int64), prompt_tokens, embedding)
        return np.zeros((1, N_MELS, 0), np.float32), spks
    return stage.encode(prompt_tokens, np.zeros((1, 0), np.int64), embedding)
