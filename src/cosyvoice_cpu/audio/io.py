"""Audio in and out without torch: soundfile for reading/writing, soxr for resampling, and prompt sanity checks."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

# a path, a file's bytes, a binary file object, or decoded samples with their rate: ((N,) or (N, C), Hz)
AudioSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO | tuple[np.ndarray, int]

PROMPT_MIN_SECONDS = 1.0
PROMPT_MAX_SECONDS = 30.0  # the speech tokenizer's limit (the official frontend asserts it)
SILENT_PEAK = 1e-4
SILENT_RMS = 1e-5


def _describe(source: AudioSource) -> str:
    """A short name of ``source`` for error messages."""
    if isinstance(source, (str, os.PathLike)):
        return f"'{os.fspath(source)}'"
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes>"
    if isinstance(source, tuple):
        return f"<samples of shape {np.shape(source[0])} at {source[1]} Hz>" if len(source) == 2 else "<tuple>"
    return "<stream>"


# listed first in error messages when this libsndfile reads them; the others are counted
COMMON_FORMATS = ("WAV", "FLAC", "OGG", "MP3", "AIFF", "CAF")


def readable_formats() -> list[str]:
    """The container formats ``load_audio`` reads: libsndfile's, via ``soundfile.available_formats()``.

    Common ones first (MP3 needs libsndfile >= 1.1, OGG includes Vorbis and, where built in, Opus); ``RAW``
    (header-less PCM) is left out, since it cannot be decoded without being told its layout.
    """
    import soundfile as sf

    available = [f for f in sf.available_formats() if f != "RAW"]
    return [f for f in COMMON_FORMATS if f in available] + sorted(f for f in available if f not in COMMON_FORMATS)


def undecodable(name: str, error: Exception) -> ConfigError:
    """The error for input libsndfile cannot decode, naming what it can read and how to convert the rest."""
    import soundfile as sf

    formats = readable_formats()
    common = [f.lower() for f in formats if f in COMMON_FORMATS]
    others = len(formats) - len(common)
    listed = ", ".join(common) + (f" and {others} more (soundfile.available_formats())" if others else "")
    return ConfigError(
        f"cannot decode {name} as audio ({error}); libsndfile {sf.__libsndfile_version__} reads {listed}; not "
        "m4a/aac, wma or video files: convert those first, e.g. `ffmpeg -i prompt.m4a prompt.wav`"
    )


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample float samples ``(N,)`` or ``(N, C)`` with soxr "HQ": float32 ``(round(N * target/orig), ...)``."""
    if orig_sr <= 0 or target_sr <= 0:
        raise ConfigError(f"sample rates must be positive (got {orig_sr} -> {target_sr})")
    x = np.asarray(samples, dtype=np.float32)
    if orig_sr == target_sr or x.shape[0] == 0:
        return x
    import soxr

    return np.asarray(soxr.resample(x, orig_sr, target_sr, quality="HQ"), dtype=np.float32)


def load_audio(source: AudioSource, target_sr: int, max_seconds: float | None = None) -> np.ndarray:
    """Read any format libsndfile reads (:func:`readable_formats`: wav, flac, ogg, mp3, ...), mix to mono and
    resample to ``target_sr``.

    Args:
        source: a path, the file's bytes, or a binary file object.
        target_sr: the output sample rate (16000 for the tokenizer and speaker model, 24000 for the prompt mel).
        max_seconds: refuse longer audio from its header, before decoding it (a multi-hour upload never
            reaches memory).
    Returns:
        float32 mono samples ``(N,)`` in [-1, 1] (PCM is scaled by soundfile).
    Raises:
        ConfigError: missing, empty, corrupt or non-audio input, or a non-positive ``target_sr``.
    """
    import soundfile as sf

    if target_sr <= 0:
        raise ConfigError(f"target_sr must be a positive sample rate, got {target_sr}")
    name = _describe(source)
    if isinstance(source, tuple):
        return _samples(source, name, target_sr, max_seconds)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"audio file {name} does not exist (or is not a file); check the path")
        if path.stat().st_size == 0:
            raise ConfigError(f"audio file {name} is empty (0 bytes); record or export the prompt again")
        handle: str | BinaryIO = os.fspath(path)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ConfigError("the audio bytes are empty; send the content of an audio file (wav, flac, ogg, mp3 ...)")
        handle = io.BytesIO(bytes(source))
    elif hasattr(source, "read"):
        handle = source
    else:
        raise ConfigError(
            "load_audio takes a path, bytes, a binary file object or (samples, sample_rate), not "
            f"{type(source).__name__}"
        )
    if max_seconds is not None:
        try:
            info = sf.info(handle)
            if hasattr(handle, "seek"):
                handle.seek(0)
        except (sf.LibsndfileError, RuntimeError, TypeError) as e:
            raise undecodable(name, e) from e
        if info.samplerate > 0:
            _check_length(name, info.frames / info.samplerate, max_seconds)
    try:
        data, sr = sf.read(handle, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise undecodable(name, e) from e
    if data.shape[0] == 0:
        raise ConfigError(f"audio {name} holds no samples; record or export the prompt again")
    return _mono(data, int(sr), name, target_sr, "; re-export it as 16-bit PCM")


def _check_length(name: str, seconds: float, max_seconds: float | None) -> None:
    """ConfigError when audio of ``seconds`` is longer than ``max_seconds`` (None: no bound)."""
    if max_seconds is not None and seconds > max_seconds + 0.05:
        raise ConfigError(
            f"audio {name} is {seconds:.1f} s long; at most {max_seconds:.0f} s are accepted here: cut a shorter clip"
        )


def _mono(data: np.ndarray, sr: int, name: str, target_sr: int, fix: str = "") -> np.ndarray:
    """float32 samples (N, C) at ``sr`` -> mono float32 (M,) at ``target_sr``; ConfigError (ending in ``fix``) for
    NaN or infinite samples."""
    if not np.all(np.isfinite(data)):
        raise ConfigError(f"audio {name} contains NaN or infinite samples{fix}")
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    out = resample(mono, sr, int(target_sr))
    logger.debug(
        "loaded %s: %d ch, %d Hz, %d samples -> %d at %d Hz", name, data.shape[1], sr, len(mono), len(out), target_sr
    )
    return np.ascontiguousarray(out, dtype=np.float32)


def _samples(source: tuple[np.ndarray, int], name: str, target_sr: int, max_seconds: float | None) -> np.ndarray:
    """Decoded audio ``(samples, sample_rate)``: float in [-1, 1] or integer PCM (scaled by its type's range),
    (N,) or (N, C) -> mono float32 at ``target_sr``."""
    if len(source) != 2 or isinstance(source[1], bool) or not isinstance(source[1], (int, np.integer)):
        raise ConfigError(f"decoded audio is (samples, sample_rate) with an integer rate, got {name}")
    data, sr = np.asarray(source[0]), int(source[1])
    if sr <= 0 or data.ndim not in (1, 2) or data.shape[0] == 0 or data.dtype.kind not in "fiu":
        raise ConfigError(f"audio {name}: give (N,) or (N, channels) numeric samples and a positive sample rate")
    _check_length(name, data.shape[0] / sr, max_seconds)
    if data.dtype.kind in "iu":
        info = np.iinfo(data.dtype)
        data = (data.astype(np.float64) - (info.max + info.min + 1) / 2) / ((info.max - info.min + 1) / 2)
    return _mono(data.astype(np.float32).reshape(data.shape[0], -1), sr, name, target_sr)


def write_wav(path: str | os.PathLike, samples: np.ndarray, sr: int, subtype: str = "PCM_16") -> Path:
    """Write float samples ``(N,)`` or ``(N, C)`` as a wav file; ``subtype`` is ``"PCM_16"`` or ``"FLOAT"``.

    PCM_16 clips to [-1, 1] first (logged when it does). Parent directories are created. Returns the path.
    """
    import soundfile as sf

    if subtype not in ("PCM_16", "FLOAT"):
        raise ConfigError(f"write_wav subtype must be 'PCM_16' or 'FLOAT', got {subtype!r}")
    if sr <= 0:
        raise ConfigError(f"sample rate must be positive, got {sr}")
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim not in (1, 2) or x.shape[0] == 0:
        raise ConfigError(f"write_wav expects non-empty samples of shape (N,) or (N, C), got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ConfigError("write_wav got NaN or infinite samples; the synthesis produced invalid audio")
    if subtype == "PCM_16":
        peak = float(np.abs(x).max())
        if peak > 1.0:
            logger.warning("clipping %s: peak %.3f > 1.0 (write subtype='FLOAT' to keep it)", path, peak)
            x = np.clip(x, -1.0, 1.0)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(os.fspath(out), x, int(sr), subtype=subtype, format="WAV")
    return out


def check_prompt(samples: np.ndarray, sr: int) -> float:
    """Refuse prompts the models cannot use: silent, shorter than 1 s or longer than 30 s.

    Args:
        samples: float mono samples ``(N,)``.
        sr: their sample rate.
    Returns:
        The duration in seconds.
    Raises:
        ConfigError: naming the fix.
    """
    x = np.asarray(samples)
    if x.ndim != 1:
        raise ConfigError(f"the prompt must be mono samples of shape (N,), got {x.shape}; load it with load_audio")
    if sr <= 0:
        raise ConfigError(f"sample rate must be positive, got {sr}")
    seconds = x.shape[0] / sr
    if seconds < PROMPT_MIN_SECONDS:
        raise ConfigError(
            f"the prompt is {seconds:.2f} s long; use at least {PROMPT_MIN_SECONDS:.0f} s of clear speech "
            "(3-10 s is best)"
        )
    if seconds > PROMPT_MAX_SECONDS:
        raise ConfigError(
            f"the prompt is {seconds:.1f} s long; the speech tokenizer accepts at most {PROMPT_MAX_SECONDS:.0f} s, "
            "trim it (3-10 s is best)"
        )
    if not np.all(np.isfinite(x)):
        raise ConfigError("the prompt contains NaN or infinite samples; re-export it as 16-bit PCM")
    x64 = x.astype(np.float64)
    peak = float(np.abs(x64).max())
    rms = float(np.sqrt(np.mean(x64**2)))
    if peak < SILENT_PEAK or rms < SILENT_RMS:
        raise ConfigError(
            f"the prompt is silent (peak {peak:.1e}, RMS {rms:.1e}); check the recording level or the file"
        )
    return seconds
