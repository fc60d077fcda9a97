"""The undecodable-audio error names what libsndfile reads (issue #28: it told users to convert mp3, which works)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.audio import load_audio
from cosyvoice_cpu.errors import ConfigError


def _tone(sr: int = 16000, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_readable_formats_are_soundfiles() -> None:
    from cosyvoice_cpu.audio.io import readable_formats

    formats = readable_formats()
    assert set(formats) == set(sf.available_formats()) - {"RAW"}
    assert formats[:3] == ["WAV", "FLAC", "OGG"]


@pytest.mark.skipif("MP3" not in sf.available_formats(), reason="this libsndfile has no MP3 support")
def test_mp3_prompt_loads(tmp_path: Path) -> None:
    path = tmp_path / "prompt.mp3"
    sf.write(path, _tone(), 16000, format="MP3")
    y = load_audio(path, 16000)
    assert abs(len(y) - 16000) < 2000 and float(np.abs(y).max()) > 0.1


@pytest.mark.parametrize("source", ["file", "bytes"])
def test_undecodable_names_supported_formats(tmp_path: Path, source: str) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("this is not audio\n" * 20)
    arg = path if source == "file" else path.read_bytes()
    for max_seconds in (None, 30.0):  # the header check (sf.info) and the decode (sf.read) say the same
        with pytest.raises(ConfigError) as e:
            load_audio(arg, 16000, max_seconds=max_seconds)
        msg = str(e.value)
        assert msg.startswith("cannot decode") and "convert mp3" not in msg
        assert "wav, flac, ogg" in msg and "ffmpeg" in msg and "m4a" in msg
        if "MP3" in sf.available_formats():
            assert "mp3" in msg
        assert msg.count("\n") == 0


def test_ogg_opus_loads_when_available() -> None:
    if "OPUS" not in sf.available_subtypes("OGG"):
        pytest.skip("this libsndfile has no Opus support")
    buf = io.BytesIO()
    sf.write(buf, _tone(48000), 48000, format="OGG", subtype="OPUS")
    assert len(load_audio(buf.getvalue(), 16000)) > 8000
