"""Voices: validated on construction, saved atomically, loaded with precise errors for corrupt or foreign files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.voices.voice import Voice, VoiceError, check_name


def _voice(name: str = "alice", frames: int = 100) -> Voice:
    rng = np.random.default_rng(0)
    return Voice(name, "Good morning everyone.", rng.integers(0, 6561, frames // 2),
                 (rng.standard_normal((frames, 80)) - 5).astype(np.float32), rng.standard_normal(192),
                 meta={"source": "alice.wav"})  # fmt: skip


def test_round_trip_is_exact(tmp_path: Path) -> None:
    v = _voice("Zoë 2")
    path = v.save(tmp_path / "voices" / "Zoë 2.npz")
    w = Voice.load(path)
    assert (w.name, w.prompt_text, w.family, w.sample_rate, w.meta) == (v.name, v.prompt_text, "cosyvoice2", 24000,
                                                                        {"source": "alice.wav"})  # fmt: skip
    for a in ("speech_tokens", "mel", "embedding"):
        np.testing.assert_array_equal(getattr(w, a), getattr(v, a))
    assert w.speech_tokens.dtype == np.int32 and w.mel.dtype == np.float32
    assert abs(w.duration - 2.0) < 1e-9
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_failed_save_keeps_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _voice().save(tmp_path / "alice.npz")
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        _voice(frames=40).save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["alice.npz"]


@pytest.mark.parametrize("name", ["", "../etc/passwd", "a/b", "..", " lead", "x" * 65, "nul\0byte", ".hidden"])
def test_unsafe_names_are_refused(name: str) -> None:
    with pytest.raises(VoiceError, match="is not allowed"):
        check_name(name)


def test_invalid_arrays_are_refused() -> None:
    rng = np.random.default_rng(1)
    with pytest.raises(VoiceError, match=r"mel must be \(frames, 80\)"):
        Voice("a", "", [1, 2], np.zeros((4, 40)), np.zeros(192))
    with pytest.raises(VoiceError, match="embedding must hold 192"):
        Voice("a", "", [1, 2], np.zeros((4, 80)), np.zeros(80))
    with pytest.raises(VoiceError, match="NaN or infinite"):
        Voice("a", "", [1, 2], np.full((4, 80), np.nan), rng.standard_normal(192))
    with pytest.raises(VoiceError, match="no valid speech tokens"):
        Voice("a", "", [], np.zeros((10, 80)), rng.standard_normal(192))
    with pytest.raises(VoiceError, match="no valid speech tokens"):
        Voice("a", "", [1, 7000], np.zeros((4, 80)), rng.standard_normal(192))
    with pytest.raises(VoiceError, match="10 mel frames for 2 tokens"):
        Voice("a", "", [1, 2], np.zeros((10, 80)), rng.standard_normal(192))


def test_corrupt_missing_and_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(VoiceError, match="not a readable voice file"):
        Voice.load(tmp_path / "bad.npz")
    half = _voice().to_bytes()
    (tmp_path / "half.npz").write_bytes(half[: len(half) // 2])  # a torn write
    with pytest.raises(VoiceError, match="not a readable voice file"):
        Voice.load(tmp_path / "half.npz")
    with pytest.raises(VoiceError, match="not found"):
        Voice.load(tmp_path / "nope.npz")
    with pytest.raises(VoiceError, match="cannot be read"):
        Voice.load(tmp_path)  # a directory
    import io as _io
    import json

    buf = _io.BytesIO()
    np.savez(buf, header=np.array(json.dumps({"format": 1})), speech_tokens=np.zeros(2, np.int32),
             mel=np.zeros((4, 80), np.float32), embedding=np.zeros(192, np.float32))  # fmt: skip
    with pytest.raises(VoiceError, match=r"not a readable voice file \(KeyError\)"):
        Voice.from_bytes(buf.getvalue())
    with pytest.raises(VoiceError, match="made for cosyvoice2 at 24000 Hz, this model is cosyvoice at 22050 Hz"):
        _voice().check_model("cosyvoice", 22050)
