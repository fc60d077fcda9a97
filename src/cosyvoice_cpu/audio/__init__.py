"""Torch-free audio front-end: reading/writing audio and the CosyVoice2 prompt features in NumPy."""

from cosyvoice_cpu.audio.features import (
    kaldi_fbank,
    matcha_mel,
    slaney_mel_filters,
    spk_embedding_input,
    whisper_log_mel,
)
from cosyvoice_cpu.audio.io import check_prompt, load_audio, resample, write_wav

__all__ = [
    "check_prompt",
    "kaldi_fbank",
    "load_audio",
    "matcha_mel",
    "resample",
    "slaney_mel_filters",
    "spk_embedding_input",
    "whisper_log_mel",
    "write_wav",
]
