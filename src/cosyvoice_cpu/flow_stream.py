"""Incremental (streaming) flow: speech tokens arrive chunk by chunk, mel frames leave chunk by chunk.

The official streaming re-runs the encoder and all Euler steps of the estimator over the *whole* prefix for
every new chunk (O(n^2) in the utterance length). Here each chunk costs a bounded window instead:

    estimator window = [prompt frames | context frames | new frames]      chunk_id = [0 .. | k_ctx .. | k ..]

* Attention is chunk-causal by chunk id (``flow_estimator_chunk.onnx``): the prompt is chunk 0 and sees only
  itself; every streamed chunk is one id and sees the prompt, the earlier chunks and itself. The estimator's
  convolutions are causal, so a frame never depends on later frames, and the trajectory x_0..x_{n-1} of a frame,
  once computed, is final.
* So the context frames are not recomputed from noise: their stored per-step inputs x_k (80 values per frame
  and step) are fed back at every Euler step, only the new frames (and the prompt, which is chunk 0 and
  therefore the same in every call) are integrated. The prompt's encoder output is fixed at the first chunk.
* The window keeps the last ``context_tokens`` tokens of history (``None``: everything, which reproduces the
  one-shot chunk-causal computation exactly; a test checks it). Frames older than the window are dropped from
  attention and the causal convolutions' left edge: a bounded approximation whose mel error is measured in
  ``docs/streaming.md``.
* The noise of a frame is the official fixed noise at its absolute position, as in a one-shot call.

Memory per stream: (steps x 80 x context frames) floats of trajectory, a few hundred KB.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow import N_MELS, FlowStage, _ids

logger = logging.getLogger(__name__)


class FlowStream:
    """One utterance's incremental flow state (not thread-safe; one per request).

    Args:
        stage: the loaded :class:`~cosyvoice_cpu.flow.FlowStage` (with its chunk estimator).
        prompt_tokens: (T_p,) prompt speech tokens (may be empty: cross-lingual / instruct use the same).
        prompt_feat: (T_p * ratio, 80) or (1, ., 80) prompt mel.
        embedding: (192,) or (1, 192) x-vector.
        n_timesteps, cfg_rate: solver settings (None: the stage defaults).
        context_tokens: tokens of history each chunk attends to (None: all of it).
    """

    def __init__(
        self,
        stage: FlowStage,
        prompt_tokens: Any,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        context_tokens: int | None = 50,
    ) -> None:
        if True not in stage.estimators:
            raise ConfigError("streaming needs the chunk estimator: load the engine with streaming_estimator=True")
        if context_tokens is not None and context_tokens < 0:
            raise ConfigError(f"context_tokens must be >= 0 or None, got {context_tokens}")
        self.stage = stage
        self.ratio = stage.settings.token_mel_ratio
        self.lookahead = stage.settings.pre_lookahead_len
        self.steps, self.cfg_rate = stage.solver_params(n_timesteps, cfg_rate)
        self.schedule = stage.schedule(self.steps)
        self.context_tokens = context_tokens
        self.prompt_tokens = _ids(prompt_tokens, "prompt_tokens")
        feat = np.asarray(prompt_feat, dtype=np.float32)
        feat = feat[0] if feat.ndim == 3 else feat
        n_prompt = self.prompt_tokens.shape[1] * self.ratio
        if feat.ndim != 2 or feat.shape != (n_prompt, N_MELS):
            raise ConfigError(f"prompt_feat must be ({n_prompt}, 80) for {self.prompt_tokens.shape[1]} prompt "
                              f"tokens, got {feat.shape}")  # fmt: skip
        self.prompt_cond = np.ascontiguousarray(feat.T[None])  # (1, 80, P)
        self.embedding = np.asarray(embedding, dtype=np.float32)
        self.history = np.zeros((1, 0), np.int64)  # every token already turned into mel
        self.prompt_mu: np.ndarray | None = None  # (1, 80, P), fixed by the first chunk
        self.spks: np.ndarray | None = None
        # the context window: encoder output, chunk ids and per-step inputs x_k of the latest generated frames
        self.ctx_mu = np.zeros((1, N_MELS, 0), np.float32)
        self.ctx_ids = np.zeros(0, np.int64)
        self.ctx_traj = np.zeros((self.steps, 1, N_MELS, 0), np.float32)
        self.chunks = 0
        self.finished = False

    @property
    def frames_done(self) -> int:
        """Mel frames produced so far."""
        return self.history.shape[1] * self.ratio

    def push(self, tokens: Any, lookahead: Any = None) -> np.ndarray:
        """Turn the next tokens into mel.

        Args:
            tokens: (C,) new speech tokens (C >= 1).
            lookahead: the next ``1..pre_lookahead_len`` tokens (a non-final chunk), or None for the last chunk.
        Returns:
            (1, 80, C * token_mel_ratio) float32 mel of the new tokens.
        """
        if self.finished:
            raise ConfigError("this stream is finished (its last chunk had no look-ahead); start a new FlowStream")
        new = _ids(tokens, "tokens")
        if new.shape[1] == 0:
            raise ConfigError("push needs at least one new token")
        if lookahead is not None and _ids(lookahead, "lookahead").shape[1] == 0:
            lookahead = None
        self.finished = lookahead is None
        keep = self.history.shape[1] if self.context_tokens is None else min(self.context_tokens,
                                                                             self.history.shape[1])  # fmt: skip
        window_tokens = np.concatenate([self.history[:, self.history.shape[1] - keep :], new], axis=1)
        mu, spks = self.stage.encode(window_tokens, self.prompt_tokens, self.embedding, context=lookahead)
        n_prompt, n_new = self.prompt_cond.shape[2], new.shape[1] * self.ratio
        if self.prompt_mu is None:
            self.prompt_mu, self.spks = mu[:, :, :n_prompt], spks
        mu_new = mu[:, :, mu.shape[2] - n_new :]
        self.chunks += 1
        mel, traj = self._integrate(mu_new)
        self._remember(new, mu_new, traj)
        return mel

    def _integrate(self, mu_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Euler over the window; returns the new frames' mel (1, 80, C) and their inputs x_k (steps, 1, 80, C)."""
        n_prompt, n_ctx, n_new = self.prompt_cond.shape[2], self.ctx_mu.shape[2], mu_new.shape[2]
        mu = np.concatenate([self.prompt_mu, self.ctx_mu, mu_new], axis=2)
        cond = np.zeros_like(mu)
        cond[:, :, :n_prompt] = self.prompt_cond
        ids = np.concatenate([np.zeros(n_prompt, np.int64), self.ctx_ids, np.full(n_new, self.chunks, np.int64)])
        feeds = self.stage.guided_feeds(mu, self.spks, cond, None, self.cfg_rate, streaming=True, chunk_id=ids)
        start = n_prompt + self.frames_done  # absolute position of the first new frame in the noise table
        x_prompt = self.stage.initial_noise(None, 1, n_prompt)
        x_new = self.stage.initial_noise(None, 1, n_new, offset=start)
        traj = np.empty((self.steps, 1, N_MELS, n_new), np.float32)
        for k, (t, dt) in enumerate(self.schedule):
            traj[k] = x_new
            x = np.concatenate([x_prompt, self.ctx_traj[k], x_new], axis=2)
            v = self.stage.velocity(feeds, x, t, self.cfg_rate, streaming=True)
            x_prompt = x_prompt + dt * v[:, :, :n_prompt]
            x_new = x_new + dt * v[:, :, n_prompt + n_ctx :]
        return x_new, traj

    def _remember(self, new: np.ndarray, mu_new: np.ndarray, traj: np.ndarray) -> None:
        """Append the chunk to the history and trim the context window to ``context_tokens``."""
        self.history = np.concatenate([self.history, new], axis=1)
        self.ctx_mu = np.concatenate([self.ctx_mu, mu_new], axis=2)
        self.ctx_ids = np.concatenate([self.ctx_ids, np.full(mu_new.shape[2], self.chunks, np.int64)])
        self.ctx_traj = np.concatenate([self.ctx_traj, traj], axis=3)
        if self.context_tokens is not None:
            keep = self.context_tokens * self.ratio
            start = self.ctx_mu.shape[2] - min(keep, self.ctx_mu.shape[2])
            self.ctx_mu = self.ctx_mu[:, :, start:]
            self.ctx_ids = self.ctx_ids[start:]
            self.ctx_traj = np.ascontiguousarray(self.ctx_traj[..., start:])
        logger.debug("flow chunk %d: %d tokens done, window %d context frames", self.chunks,
                     self.history.shape[1], self.ctx_mu.shape[2])  # fmt: skip
