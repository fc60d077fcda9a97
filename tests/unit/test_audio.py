"""The torch-free audio front-end: features against goldens from the real implementations, audio I/O, prompt checks.

Goldens: ``python scripts/make_audio_goldens.py`` (whisper's ``log_mel_spectrogram``, the official
``matcha.utils.audio.mel_spectrogram``, and the C++ ``kaldi-native-fbank``). The references run in float32; ours in
float64. Measured max |difference| on log values (whisper log10 scale, kaldi/matcha natural log):

* whisper: 4.5e-5 (chirp), 1.5e-5 (bursts), 8.7e-7 (short);
* kaldi fbank: 4.1e-5 (bursts), 2.7e-5 (short); chirp 6.8e-4 for log energies > -12, 1.1e-2 overall;
* matcha: 1.6e-5 (bursts); chirp 1.8e-4 for values > -8, 1.2e-2 overall.

The chirp outliers sit in mel bins 13-25 nats below the frame's peak (a pure tone has nearly no energy there), where
the reference's float32 FFT rounding noise dominates: a float64 torch STFT agrees with ours to 5e-7 on matcha.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.audio import (
    check_prompt,
    kaldi_fbank,
    load_audio,
    matcha_mel,
    slaney_mel_filters,
    spk_embedding_input,
    whisper_log_mel,
    write_wav,
)
from cosyvoice_cpu.errors import ConfigError

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "audio_features.npz"

# (feature, signal): (tolerance everywhere, level above which the tight tolerance holds, tight tolerance)
TOLERANCES = {
    ("whisper", "chirp"): (1e-4, -np.inf, 1e-4),
    ("whisper", "bursts"): (1e-4, -np.inf, 1e-4),
    ("whisper", "short"): (1e-4, -np.inf, 1e-4),
    ("kaldi", "chirp"): (2e-2, -12.0, 1e-3),
    ("kaldi", "bursts"): (1e-4, -np.inf, 1e-4),
    ("kaldi", "short"): (1e-4, -np.inf, 1e-4),
    ("matcha", "chirp"): (2e-2, -8.0, 3e-4),
    ("matcha", "bursts"): (1e-4, -np.inf, 1e-4),
}
FEATURES = {"whisper": (whisper_log_mel, "sig16"), "kaldi": (kaldi_fbank, "sig16"), "matcha": (matcha_mel, "sig24")}


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def _signal(golden: dict[str, np.ndarray], key: str) -> np.ndarray:
    return golden[key].astype(np.float32) / 32768.0


@pytest.mark.parametrize(("feature", "name"), sorted(TOLERANCES))
def test_features_match_goldens(golden: dict[str, np.ndarray], feature: str, name: str) -> None:
    fn, prefix = FEATURES[feature]
    ours = fn(_signal(golden, f"{prefix}_{name}"))
    ref = golden[f"{feature}_{name}"]
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    tol_all, level, tol_tight = TOLERANCES[(feature, name)]
    diff = np.abs(ours - ref)
    assert diff.max() <= tol_all, diff.max()
    assert diff[ref > level].max() <= tol_tight, diff[ref > level].max()


def test_frame_counts() -> None:
    x = np.zeros(16000 * 2 + 399, np.float32)
    x[::7] = 0.1
    assert kaldi_fbank(x).shape == (1 + (len(x) - 400) // 160, 80)
    assert whisper_log_mel(x).shape == (128, len(x) // 160)
    assert matcha_mel(x).shape == (len(x) // 480, 80)
    assert kaldi_fbank(x[:399]).shape == (0, 80)


def test_spk_embedding_input_is_mean_normalised(golden: dict[str, np.ndarray]) -> None:
    feat = spk_embedding_input(_signal(golden, "sig16_bursts"))
    ref = golden["kaldi_bursts"] - golden["kaldi_bursts"].mean(axis=0)
    assert feat.shape == (1, *ref.shape) and feat.dtype == np.float32
    assert np.abs(feat[0] - ref).max() < 1e-4
    assert np.abs(feat[0].mean(axis=0)).max() < 1e-5
    with pytest.raises(ConfigError, match="shorter than one"):
        spk_embedding_input(np.zeros(100, np.float32))


def test_slaney_filters_equal_whispers_shipped_filters() -> None:
    spec = importlib.util.find_spec("whisper")  # locates the package without importing it (whisper imports torch)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("openai-whisper not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "mel_filters.npz"
    with np.load(path) as z:
        for n in (80, 128):
            np.testing.assert_array_equal(slaney_mel_filters(16000, 400, n), z[f"mel_{n}"])


def test_feature_input_errors() -> None:
    with pytest.raises(ConfigError, match="mono"):
        kaldi_fbank(np.zeros((2, 1000), np.float32))
    with pytest.raises(ConfigError, match="32768"):
        whisper_log_mel(np.zeros(1000, np.int16))
    with pytest.raises(ConfigError, match="longer audio"):
        whisper_log_mel(np.zeros(150, np.float32))
    with pytest.raises(ConfigError, match="longer audio"):
        matcha_mel(np.zeros(500, np.float32))


# ------------------------------------------------------------------------------------------------------------- I/O
def _tone(sr: int, seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize(
    ("suffix", "subtype", "tol"),
    [(".wav", "PCM_16", 1 / 32767), (".flac", "PCM_16", 1 / 32767), (".wav", "FLOAT", 0.0), (".ogg", "VORBIS", None)],
)
def test_round_trip(tmp_path: Path, suffix: str, subtype: str, tol: float | None) -> None:
    x = _tone(16000, 1.0)
    path = tmp_path / f"a{suffix}"
    if suffix == ".wav":
        write_wav(path, x, 16000, subtype=subtype)
    else:
        sf.write(path, x, 16000, subtype=subtype)
    y = load_audio(path, 16000)
    assert y.dtype == np.float32 and y.shape == x.shape
    if tol is not None:
        assert np.abs(y - x).max() <= tol
    else:  # lossy: only the level survives
        assert abs(np.sqrt(np.mean(y**2)) - np.sqrt(np.mean(x**2))) < 0.02
    assert np.array_equal(load_audio(path.read_bytes(), 16000), y)
    with path.open("rb") as f:
        assert np.array_equal(load_audio(f, 16000), y)


def test_stereo_is_mixed_to_mono(tmp_path: Path) -> None:
    left, right = _tone(16000, 1.0, 300.0), _tone(16000, 1.0, 500.0)
    write_wav(tmp_path / "s.wav", np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(tmp_path / "s.wav", 16000), (left + right) / 2, atol=1e-7)


def test_resample_44k1_to_16k(tmp_path: Path) -> None:
    write_wav(tmp_path / "hi.wav", _tone(44100, 1.5, 1000.0), 44100, subtype="FLOAT")
    y = load_audio(tmp_path / "hi.wav", 16000)
    assert y.shape == (24000,)
    spectrum = np.abs(np.fft.rfft(y[4000:20000]))
    assert np.fft.rfftfreq(16000, 1 / 16000)[np.argmax(spectrum)] == 1000.0  # the tone stays at 1 kHz
    assert abs(np.sqrt(np.mean(y[4000:20000] ** 2)) - 0.5 / np.sqrt(2)) < 1e-3


def test_load_audio_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_audio(tmp_path / "missing.wav", 16000)
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty"):
        load_audio(tmp_path / "empty.wav", 16000)
    (tmp_path / "notes.txt").write_text("this is not audio\n" * 20)
    with pytest.raises(ConfigError, match="cannot decode"):
        load_audio(tmp_path / "notes.txt", 16000)
    good = write_wav(tmp_path / "good.wav", _tone(16000, 1.0), 16000).read_bytes()
    (tmp_path / "corrupt.wav").write_bytes(good[:20] + bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="cannot decode"):
        load_audio(tmp_path / "corrupt.wav", 16000)
    with pytest.raises(ConfigError, match="bytes are empty"):
        load_audio(b"", 16000)
    with pytest.raises(ConfigError, match="cannot decode"):
        load_audio(b"RIFF1234garbage", 16000)
    with pytest.raises(ConfigError, match="not int"):
        load_audio(3, 16000)  # type: ignore[arg-type]  # not a file descriptor
    with pytest.raises(ConfigError, match="not a file"):
        load_audio(tmp_path, 16000)
    sf.write(tmp_path / "zero.wav", np.zeros(0, np.float32), 16000)
    with pytest.raises(ConfigError, match="no samples"):
        load_audio(tmp_path / "zero.wav", 16000)
    sf.write(tmp_path / "nan.wav", np.full(100, np.nan, np.float32), 16000, subtype="FLOAT")
    with pytest.raises(ConfigError, match="NaN"):
        load_audio(tmp_path / "nan.wav", 16000)
    with pytest.raises(ConfigError, match="positive"):
        load_audio(tmp_path / "good.wav", 0)


def test_write_wav_errors_and_clipping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="subtype"):
        write_wav(tmp_path / "a.wav", _tone(16000, 0.1), 16000, subtype="PCM_24")
    with pytest.raises(ConfigError, match="shape"):
        write_wav(tmp_path / "a.wav", np.zeros(0, np.float32), 16000)
    with pytest.raises(ConfigError, match="NaN"):
        write_wav(tmp_path / "a.wav", np.full(10, np.inf, np.float32), 16000)
    with pytest.raises(ConfigError, match="positive"):
        write_wav(tmp_path / "a.wav", _tone(16000, 0.1), 0)
    out = write_wav(tmp_path / "sub" / "loud.wav", np.array([2.0, -2.0, 0.5], np.float32), 8000)
    data, sr = sf.read(out, dtype="float32")
    assert sr == 8000 and data[0] == pytest.approx(1.0, abs=1e-4) and data[1] == -1.0
    assert sf.info(out).subtype == "PCM_16"


def test_check_prompt() -> None:
    assert check_prompt(_tone(16000, 3.0), 16000) == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="at least 1 s"):
        check_prompt(_tone(16000, 0.5), 16000)
    with pytest.raises(ConfigError, match="at most 30 s"):
        check_prompt(_tone(16000, 30.5), 16000)
    with pytest.raises(ConfigError, match="silent"):
        check_prompt(np.zeros(16000 * 2, np.float32), 16000)
    with pytest.raises(ConfigError, match="silent"):
        check_prompt(np.full(16000 * 2, 5e-5, np.float32), 16000)
    with pytest.raises(ConfigError, match="mono"):
        check_prompt(np.zeros((16000 * 2, 2), np.float32), 16000)
    bad = _tone(16000, 2.0)
    bad[5] = np.nan
    with pytest.raises(ConfigError, match="NaN"):
        check_prompt(bad, 16000)


def test_audio_package_imports_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from cosyvoice_cpu.audio import kaldi_fbank, load_audio, matcha_mel, whisper_log_mel, write_wav\n"
        "x = (0.3 * np.sin(np.arange(24000) * 0.05)).astype(np.float32)\n"
        f"write_wav(r'{tmp_path / 'x.wav'}', x, 24000)\n"
        f"y = load_audio(r'{tmp_path / 'x.wav'}', 16000)\n"
        "assert kaldi_fbank(y).shape[1] == 80 and whisper_log_mel(y).shape[0] == 128 and matcha_mel(x).shape[1] == 80\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_decoded_samples_with_their_rate_load_like_the_file_they_came_from(tmp_path) -> None:
    """``(samples, sample_rate)``: float or integer PCM, mono or channels, as a numpy user holds audio; the same
    samples written as a float wav load to the same array."""
    from cosyvoice_cpu.audio.io import load_audio

    rng = np.random.default_rng(0)
    stereo = (0.3 * rng.standard_normal((22050, 2))).astype(np.float32)
    sf.write(tmp_path / "a.wav", stereo, 22050, subtype="FLOAT")
    want = load_audio(tmp_path / "a.wav", 16000)
    np.testing.assert_allclose(load_audio((stereo, 22050), 16000), want, atol=1e-6)
    pcm = (stereo[:, 0] * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio((pcm, np.int64(16000)), 16000), pcm / 32768, atol=1e-6)
    bad = [
        ((stereo,), "integer rate"),
        ((stereo, 0), "positive sample rate"),
        ((stereo, 16000.0), "integer rate"),
        ((np.zeros((0,), np.float32), 16000), "positive sample rate"),
        ((np.array(["a"]), 16000), "numeric samples"),
        ((np.full(100, np.nan, np.float32), 16000), "NaN"),
        ((np.zeros(16000 * 40, np.float32), 16000), "at most 30 s"),
    ]
    for source, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_audio(source, 16000, max_seconds=30)
