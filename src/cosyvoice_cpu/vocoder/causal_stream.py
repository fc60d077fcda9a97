"""Streaming vocoder for the causal (Fun-CosyVoice3, v3) HiFT: bounded work per chunk, output equal to one-shot.

Upstream (``CosyVoice3Model.token2wav``) keeps the HiFT consistent across chunks by brute force: it appends
each chunk's mel to a per-request cache, re-runs ``hift.inference`` over *the whole mel so far* (``finalize=False``
until the last chunk: the wave covers ``T - 8`` frames) and returns only the samples past ``speech_offset``.
Because the causal HiFT's past samples never change (every conv but two short look-aheads is causal, the
phase is a running sum, and the noise comes from a fixed table indexed by absolute sample), that equals one
call over the whole utterance; but a sentence costs O(n^2) vocoder work.

:class:`CausalVocoderStream` gives the same samples for O(chunk + context) work per push:

mel chunk ``(1, 80, n)`` --append--> mel buffer (absolute frame index)
  -> ``hift_f0.onnx`` on frames ``[f0_done - 8, T)`` (the predictor's 4 causal k=3 convs see 8 frames back; its
     first conv 3 ahead) -> F0 of frames ``[f0_done, T - 3)``, exact
  -> :func:`~cosyvoice_cpu.vocoder.source.source_v3` from the carried float64 phase sum -> their source samples
     (noise rows at absolute positions: an upstream-style table, or fresh uniform draws from ``rng``)
  -> ``hift_decode.onnx`` on frames ``[emitted - C, T)`` with ``C = stream_context_frames`` (the graph's left
     receptive field, 30 at the released sizes) and the not-yet-known last 3 frames of source zero
  -> samples of frames ``[emitted, T - 5)`` (frame ``t`` needs ``conv_pre`` of frame ``t + 1``, which looks 4
     ahead; upstream waits ``T - 8``). The final push flushes the rest with zero look-ahead, as one-shot does.

The first ``C`` frames of each decode window see zero padding instead of their true past; they are never
emitted, and everything after them depends only on real inputs, so the stream equals ``Vocoder(mel)`` over
the whole utterance up to float32 rounding (ORT's conv sums round differently for other window lengths):
max abs difference 2e-7 on the tiny fixture and 1e-7 at the released sizes (10 s), F0 and source bitwise.
Work per push: decode over ``C + new + 5`` frames and F0 over ``8 + new + 3``; memory: those windows only.
"""

from __future__ import annotations

import logging

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.vocoder.hift import Vocoder
from cosyvoice_cpu.vocoder.source import SourceNoise, source_v3

logger = logging.getLogger(__name__)

F0_CONTEXT_FRAMES = 8  # CausalConvRNNF0Predictor: 4 left-causal convs of kernel 3 after the look-ahead one


class CausalVocoderStream:
    """Per-utterance causal HiFT state for streamed mel chunks (not thread-safe; one per request).

    Args:
        vocoder: a :class:`~cosyvoice_cpu.vocoder.hift.Vocoder` on v3 graphs (attrs ``causal``, sine type "v3").
        rng: draws the uniform source noise of each chunk's new samples (default: a fresh ``default_rng()``).
        noise: instead of ``rng``, a fixed table like upstream's (``sine_noise (1, >= total samples, H)``),
            indexed by absolute sample; the stream then equals ``vocoder(whole_mel, noise=noise)``.
        context_frames: decode context; default the export's ``stream_context_frames``. Smaller values are
            cheaper but no longer exact.
    """

    def __init__(
        self,
        vocoder: Vocoder,
        rng: np.random.Generator | None = None,
        noise: SourceNoise | None = None,
        context_frames: int | None = None,
    ) -> None:
        cfg = vocoder.source_cfg
        if not vocoder.causal or cfg.sine_type != "v3":
            raise ConfigError("CausalVocoderStream needs a v3 (causal) HiFT export; use streaming.VocoderStream")
        attrs = vocoder.attrs
        self.vocoder = vocoder
        self.cfg = cfg
        self.context = int(attrs.get("stream_context_frames", 30) if context_frames is None else context_frames)
        self.hold = int(attrs.get("stream_hold_frames", vocoder.conv_pre_look_right + 1))
        self.look = vocoder.f0_look_right
        if self.context < 0:
            raise ConfigError(f"context_frames must be >= 0, got {self.context}")
        self.rng = rng if rng is not None else np.random.default_rng()
        self.noise = noise
        phase = noise.initial_phase if noise is not None else self.rng.random((1, cfg.harmonics), dtype=np.float32)
        self.initial_phase = np.asarray(phase, dtype=np.float32)[:1]
        self.mel = np.zeros((1, vocoder.in_channels, 0), np.float32)  # frames [mel_start, frames)
        self.mel_start = 0
        self.source = np.zeros((1, 1, 0), np.float32)  # samples of frames [source_start, f0_done)
        self.source_start = 0
        self.frames = 0  # mel frames pushed
        self.f0_done = 0  # frames whose F0 and source are final
        self.emitted = 0  # frames whose samples were returned
        self.carry: np.ndarray | None = None  # float64 phase sum before f0_done
        self.finished = False

    def push(self, mel: np.ndarray, final: bool = False) -> np.ndarray:
        """Add the next mel frames ``(1, 80, n)`` (n may be 0); return the ``(N,)`` float32 samples now final.

        The final push returns everything left; the stream cannot be used after it.
        """
        if self.finished:
            raise ConfigError("this CausalVocoderStream has finished; start a new one per utterance")
        mel = np.asarray(mel, dtype=np.float32)
        if mel.ndim != 3 or mel.shape[:2] != (1, self.vocoder.in_channels):
            want = f"(1, {self.vocoder.in_channels}, n)"
            raise ConfigError(f"CausalVocoderStream.push expects mel {want} (one utterance), got {mel.shape}")
        self.mel = np.concatenate([self.mel, mel], axis=2)
        self.frames += mel.shape[2]
        f0_end = self.frames if final else self.frames - self.look
        if f0_end > self.f0_done:
            self._extend_source(f0_end)
        end = self.frames if final else min(self.frames - self.hold, self.f0_done - 1)
        out = self._decode(end) if end > self.emitted else np.zeros(0, np.float32)
        self.finished = final
        self._trim()
        return out

    def _extend_source(self, f0_end: int) -> None:
        """F0 and source of frames ``[f0_done, f0_end)``."""
        up = self.cfg.upsample
        start = max(0, self.f0_done - F0_CONTEXT_FRAMES)
        window = self.mel[:, :, start - self.mel_start : self.frames - self.mel_start]
        f0 = self.vocoder.f0(window)[:, self.f0_done - start : f0_end - start]
        a, b = self.f0_done * up, f0_end * up
        if self.noise is not None:
            table = np.asarray(self.noise.sine_noise, dtype=np.float32)
            if table.shape[1] < b:
                raise ConfigError(f"the stream's noise table has {table.shape[1]} rows; {b} samples need more")
            rows = table[:1, a:b]
        else:
            rows = self.rng.random((1, b - a, self.cfg.harmonics), dtype=np.float32)
        source, self.carry = source_v3(f0, self.cfg, SourceNoise(self.initial_phase, rows), self.f0_done, self.carry)
        self.source = np.concatenate([self.source, source], axis=2)
        self.f0_done = f0_end

    def _decode(self, end: int) -> np.ndarray:
        """Samples of frames ``[emitted, end)`` from a decode window starting ``context`` frames earlier."""
        up = self.cfg.upsample
        start = max(0, self.emitted - self.context)
        mel = self.mel[:, :, start - self.mel_start : self.frames - self.mel_start]
        source = np.zeros((1, 1, mel.shape[2] * up), np.float32)
        known = self.source[:, :, (start - self.source_start) * up :]
        source[:, :, : known.shape[2]] = known  # frames past f0_done stay zero: no emitted sample reads them
        wave = self.vocoder.decode(mel, source)[0]
        out = wave[(self.emitted - start) * up : (end - start) * up]
        logger.debug("causal hift stream: frames [%d, %d) from a %d-frame window", self.emitted, end, mel.shape[2])
        self.emitted = end
        return out

    def _trim(self) -> None:
        """Drop mel frames and source samples no later window reads."""
        keep = max(0, min(self.f0_done - F0_CONTEXT_FRAMES, self.emitted - self.context))
        if keep > self.mel_start:
            self.mel = self.mel[:, :, keep - self.mel_start :]
            self.mel_start = keep
        keep = max(0, self.emitted - self.context)
        if keep > self.source_start:
            self.source = self.source[:, :, (keep - self.source_start) * self.cfg.upsample :]
            self.source_start = keep
