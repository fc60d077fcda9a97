"""The CosyVoice2 prompt features in NumPy: Kaldi fbank, Whisper log-mel and the Matcha mel spectrogram.

The official frontend (``cosyvoice/cli/frontend.py``) computes three features from a prompt wav with torch:

* ``torchaudio.compliance.kaldi.fbank(speech_16k, num_mel_bins=80, dither=0, sample_frequency=16000)``, mean-normalised
  over time, for the speaker embedding (``campplus.onnx``) -> :func:`kaldi_fbank` + :func:`spk_embedding_input`;
* ``whisper.log_mel_spectrogram(speech_16k, n_mels=128)`` for the speech tokenizer -> :func:`whisper_log_mel`;
* ``matcha.utils.audio.mel_spectrogram`` (the yaml's ``feat_extractor``) on 24 kHz audio for the flow prompt mel
  -> :func:`matcha_mel`.

These mirror that arithmetic (float64 FFTs, float32 outputs); ``tests/unit/test_audio.py`` checks them against goldens
written by the real implementations (``scripts/make_audio_goldens.py``).

The filter-bank products are ``np.einsum`` (NumPy's own loop), not ``@``: the runtime makes no BLAS call at all
(``tests/unit/test_no_blas.py``). OpenBLAS's threaded GEMM can wait forever for worker threads that a ``fork()``
in another thread shut down (its ``pthread_atfork`` handler does that mid-product); a voice is made while other
libraries' threads run (the OpenVINO compile at load, a server's requests), so this path must not depend on it.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

# Kaldi's energy floor: std::numeric_limits<float>::epsilon(), as torchaudio's EPSILON.
_KALDI_EPS = float(np.finfo(np.float32).eps)


def _as_1d_float(samples: np.ndarray, name: str) -> np.ndarray:
    """``samples`` as a float64 1-D array ``(N,)``; a ConfigError for anything else."""
    x = np.asarray(samples)
    if x.ndim == 2 and 1 in x.shape:
        x = x.reshape(-1)
    if x.ndim != 1:
        raise ConfigError(f"{name} expects mono samples of shape (N,), got shape {x.shape}; mix to mono first")
    if not np.issubdtype(x.dtype, np.floating):
        raise ConfigError(f"{name} expects float samples in [-1, 1], got dtype {x.dtype}; divide int PCM by 32768")
    return x.astype(np.float64)


def _frames(x: np.ndarray, length: int, hop: int) -> np.ndarray:
    """Frames of ``x`` (N,) without padding (snip edges): ``(1 + (N - length) // hop, length)``, or ``(0, length)``."""
    if x.shape[0] < length:
        return np.zeros((0, length), dtype=x.dtype)
    n = 1 + (x.shape[0] - length) // hop
    return np.lib.stride_tricks.sliding_window_view(x, length)[::hop][:n]


# ---------------------------------------------------------------------------------------------------------- mel banks
def _hz_to_mel_slaney(f: np.ndarray | float) -> np.ndarray:
    """librosa's Slaney mel scale (htk=False): linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    mels = f / f_sp
    log_t = f >= min_log_hz
    return np.where(log_t, min_log_mel + np.log(np.maximum(f, 1e-300) / min_log_hz) / logstep, mels)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_hz_to_mel_slaney`."""
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    freqs = f_sp * m
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), freqs)


@lru_cache(maxsize=8)
def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """``librosa.filters.mel(sr=, n_fft=, n_mels=, fmin=, fmax=)``, Slaney scale and norm: float32 ``(n_mels, F)``.

    ``F = n_fft // 2 + 1``. Bit-identical to librosa 0.11 (float64 maths, float32 storage, as librosa does).

    Whisper's shipped ``mel_filters.npz`` is exactly this for ``(16000, 400, 80|128)``. Read-only (cached).
    """
    fmax = sr / 2.0 if fmax is None else float(fmax)
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        weights[i] = np.maximum(0, np.minimum(-ramps[i] / fdiff[i], ramps[i + 2] / fdiff[i + 1]))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]  # in float64, stored as float32 (librosa)
    weights.flags.writeable = False
    return weights


@lru_cache(maxsize=4)
def kaldi_mel_banks(num_bins: int, padded_len: int, sr: float, low_freq: float, high_freq: float) -> np.ndarray:
    """Kaldi's triangular mel banks (``1127 ln(1 + f/700)``): float64 ``(num_bins, padded_len//2 + 1)``.

    The Nyquist column is zero, as in Kaldi (its banks cover ``padded_len/2`` bins) and torchaudio (which pads it).
    """
    nyquist = 0.5 * sr
    if high_freq <= 0.0:
        high_freq += nyquist
    if not 0.0 <= low_freq < high_freq <= nyquist:
        raise ConfigError(f"mel band [{low_freq}, {high_freq}] Hz must lie inside [0, {nyquist}] Hz; fix low/high_freq")

    def mel(f: np.ndarray | float) -> np.ndarray:
        return 1127.0 * np.log(1.0 + np.asarray(f, dtype=np.float64) / 700.0)

    mel_low, mel_high = mel(low_freq), mel(high_freq)
    delta = (mel_high - mel_low) / (num_bins + 1)
    fft_mel = mel(np.arange(padded_len // 2) * (sr / padded_len))[None, :]
    left = mel_low + np.arange(num_bins)[:, None] * delta
    center, right = left + delta, left + 2 * delta
    up = (fft_mel - left) / (center - left)
    down = (right - fft_mel) / (right - center)
    banks = np.where((fft_mel > left) & (fft_mel < right), np.where(fft_mel <= center, up, down), 0.0)
    banks = np.pad(banks, ((0, 0), (0, 1)))
    banks.flags.writeable = False
    return banks


# ----------------------------------------------------------------------------------------------------------- features
def kaldi_fbank(
    samples_16k: np.ndarray,
    num_mel_bins: int = 80,
    sample_frequency: float = 16000.0,
    frame_length_ms: float = 25.0,
    frame_shift_ms: float = 10.0,
    preemphasis: float = 0.97,
    low_freq: float = 20.0,
    high_freq: float = 0.0,
) -> np.ndarray:
    """Kaldi log mel filterbank as ``torchaudio.compliance.kaldi.fbank(..., dither=0)`` with its other defaults.

    Snip edges, DC offset removal per frame, pre-emphasis, Povey window, power spectrum of a zero-padded power-of-two
    FFT, ``log(max(energy, FLT_EPSILON))``, no energy term. Float samples are used as given (not scaled to int16).

    Args:
        samples_16k: float mono samples ``(N,)`` at ``sample_frequency``.
    Returns:
        float32 ``(T, num_mel_bins)`` with ``T = 1 + (N - 400) // 160`` (0 rows when ``N < 400``).
    """
    x = _as_1d_float(samples_16k, "kaldi_fbank")
    win = int(sample_frequency * frame_length_ms * 0.001)
    hop = int(sample_frequency * frame_shift_ms * 0.001)
    padded = 1 << (win - 1).bit_length()
    frames = _frames(x, win, hop)
    frames = frames - frames.mean(axis=1, keepdims=True)
    frames = np.concatenate([frames[:, :1] * (1.0 - preemphasis), frames[:, 1:] - preemphasis * frames[:, :-1]], 1)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / (win - 1))) ** 0.85
    spec = np.fft.rfft(frames * povey, n=padded, axis=1)
    power = spec.real**2 + spec.imag**2
    banks = kaldi_mel_banks(num_mel_bins, padded, float(sample_frequency), low_freq, high_freq)
    return np.log(np.maximum(np.einsum("tf,mf->tm", power, banks), _KALDI_EPS)).astype(np.float32)


def spk_embedding_input(samples_16k: np.ndarray) -> np.ndarray:
    """The campplus input: :func:`kaldi_fbank` minus its mean over time, float32 ``(1, T, 80)``."""
    feat = kaldi_fbank(samples_16k).astype(np.float64)
    if feat.shape[0] == 0:
        raise ConfigError("the prompt is shorter than one 25 ms frame; use a prompt of 1 to 30 seconds")
    return (feat - feat.mean(axis=0, keepdims=True))[None].astype(np.float32)


def whisper_log_mel(samples_16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """``whisper.log_mel_spectrogram(audio, n_mels)``: float32 ``(n_mels, N // 160)``.

    Centered STFT (reflect pad 200), periodic Hann 400, hop 160, last frame dropped, ``log10(max(mel, 1e-10))``
    floored at its maximum minus 8, then ``(x + 4) / 4``. The floor depends on the whole clip.
    """
    n_fft, hop = 400, 160
    x = _as_1d_float(samples_16k, "whisper_log_mel")
    if x.shape[0] <= n_fft // 2:
        raise ConfigError(f"whisper_log_mel needs more than {n_fft // 2} samples (got {x.shape[0]}); use longer audio")
    x = np.pad(x, n_fft // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    spec = np.fft.rfft(_frames(x, n_fft, hop)[:-1] * window, axis=1)  # (T, 201)
    power = spec.real**2 + spec.imag**2
    mel = np.einsum("mf,tf->mt", slaney_mel_filters(16000, n_fft, n_mels).astype(np.float64), power)  # (n_mels, T)
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def matcha_mel(
    samples_24k: np.ndarray,
    n_fft: int = 1920,
    num_mels: int = 80,
    sampling_rate: int = 24000,
    hop_size: int = 480,
    win_size: int = 1920,
    fmin: float = 0.0,
    fmax: float = 8000.0,
) -> np.ndarray:
    """``matcha.utils.audio.mel_spectrogram(..., center=False)`` transposed: float32 ``(T, num_mels)``.

    Reflect pad ``(n_fft - hop) // 2`` each side, periodic Hann, ``sqrt(re² + im² + 1e-9)``, Slaney mel filters,
    ``log(max(x, 1e-5))``. ``T = 1 + (N + n_fft - hop - n_fft) // hop`` (N // 480 for the defaults).
    """
    if win_size != n_fft:
        raise ConfigError(f"matcha_mel supports win_size == n_fft only (got {win_size} and {n_fft})")
    x = _as_1d_float(samples_24k, "matcha_mel")
    pad = (n_fft - hop_size) // 2
    if x.shape[0] <= pad:
        raise ConfigError(f"matcha_mel needs more than {pad} samples (got {x.shape[0]}); use longer audio")
    x = np.pad(x, pad, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win_size) / win_size)
    spec = np.fft.rfft(_frames(x, n_fft, hop_size) * window, axis=1)  # (T, n_fft//2+1)
    mag = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    filters = slaney_mel_filters(sampling_rate, n_fft, num_mels, fmin, fmax).astype(np.float64)
    mel = np.einsum("tf,mf->tm", mag, filters)  # (T, num_mels)
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)
