"""The NumPy harmonic source draws one row's sine noise as it reads it: the same numbers, bounded memory."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.vocoder.source import NoiseStream, SourceConfig, SourceNoise, harmonic_source

FRAMES = 1000  # 20 s at the demo's 480 samples per frame: 41 blocks of SOURCE_BLOCK


@pytest.fixture(scope="module")
def cfg() -> SourceConfig:
    return SourceConfig.from_attrs(Manifest.load(DEMO_MODEL).graphs["hift_decode"].attrs)


def _f0(frames: int) -> np.ndarray:
    """Voiced (~120-200 Hz) and unvoiced stretches, so both the sines and the noise gating are used."""
    f0 = 160 + 40 * np.sin(np.arange(frames, dtype=np.float32) / 17)
    f0[frames // 3 : frames // 2] = 0
    return f0[None].astype(np.float32)


@pytest.mark.parametrize("sine_type", ["v1", "v2", "v3"])
def test_streamed_noise_gives_the_source_of_one_draw(cfg: SourceConfig, sine_type: str) -> None:
    cfg = dataclasses.replace(cfg, sine_type=sine_type)
    length = FRAMES * cfg.upsample
    drawn = SourceNoise.draw(np.random.default_rng(7), 1, length, cfg.harmonics, sine_type)
    streamed = SourceNoise.stream(np.random.default_rng(7), 1, length, cfg.harmonics, sine_type)
    assert isinstance(streamed.sine_noise, NoiseStream) and streamed.sine_noise.shape == drawn.sine_noise.shape
    np.testing.assert_array_equal(streamed.initial_phase, drawn.initial_phase)
    want = harmonic_source(_f0(FRAMES), cfg, drawn)
    np.testing.assert_array_equal(harmonic_source(_f0(FRAMES), cfg, streamed), want)
    assert np.abs(want).max() > 0.05


def test_streamed_noise_is_not_held_whole(cfg: SourceConfig) -> None:
    length = FRAMES * cfg.upsample
    peaks = []
    for make in (SourceNoise.draw, SourceNoise.stream):
        tracemalloc.start()
        harmonic_source(_f0(FRAMES), cfg, make(np.random.default_rng(0), 1, length, cfg.harmonics))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    noise_bytes = length * cfg.harmonics * 4  # 17 MB for 20 s
    assert peaks[1] < peaks[0] - 0.9 * noise_bytes, peaks


def test_a_noise_stream_is_read_once_in_order_and_rows_draw_at_once() -> None:
    stream = NoiseStream(np.random.default_rng(0), 100, 9, uniform=False)
    assert stream.take(0, 40).shape == (1, 40, 9)
    with pytest.raises(ConfigError, match="in order"):
        stream.take(0, 10)  # already read
    with pytest.raises(ConfigError, match="in order"):
        stream.take(40, 101)  # past the end
    two = SourceNoise.stream(np.random.default_rng(0), 2, 50, 9)  # two rows: one (2, L, H) draw, as draw() makes
    np.testing.assert_array_equal(two.sine_noise, SourceNoise.draw(np.random.default_rng(0), 2, 50, 9).sine_noise)


def test_the_vocoder_streams_its_noise_with_the_numbers_of_one_draw(monkeypatch) -> None:
    from cosyvoice_cpu.vocoder.hift import Vocoder

    attrs = Manifest.load(DEMO_MODEL).graphs["hift_decode"].attrs
    voc = Vocoder.from_dir(DEMO_MODEL, attrs, threads=1)
    mel = np.random.default_rng(1).standard_normal((1, 80, 120)).astype(np.float32)
    cfg = voc.source_cfg
    fixed = SourceNoise.draw(np.random.default_rng(3), 1, 120 * cfg.upsample, cfg.harmonics, cfg.sine_type)
    want, _ = voc(mel, noise=fixed)

    def whole_draw(*args, **kw):
        raise AssertionError("the vocoder drew a whole row of noise")

    monkeypatch.setattr(SourceNoise, "draw", whole_draw)
    got, _ = voc(mel, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(got, want)  # the generator is consumed as one draw would
