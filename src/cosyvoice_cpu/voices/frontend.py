"""Prompt audio + transcript -> :class:`~cosyvoice_cpu.voices.voice.Voice`, with the copied front-end ONNX models.

As the official frontends: the prompt is read at 16 kHz; the speaker x-vector comes from ``campplus.onnx`` on
mean-normalised Kaldi fbank; the prompt speech tokens from ``speech_tokenizer_v2.onnx`` (CosyVoice-300M: ``_v1``) on
the Whisper log-mel; the prompt mel (flow condition) is the matcha log-mel of the 16 kHz prompt resampled to the
model rate (24 kHz, or 22.05 kHz for CosyVoice-300M). CosyVoice2 trims tokens and mel to the same length (2 mel
frames per token); CosyVoice-300M keeps both whole (its length regulator maps any token count to the mel).
The ~0.5 GB speech tokenizer is loaded only while a voice is made, then released.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.audio import check_prompt, load_audio, matcha_mel, resample, spk_embedding_input, whisper_log_mel
from cosyvoice_cpu.audio.io import PROMPT_MAX_SECONDS, AudioSource
from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.voices.voice import Voice, check_name

logger = logging.getLogger(__name__)

FRONTEND_RATE = 16000


class Frontend:
    """Makes voices for one model directory (``campplus`` stays loaded; it is small)."""

    def __init__(self, model_dir: str | Path, manifest: Manifest, session_config: SessionConfig) -> None:
        self.model_dir = Path(model_dir)
        self.manifest = manifest
        self.session_config = session_config
        self.campplus = open_graph(manifest.path(model_dir, "campplus"), session_config)
        if len(self.campplus.get_inputs()) != 1:
            raise ConfigError(f"{manifest.path(model_dir, 'campplus')} must have one input (fbank); re-export")

    def embedding(self, samples_16k: np.ndarray) -> np.ndarray:
        """Speaker x-vector (192,) of 16 kHz audio."""
        feats = spk_embedding_input(samples_16k)  # (1, T, 80)
        name = self.campplus.get_inputs()[0].name
        return self.campplus.run(None, {name: feats.astype(np.float32)})[0].reshape(-1).astype(np.float32)

    def speech_tokens(self, samples_16k: np.ndarray) -> np.ndarray:
        """Speech tokens (T,) int32 of 16 kHz audio; loads the speech tokenizer for this call only."""
        mel = whisper_log_mel(samples_16k)[None].astype(np.float32)  # (1, 128, T)
        sess = open_graph(self.manifest.path(self.model_dir, "speech_tokenizer"), self.session_config)
        try:
            inputs = sess.get_inputs()
            if len(inputs) != 2:
                raise ConfigError("the speech tokenizer graph must take (log-mel, length); re-export the model")
            feeds = {inputs[0].name: mel, inputs[1].name: np.array([mel.shape[2]], np.int32)}
            return sess.run(None, feeds)[0].reshape(-1).astype(np.int32)
        finally:
            del sess

    def make_voice(self, prompt: AudioSource, prompt_text: str = "", name: str = "voice") -> Voice:
        """Build a voice from prompt audio (path, bytes or file object, any common format and rate).

        Args:
            prompt: the prompt recording (1-30 s of clean speech).
            prompt_text: its transcript; "" makes a cross-lingual voice (the LM then gets no prompt).
            name: the voice's name.
        Raises:
            ConfigError: unreadable, silent, too short or too long audio; a bad name.
        """
        check_name(name)
        t0 = time.perf_counter()
        wav16 = load_audio(prompt, FRONTEND_RATE, max_seconds=PROMPT_MAX_SECONDS)
        duration = check_prompt(wav16, FRONTEND_RATE)
        embedding = self.embedding(wav16)
        tokens = self.speech_tokens(wav16)
        m = self.manifest
        mel_cfg = m.mel
        wav_model = resample(wav16, FRONTEND_RATE, m.sample_rate)
        mel = matcha_mel(
            wav_model,
            n_fft=mel_cfg["n_fft"],
            num_mels=mel_cfg["num_mels"],
            sampling_rate=mel_cfg["sampling_rate"],
            hop_size=mel_cfg["hop_size"],
            win_size=mel_cfg["win_size"],
            fmin=mel_cfg["fmin"],
            fmax=mel_cfg["fmax"],
        )
        ratio = m.token_mel_ratio  # 0 for CosyVoice-300M: its flow stretches the prompt tokens to any mel length
        n_tokens = min(mel.shape[0] // ratio, tokens.shape[0]) if ratio else tokens.shape[0]
        if n_tokens < 1:
            raise ConfigError(f"the prompt gave no speech tokens ({duration:.1f} s); use a longer, clearer recording")
        n_mel = ratio * n_tokens if ratio else mel.shape[0]
        meta = {"duration_s": round(duration, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        voice = Voice(
            name,
            prompt_text.strip(),
            tokens[:n_tokens],
            mel[:n_mel],
            embedding,
            family=m.family,
            sample_rate=m.sample_rate,
            meta=meta,
        )
        logger.info(
            "voice %r: %.1f s prompt, %d tokens, made in %.2f s", name, duration, n_tokens, time.perf_counter() - t0
        )
        return voice
