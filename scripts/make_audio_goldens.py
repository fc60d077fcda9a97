"""Write tests/golden/audio_features.npz: reference front-end features from the real implementations.

Needs the export/reference environment (torch, openai-whisper, the official CosyVoice code with matcha, and
``kaldi-native-fbank`` from tests/parity/requirements.txt). Real torchaudio is not needed: Kaldi fbank comes from the
independent C++ implementation ``kaldi-native-fbank`` with the options torchaudio's ``kaldi.fbank`` gets from the
official frontend (dither 0, snip edges, 16 kHz, 80 bins; float samples unscaled).

    python scripts/make_audio_goldens.py [--out tests/golden/audio_features.npz]

Keys: ``sig16_<name>`` / ``sig24_<name>`` int16 test signals (float = int16 / 32768), ``whisper_<name>`` (128, T),
``kaldi_<name>`` (T, 80), ``matcha_<name>`` (T, 80) float32, and ``meta`` (a JSON string of package versions).
"""

from __future__ import annotations

import argparse
import json
import logging
from importlib.metadata import version
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "golden" / "audio_features.npz"


def _to_int16(x: np.ndarray) -> np.ndarray:
    """Float samples ``(N,)`` in [-1, 1] quantised to int16 (so the stored signal is exactly the tested one)."""
    return np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16)


def _chirp(sr: int, n: int, f0: float, f1: float, amp: float) -> np.ndarray:
    """A linear sine sweep ``(n,)`` from ``f0`` to ``f1`` Hz with a short fade-in."""
    t = np.arange(n) / sr
    dur = n / sr
    x = amp * np.sin(2 * np.pi * (f0 * t + 0.5 * (f1 - f0) / dur * t**2))
    x[: sr // 100] *= np.linspace(0.0, 1.0, sr // 100)
    return x


def _bursts(sr: int, n: int, seed: int) -> np.ndarray:
    """Speech-like noise ``(n,)``: low-passed noise in ~4 Hz syllable bursts with digital silence between them."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(n + 64)
    kernel = np.hanning(17)
    noise = np.convolve(noise, kernel / kernel.sum(), mode="same")[:n]
    t = np.arange(n) / sr
    env = np.clip(np.sin(2 * np.pi * 4.0 * t), 0.0, None) ** 2
    env[: n // 8] = 0.0  # leading silence: exact zeros exercise log floors
    return 0.6 * env * noise / np.abs(noise).max()


def make_signals() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The 16 kHz and 24 kHz test signals as int16, lengths chosen to hit frame edges."""
    sig16 = {
        "chirp": _to_int16(_chirp(16000, 12800 + 399, 80.0, 7600.0, 0.5)),  # (N-400) % 160 == 159
        "bursts": _to_int16(_bursts(16000, 8000 + 400, seed=1)),  # (N-400) % 160 == 0
        "short": _to_int16(0.05 * np.random.default_rng(2).standard_normal(1234)),
    }
    sig24 = {
        "chirp": _to_int16(_chirp(24000, 16800 + 479, 60.0, 11000.0, 0.7)),  # N % 480 == 479
        "bursts": _to_int16(_bursts(24000, 12000, seed=3)),  # N % 480 == 0
    }
    return sig16, sig24


def reference_features(sig16: dict[str, np.ndarray], sig24: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run whisper, kaldi-native-fbank and the official matcha mel on the signals."""
    import kaldi_native_fbank as knf
    import torch
    import whisper
    from matcha.utils.audio import mel_spectrogram  # the yaml's feat_extractor

    out: dict[str, np.ndarray] = {}
    for name, pcm in sig16.items():
        x = pcm.astype(np.float32) / 32768.0
        out[f"whisper_{name}"] = whisper.log_mel_spectrogram(torch.from_numpy(x)[None], n_mels=128)[0].numpy()
        opts = knf.FbankOptions()
        opts.frame_opts.dither = 0.0
        opts.frame_opts.snip_edges = True
        opts.frame_opts.samp_freq = 16000
        opts.mel_opts.num_bins = 80
        fb = knf.OnlineFbank(opts)
        fb.accept_waveform(16000, x.tolist())
        fb.input_finished()
        frames = [np.asarray(fb.get_frame(i), dtype=np.float32) for i in range(fb.num_frames_ready)]
        out[f"kaldi_{name}"] = np.stack(frames) if frames else np.zeros((0, 80), np.float32)
    for name, pcm in sig24.items():
        x = torch.from_numpy(pcm.astype(np.float32) / 32768.0)[None]
        mel = mel_spectrogram(
            x,
            n_fft=1920,
            num_mels=80,
            sampling_rate=24000,
            hop_size=480,
            win_size=1920,
            fmin=0,
            fmax=8000,
            center=False,
        )
        out[f"matcha_{name}"] = mel[0].T.contiguous().numpy()
    return {k: v.astype(np.float32) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    """Write the golden file; print its keys and size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sig16, sig24 = make_signals()
    arrays: dict[str, np.ndarray] = {f"sig16_{k}": v for k, v in sig16.items()}
    arrays.update({f"sig24_{k}": v for k, v in sig24.items()})
    arrays.update(reference_features(sig16, sig24))
    meta = {p: version(p) for p in ("torch", "openai-whisper", "kaldi-native-fbank", "librosa", "numpy")}
    arrays["meta"] = np.array(json.dumps(meta))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    for k, v in arrays.items():
        print(f"{k:20s} {v.dtype!s:8s} {v.shape}")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KB); {meta}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
