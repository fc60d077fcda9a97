"""A vocoder stream that joins separately vocoded chunks without seams (CosyVoice2, CosyVoice-300M).

Vocoder joins (:class:`VocoderStream`), after the official CosyVoice2 streaming: each chunk is vocoded with the
previous chunk's last ``overlap_frames`` mel frames in front, the harmonic source of those frames is carried
over (phase continuity), and the audio of the overlap is cross-faded with the previous chunk's held-back tail.
Unlike the official Hamming halves (whose sum is ~1.08, a small bump at every join) the fade here is a
complementary raised cosine: the two weights sum to exactly 1. Work per chunk is bounded (overlap + chunk).
"""

from __future__ import annotations

import logging

import numpy as np

from cosyvoice_cpu.vocoder.hift import Vocoder

logger = logging.getLogger(__name__)

OVERLAP_FRAMES = 8  # official CosyVoice2 mel_cache_len


def crossfade_weights(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(fade_in, fade_out) float32 (n,) raised-cosine weights with fade_in + fade_out == 1."""
    fade_in = (0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 0.5) / n)).astype(np.float32)
    return fade_in, (1.0 - fade_in).astype(np.float32)


class VocoderStream:
    """Per-utterance HiFT state for streamed mel chunks (not thread-safe; one per request).

    Args:
        vocoder: the shared :class:`~cosyvoice_cpu.vocoder.hift.Vocoder`.
        rng: the request's generator for the source noise.
        overlap_frames: mel frames re-vocoded at each join and cross-faded.
    """

    def __init__(self, vocoder: Vocoder, rng: np.random.Generator, overlap_frames: int = OVERLAP_FRAMES) -> None:
        self.vocoder = vocoder
        self.rng = rng
        self.overlap_frames = overlap_frames
        self.overlap_samples = overlap_frames * vocoder.source_cfg.upsample
        self.fade_in, self.fade_out = crossfade_weights(self.overlap_samples)
        self.mel_tail: np.ndarray | None = None  # (1, 80, overlap_frames)
        self.source_tail: np.ndarray | None = None  # (1, 1, overlap_samples)
        self.wave_tail: np.ndarray | None = None  # (overlap_samples,) held back for the cross-fade

    def push(self, mel: np.ndarray, final: bool) -> np.ndarray:
        """Vocode the next mel chunk (1, 80, T); returns the (N,) float32 samples that are now final.

        A non-final chunk holds back its last ``overlap_samples`` (released, cross-faded, by the next push);
        the final push returns everything that is left.
        """
        mel = np.asarray(mel, dtype=np.float32)
        if self.mel_tail is not None:
            mel = np.concatenate([self.mel_tail, mel], axis=2)
        wave, source = self.vocoder(mel, rng=self.rng, cache_source=self.source_tail)
        wave = wave[0]
        if self.wave_tail is not None:
            n = min(self.overlap_samples, len(wave), len(self.wave_tail))
            wave = wave.copy()
            wave[:n] = wave[:n] * self.fade_in[:n] + self.wave_tail[len(self.wave_tail) - n :] * self.fade_out[:n]
        if final or mel.shape[2] <= self.overlap_frames:
            if not final:  # a chunk shorter than the overlap: keep everything for the next join
                logger.debug("mel chunk of %d frames is within the overlap; holding it", mel.shape[2])
            self.mel_tail = None if final else mel
            self.source_tail = None if final else source
            self.wave_tail = None if final else wave
            return wave if final else np.zeros(0, np.float32)
        self.mel_tail = mel[:, :, -self.overlap_frames :]
        self.source_tail = source[:, :, -self.overlap_samples :]
        self.wave_tail = wave[-self.overlap_samples :]
        return wave[: -self.overlap_samples]
