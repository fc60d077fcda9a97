"""The official CosyVoice-300M (v1) streaming token2wav, flow and mel side (NumPy + ONNX Runtime, no torch).

The official ``CosyVoiceModel.tts(stream=True)`` cuts the utterance's speech tokens into overlapping windows
and runs the whole flow (:meth:`CosyVoiceFlow.inference`) on each one:

    hop = token_min_hop_len = 2 * input_frame_rate = 100 tokens (``stream_scale_factor`` 1 keeps it there),
    overlap = token_overlap_len = 20 tokens
    window k (not final) = tokens[k*hop : k*hop + hop + overlap], cut as soon as that many tokens exist
    final window        = tokens[K*hop :] once the LM has finished (fewer than hop + overlap tokens; the whole
                          utterance when K = 0)

Each window is encoded together with the voice's prompt tokens and stretched to mel frames (> 40 new tokens:
20-token head -> 34 frames, middle, 20-token tail -> 34 frames), so consecutive windows meet on 20 shared
tokens = 34 frames. Across windows:

    flow_cache (1, 80, mel_len1 + 34, 2): [noise, mu] of the prompt frames and the window's last 34 frames; the
        next window starts from them (same prompt noise, and its 34 head frames solved from the previous tail's
        noise and mu)
    mel overlap (1, 80, 34): a non-final window holds back its last 34 mel frames; the next window's first
        34 frames are cross-faded with them: ``new * hamming(68)[:34] + held * hamming(68)[34:]`` (float64)

:meth:`CosyVoiceFlowStream.push_window` returns the mel the official code hands to HiFT *before* prepending HiFT's own
20-frame mel cache (``hift_cache_dict['mel']``, with ``cache_source`` and the speech fade: the vocoder side).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.base import N_MELS, token_ids
from cosyvoice_cpu.flow.cosyvoice import CosyVoiceFlow, frames_for_tokens

logger = logging.getLogger(__name__)


def hop_tokens(input_frame_rate: int = 50) -> int:
    """The official v1 ``token_min_hop_len`` (= ``token_max_hop_len`` reached with ``stream_scale_factor`` 1)."""
    return 2 * input_frame_rate


def fade_in_out(mel: np.ndarray, held: np.ndarray, window: np.ndarray) -> np.ndarray:
    """The first ``len(window) // 2`` frames of ``mel`` (1, 80, T) faded in over the last as many of ``held``,
    computed in float64 (the official torch code multiplies float32 mel by a float64 numpy window)."""
    n = window.shape[0] // 2
    out = mel.copy()
    out[..., :n] = mel[..., :n].astype(np.float64) * window[:n] + held[..., -n:].astype(np.float64) * window[n:]
    return out


class CosyVoiceFlowStream:
    """One utterance streamed as the official v1 ``tts(stream=True)`` does, flow and mel side.

    A :class:`~cosyvoice_cpu.flow.base.FlowStream`: :meth:`next_window` says which tokens to render next, given
    how many the LM has produced, and :meth:`render` renders them (:meth:`push_window` on the window's ids); or cut
    windows yourself by the rules in the module doc and call :meth:`push_window`.

    Args:
        stage: the loaded :class:`~cosyvoice_cpu.flow.cosyvoice.CosyVoiceFlow`.
        prompt_tokens: (T1,) voice prompt tokens, may be empty (SFT); prompt_feat: (T_pm, 80) prompt mel or (0, 80).
        embedding: (1, 192) x-vector.
        n_timesteps, cfg_rate: solver settings (stage defaults if None).
        rng: the generator each window's fresh noise is drawn from (required unless every push passes noise).
        hop: tokens per window step (default the official 100 at 50 Hz).
        max_hop: the hop doubles after every window up to this (the official ``stream_scale_factor`` 2 with
            ``token_max_hop_len``); default ``hop``: a fixed hop, the official default (factor 1).
    """

    def __init__(
        self,
        stage: CosyVoiceFlow,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        rng: np.random.Generator | None = None,
        hop: int | None = None,
        max_hop: int | None = None,
    ) -> None:
        s = stage.settings
        self.stage = stage
        self.prompt_tokens = token_ids(prompt_tokens, "prompt_tokens")
        self.prompt_feat = np.asarray(prompt_feat, dtype=np.float32).reshape(-1, N_MELS)
        self.embedding = np.asarray(embedding, dtype=np.float32)
        self.n_timesteps, self.cfg_rate = stage.solver_params(n_timesteps, cfg_rate)
        self.rng = rng
        self.overlap = s.overlap_tokens
        self.hop = hop_tokens(s.input_frame_rate) if hop is None else int(hop)
        self.max_hop = self.hop if max_hop is None else int(max_hop)
        if not self.overlap < self.hop <= self.max_hop:  # a window (hop + overlap) > 2 overlap: head/mid/tail split
            raise ConfigError(
                f"need {self.overlap} (the overlap) < hop <= max_hop, got hop {self.hop} and max_hop {self.max_hop}"
            )
        self.mel_overlap = frames_for_tokens(self.overlap, s.input_frame_rate)  # 34
        self.window = np.hamming(2 * self.mel_overlap)
        self.flow_cache = np.zeros((1, N_MELS, 0, 2), np.float32)
        self.held = np.zeros((1, N_MELS, 0), np.float32)
        self.offset = 0  # utterance index of the next window's first token
        self._tail: np.ndarray | None = None  # the previous window's last `overlap` tokens
        self.finished = False

    @property
    def window_tokens(self) -> int:
        """Tokens in a non-final window: hop + overlap (120 at 50 Hz)."""
        return self.hop + self.overlap

    @property
    def hold_at(self) -> int:
        """Tokens after which the LM may pause until the first window's audio exists: the first window's."""
        return self.window_tokens

    def render(self, tokens: Sequence[int], start: int, end: int, final: bool) -> np.ndarray:
        """The window ``tokens[start:end]`` through the flow (:meth:`push_window`)."""
        return self.push_window(tokens[start:end], final)

    def next_window(self, n_available: int, llm_done: bool) -> tuple[int, int, bool] | None:
        """The next window as (start, end, final) indices into the utterance's tokens, or None to wait.

        Non-final once ``n_available - offset >= hop + overlap``; final (the rest) once the LM is done.
        """
        if self.finished:
            return None
        if n_available - self.offset >= self.window_tokens:
            return self.offset, self.offset + self.window_tokens, False
        if llm_done:
            return self.offset, n_available, True
        return None

    def push_window(self, tokens: ArrayLike, final: bool, noise: np.ndarray | None = None) -> np.ndarray:
        """Run one window through the flow; returns its new mel (1, 80, n) float32.

        Args:
            tokens: the window's ids (see the module doc); a window after the first must begin with the
                previous window's last ``overlap`` tokens.
            final: the last window of the utterance (nothing held back).
            noise: (1, 80, >= frames) starting noise for this window instead of a draw from ``rng``.
        Returns:
            non-final: the window's mel, its first 34 frames faded with the held frames, without its last 34
            frames (held for the next window); final: the whole faded mel.
        """
        if self.finished:
            raise ConfigError(
                "this utterance's stream already ended with a final window; start a new CosyVoiceFlowStream"
            )
        ids = token_ids(tokens, "tokens")
        n = ids.shape[1]
        if self._tail is not None and not np.array_equal(ids[0, : self.overlap], self._tail):
            raise ConfigError(
                f"a window must start with the previous window's last {self.overlap} tokens "
                f"(window k = tokens[k*hop : k*hop + hop + {self.overlap}])"
            )
        if not final and n <= 2 * self.overlap:
            raise ConfigError(
                f"a non-final window needs > {2 * self.overlap} tokens (hop + overlap = {self.window_tokens}), got {n}"
            )
        mel, self.flow_cache = self.stage.inference_cached(
            ids,
            self.prompt_tokens,
            self.prompt_feat,
            self.embedding,
            n_timesteps=self.n_timesteps,
            cfg_rate=self.cfg_rate,
            noise=noise,
            rng=self.rng,
            flow_cache=self.flow_cache,
        )
        if self.held.shape[2]:
            if mel.shape[2] < self.mel_overlap:
                raise ConfigError(
                    f"window of {n} tokens gives {mel.shape[2]} mel frames, fewer than the "
                    f"{self.mel_overlap}-frame fade; pass at least {self.overlap} tokens"
                )
            mel = fade_in_out(mel, self.held, self.window)
        if final:
            self.finished = True
            self.held = np.zeros((1, N_MELS, 0), np.float32)
            return mel
        self.held = mel[:, :, -self.mel_overlap :]
        self._tail = ids[0, -self.overlap :].copy()
        self.offset += n - self.overlap
        self.hop = min(2 * self.hop, self.max_hop)
        logger.debug("v1 stream window of %d tokens -> %d mel frames (offset %d)", n, mel.shape[2], self.offset)
        return mel[:, :, : -self.mel_overlap]
