"""Incremental (streaming) v3 flow: the official prefix recompute, without recomputing the prefix.

The official Fun-CosyVoice3 streams by running the whole flow again over prompt + every token so far for each
chunk (``CausalMaskedDiffWithDiT.inference(streaming=True, finalize=...)``; O(n^2)), keeping only the new frames.
Its DiT attention is chunk-causal over absolute frames (50-frame chunks from the prompt's first frame), its conv
position embedding is causal, and a frame's mu depends only on tokens up to 3 ahead (the look-ahead layer),
which a non-final call already has. So within each Euler step, a *complete* 50-frame chunk never changes again:

* per Euler step and CFG row we cache every block's keys (after RoPE) and values of the complete chunks, and
  the conv position embedding's inputs on the 30 frames before the first open frame (``flow_estimator_stream.onnx``
  of v3, :mod:`cosyvoice_cpu.export.flow.cosyvoice3_stream`);
* a push runs the estimator on the *window* = the open (incomplete) chunk's earlier frames + the new frames,
  then commits the chunks that became complete. Extra work per push: at most 49 recomputed frames, none when
  the push before ended on a chunk boundary (the first push: the prompt frames the prompt cache does not hold, 6
  to 54: :func:`stable_prompt_frames`): :attr:`grid` asks the engine's chunk plan for such ends
  (:class:`~cosyvoice_cpu.flow.common.ChunkPlan`), as the official chunk hops (25 tokens, the first padded to
  the prompt's boundary) are;
* the prompt's complete chunks whose mu cannot depend on generated tokens (those ending at least
  ``pre_lookahead_len`` tokens before the prompt's end) are a :class:`CosyVoice3PromptCache`, one per voice and solver
  setting; the remaining prompt frames are recomputed with the first chunk, as the official code does;
* the encoder runs on the window's tokens (plus the 2 tokens its causal conv needs); a frame's starting noise is
  the official fixed noise at its absolute position.

With ``context_tokens=None`` the chunks equal the official recompute's (a test and the export gate check it).
A bound drops the oldest committed generated frames from the cache (the prompt cache stays): cheaper, approximate.

Memory per frame, Euler step and CFG row: ``L x 2 x I`` floats (released DiT: 22 x 2048 x 4 B = 180 kB; x 10 steps
x 2 rows = 3.6 MB per cached frame: a 100-frame prompt cache is 360 MB, a 50-frame context 180 MB).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.base import token_ids
from cosyvoice_cpu.flow.common import chunk_ids, prompt_frames, stream_session
from cosyvoice_cpu.flow.cosyvoice3 import CosyVoice3Flow, stream_layout
from cosyvoice_cpu.flow.graphs import cache_dtype, cache_storage, extend_cache
from cosyvoice_cpu.flow.guidance import guidance_rows, guide, guided_rows

logger = logging.getLogger(__name__)


def stable_prompt_frames(prompt_tokens: int, ratio: int, lookahead: int, chunk: int) -> int:
    """Frames of a ``prompt_tokens``-token prompt that a :class:`CosyVoice3PromptCache` holds: its complete
    ``chunk``-frame chunks ending at least ``lookahead`` tokens before its end (their mu cannot depend on generated
    tokens). The first push of every stream computes the prompt's other frames again, with its new frames."""
    return max(0, prompt_tokens - lookahead) * ratio // chunk * chunk


def cheapest_prompt_lengths(prompt_tokens: int, ratio: int, lookahead: int, chunk: int) -> tuple[int, int]:
    """The prompt lengths in tokens (the nearest at most ``prompt_tokens``, the next one above it) whose first push
    computes only the look-ahead's ``lookahead * ratio`` prompt frames again; (0, n) where no shorter one exists."""
    step = chunk // ratio
    shorter = prompt_tokens - (prompt_tokens - lookahead) % step
    return max(shorter, 0), shorter + step


def first_push_advice(prompt_tokens: int, frames: int, ratio: int, lookahead: int, chunk: int) -> str | None:
    """What to tell the user of a voice whose streamed requests' first push computes over half a chunk of its prompt
    again (``frames``: the prompt frames its cache holds), with the prompt lengths that would compute least; None
    for a voice that computes less again."""
    again = prompt_tokens * ratio - frames
    if again <= chunk // 2:
        return None
    shorter, longer = cheapest_prompt_lengths(prompt_tokens, ratio, lookahead, chunk)
    lengths = f"{shorter} or {longer}" if shorter > lookahead else f"{longer}"
    return (
        f"its prompt is {prompt_tokens} speech tokens: the first streamed chunk of every request computes {again} of "
        f"the prompt's mel frames again at each Euler step; a prompt of {lengths} tokens would compute "
        f'{lookahead * ratio} (first audio: docs/streaming.md, "First audio depends on the voice\'s length")'
    )


@dataclass
class CosyVoice3PromptCache:
    """The prompt's committed chunks (frames ``[0, frames)``) for one voice and one (steps, cfg_rate).

    Attributes:
        frames: committed prompt frames (a multiple of the chunk); spks: (1, 80) projected speaker vector.
        k, v: per Euler step, (L, rows, frames, I) keys (after RoPE) and values: float16 when the graph takes
            float16 caches (the int8 recipes), else float32 or float16 storage as ``build(dtype=)`` asks
            (float16: half the memory, widened to float32 for each call of a float32 graph).
        conv: per Euler step, (rows, 2D, K-1) float32 conv position embedding inputs before frame ``frames``.
        advice: when the first push of every stream computes over half a chunk of the prompt again, how many
            frames and the prompt lengths that would compute least (:func:`first_push_advice`); else None.
    """

    frames: int
    spks: np.ndarray
    k: list[np.ndarray]
    v: list[np.ndarray]
    conv: list[np.ndarray]
    advice: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for group in (self.k, self.v, self.conv) for a in group)

    @classmethod
    def build(
        cls,
        stage: CosyVoice3Flow,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        dtype: type[np.floating] = np.float32,
    ) -> CosyVoice3PromptCache:
        """Integrate the prompt's stable complete chunks alone and keep their keys/values at every step (stored
        as ``dtype``: float32, or float16 for half the memory; always float16 for a graph that takes float16)."""
        sess = stream_session(stage)
        wire, dtype = cache_storage(sess, "prompt_k", dtype)
        steps, cfg_rate = stage.solver_params(n_timesteps, cfg_rate)
        s = stage.settings
        tokens = token_ids(prompt_tokens, "prompt_tokens")
        feat = prompt_frames(prompt_feat, tokens.shape[1] * s.token_mel_ratio)
        frames = stable_prompt_frames(tokens.shape[1], s.token_mel_ratio, s.pre_lookahead_len, stage.chunk_frames)
        advice = first_push_advice(tokens.shape[1], frames, s.token_mel_ratio, s.pre_lookahead_len, stage.chunk_frames)
        rows = guidance_rows(cfg_rate)
        layers, width, state, hist = stream_layout(sess)
        empty = np.zeros((layers, rows, 0, width), wire)
        conv0 = np.zeros((rows, state, hist), np.float32)
        emb = np.asarray(embedding, dtype=np.float32)
        if frames == 0:
            _, spks = stage.encode(tokens[:, :1] if tokens.shape[1] else np.zeros((1, 1), np.int64), [], emb)
            none = empty.astype(dtype)
            return cls(0, spks, [none] * steps, [none] * steps, [conv0] * steps, advice)
        mu, spks = stage.encode(tokens, [], emb)
        feeds = {
            **guided_rows(mu[:, :, :frames], spks, feat[:, :, :frames], rows),
            "prompt_k": empty,
            "prompt_v": empty,
            "context_k": empty,
            "context_v": empty,
            "conv_state": conv0,
            "offset": np.array(0, np.int64),
            "keep_frames": np.array(frames, np.int64),
            "chunk_frames": np.array(stage.chunk_frames, np.int64),
        }
        x = stage.initial_noise(None, 1, frames)
        cache = cls(frames, spks, [], [], [], advice)
        schedule = stage.schedule(steps)
        for (_, dt), time_feed in zip(schedule, stage.time_feeds(sess, schedule, rows)):
            feeds.update(x=np.concatenate([x] * rows), **time_feed)
            v, new_k, new_v, conv_in = sess.run(None, feeds)
            x = x + dt * guide(v, cfg_rate, 1)
            cache.k.append(new_k.astype(dtype, copy=False))
            cache.v.append(new_v.astype(dtype, copy=False))
            cache.conv.append(_next_state(conv0, conv_in, frames, hist))
        logger.debug(
            "v3 prompt cache: %d of %d frames, %d steps, %.1f MB", frames, feat.shape[2], steps, cache.nbytes / 1e6
        )
        return cache


class CosyVoice3FlowStream:
    """One utterance's incremental v3 flow (not thread-safe; one per request). API as
    :class:`~cosyvoice_cpu.flow.cosyvoice2_stream.CosyVoice2FlowStream`.

    Args:
        stage: a :class:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow` with its stream estimator.
        prompt_tokens: (T_p,) prompt speech tokens; prompt_feat: (T_p * ratio, 80) prompt mel.
        embedding: (192,) or (1, 192) x-vector.
        n_timesteps, cfg_rate: solver settings (None: the stage defaults).
        context_tokens: generated tokens of committed history kept in the cache (None: all, the official result).
        prompt_cache: a :class:`CosyVoice3PromptCache` for the same voice and settings (built here if None).
    """

    def __init__(
        self,
        stage: CosyVoice3Flow,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        context_tokens: int | None = None,
        prompt_cache: CosyVoice3PromptCache | None = None,
    ) -> None:
        if context_tokens is not None and context_tokens < 0:
            raise ConfigError(f"context_tokens must be >= 0 or None, got {context_tokens}")
        if not isinstance(stage, CosyVoice3Flow):
            raise ConfigError(
                "CosyVoice3FlowStream needs a CosyVoice3Flow (a v3 model directory); use CosyVoice2FlowStream for v2"
            )
        self.sess = stream_session(stage)
        self.stage = stage
        self.ratio = stage.settings.token_mel_ratio
        self.lookahead = stage.settings.pre_lookahead_len
        self.chunk = stage.chunk_frames
        self.steps, self.cfg_rate = stage.solver_params(n_timesteps, cfg_rate)
        self.rows = guidance_rows(self.cfg_rate)
        self.schedule = stage.schedule(self.steps)
        self.context_tokens = context_tokens
        self.tokens = token_ids(prompt_tokens, "prompt_tokens")
        self.n_prompt = self.tokens.shape[1] * self.ratio
        self.feat = prompt_frames(prompt_feat, self.n_prompt)
        self.embedding = np.asarray(embedding, dtype=np.float32)
        if prompt_cache is None:
            prompt_cache = CosyVoice3PromptCache.build(
                stage, self.tokens, prompt_feat, self.embedding, self.steps, self.cfg_rate
            )
        if len(prompt_cache.k) != self.steps or prompt_cache.k[0].shape[1] != self.rows:
            raise ConfigError("the prompt cache was built for other solver settings; build one for these")
        if prompt_cache.frames > self.n_prompt:
            raise ConfigError("the prompt cache was built for a longer prompt (another voice)")
        self.prompt = prompt_cache
        layers, width, _, self.hist = stream_layout(self.sess)
        self.kv_dtype = cache_dtype(self.sess, "prompt_k")  # what the graph takes and returns keys/values in
        self.ctx_k = [np.zeros((layers, self.rows, 0, width), self.kv_dtype) for _ in range(self.steps)]
        self.ctx_v = list(self.ctx_k)
        self.conv = list(prompt_cache.conv)
        self.committed = prompt_cache.frames  # frames [0, committed) are in the caches (or trimmed away)
        self.done = 0  # generated frames returned so far
        self.chunks = 0
        self.finished = False

    @property
    def frames_done(self) -> int:
        """Mel frames produced so far."""
        return self.done

    @property
    def grid(self) -> tuple[int, int]:
        """(prompt tokens, tokens per attention chunk): a push that ends on a chunk boundary commits all its
        frames; one that ends inside a chunk leaves that chunk's frames to be computed again by the next push
        (up to 49 of them per push, each Euler step)."""
        return self.n_prompt // self.ratio, self.chunk // self.ratio

    def push(self, tokens: ArrayLike, lookahead: ArrayLike | None = None) -> np.ndarray:
        """Turn the next tokens into mel.

        Args:
            tokens: (C,) new speech tokens (C >= 1).
            lookahead: the next ``1..pre_lookahead_len`` tokens (a non-final chunk, the official
                ``finalize=False``), or None for the last chunk.
        Returns:
            (1, 80, C * token_mel_ratio) float32 mel of the new tokens.
        """
        new, ahead = chunk_ids(tokens, lookahead, self.finished, "CosyVoice3FlowStream")
        n_ahead = 0 if ahead is None else ahead.shape[1]
        if n_ahead > self.lookahead:
            raise ConfigError(f"lookahead has {n_ahead} tokens; pass at most pre_lookahead_len = {self.lookahead}")
        self.finished = ahead is None
        self.tokens = np.concatenate([self.tokens, new], axis=1)
        s, end = self.committed, self.tokens.shape[1] * self.ratio
        first = max(0, s // self.ratio - 2)  # the look-ahead layer's causal conv reaches 2 tokens back
        mu, spks = self.stage.encode(self.tokens[:, first:], [], self.embedding, context=ahead)
        mu = np.ascontiguousarray(mu[:, :, s - first * self.ratio :])
        cond = np.zeros_like(mu)
        if s < self.n_prompt:
            cond[:, :, : self.n_prompt - s] = self.feat[:, :, s:]
        # frames whose mu is final (a short look-ahead leaves the last tokens' mu provisional)
        stable = end - (0 if self.finished else (self.lookahead - n_ahead) * self.ratio)
        commit = max(s, stable // self.chunk * self.chunk)
        mel = self._integrate(mu, spks, cond, s, commit - s)
        self.committed = commit
        start = self.n_prompt + self.done - s
        self.done += new.shape[1] * self.ratio
        self.chunks += 1
        logger.debug("v3 flow chunk %d: window [%d, %d), committed %d", self.chunks, s, end, commit)
        return mel[:, :, start:]

    def _integrate(self, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, offset: int, n_commit: int) -> np.ndarray:
        """Euler over the window frames on the caches; commits the first ``n_commit`` frames. -> (1, 80, T)."""
        size = mu.shape[2]
        feeds = {
            **guided_rows(mu, spks, cond, self.rows),
            "offset": np.array(offset, np.int64),
            "keep_frames": np.array(n_commit, np.int64),
            "chunk_frames": np.array(self.chunk, np.int64),
        }
        x = self.stage.initial_noise(None, 1, size, offset=offset)
        times = self.stage.time_feeds(self.sess, self.schedule, self.rows)
        for k, (_, dt) in enumerate(self.schedule):
            feeds.update(
                x=np.concatenate([x] * self.rows),
                **times[k],
                prompt_k=self.prompt.k[k].astype(self.kv_dtype, copy=False),
                prompt_v=self.prompt.v[k].astype(self.kv_dtype, copy=False),
                context_k=self.ctx_k[k],
                context_v=self.ctx_v[k],
                conv_state=self.conv[k],
            )
            v, new_k, new_v, conv_in = self.sess.run(None, feeds)
            x = x + dt * guide(v, self.cfg_rate, 1)
            if n_commit:
                self.ctx_k[k] = extend_cache(self.sess, self.ctx_k[k], new_k, self._context_frames)
                self.ctx_v[k] = extend_cache(self.sess, self.ctx_v[k], new_v, self._context_frames)
                self.conv[k] = _next_state(self.conv[k], conv_in, n_commit, self.hist)
        return x

    @property
    def _context_frames(self) -> int | None:
        """Committed generated frames the caches keep (None: all)."""
        return None if self.context_tokens is None else self.context_tokens * self.ratio


def _next_state(state: np.ndarray, conv_in: np.ndarray, n: int, hist: int) -> np.ndarray:
    """Conv state (rows, 2D, hist) before frame ``offset + n`` from the state before ``offset`` and the window's
    conv inputs (rows, 2D, T)."""
    return np.ascontiguousarray(np.concatenate([state, conv_in], axis=2)[:, :, n : n + hist])
