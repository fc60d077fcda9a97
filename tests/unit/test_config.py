"""Runtime configuration: every out-of-range parameter is refused with a message naming the field and the range."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice_cpu.config import AudioChunk, EngineConfig, SynthesisConfig
from cosyvoice_cpu.errors import ConfigError


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("seed", -1, "0 to 2"),
        ("flow_steps", 0, "1 to 100"),
        ("cfg_rate", -0.1, "0 to 10"),
        ("speed", 0.0, "0.5 to 2.0"),
        ("speed", 100.0, "0.5 to 2.0"),
        ("first_chunk_tokens", 2, "5 to 500"),
        ("top_p", 0.0, r"in \(0, 1\]"),
        ("top_k", 0, "1 to 6561"),
        ("win_size", 0, "1 to 1000"),
        ("tau_r", 2.0, "0 to 1"),
    ],
)
def test_bad_synthesis_parameters_are_named(field: str, value: object, rule: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} = .* is out of range: {rule}"):
        SynthesisConfig(**{field: value}).validate()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("seed", "1", "seed must be an integer or None"), ("speed", None, "speed must be a number"),
     ("flow_steps", 2.5, "flow_steps must be an integer"), ("top_k", 2.5, "top_k must be an integer or None"),
     ("flow_steps", True, "flow_steps must be an integer")],
)  # fmt: skip
def test_wrong_types_are_config_errors(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SynthesisConfig(**{field: value}).validate()


def test_defaults_are_valid_and_copies_validate() -> None:
    cfg = SynthesisConfig().validate()
    assert (cfg.flow_steps, cfg.cfg_rate, cfg.speed, cfg.stream) == (10, 0.7, 1.0, False)
    lm, vocoder = cfg.with_(seed=3).rngs()
    assert lm.integers(1 << 30) == SynthesisConfig(seed=3).rngs()[0].integers(1 << 30)
    assert vocoder.integers(1 << 30) != SynthesisConfig(seed=3).rngs()[0].integers(1 << 30)  # independent streams
    with pytest.raises(ConfigError, match="flow_steps"):
        cfg.with_(flow_steps=1000)
    EngineConfig().validate()
    with pytest.raises(ConfigError, match="threads = -1 is out of range"):
        EngineConfig(threads=-1).validate()


def test_audio_chunk_pcm16() -> None:
    chunk = AudioChunk(np.array([0.0, 0.5, -1.0, 2.0], np.float32), 24000, final=True, text="hi", span=(0, 2))
    assert np.frombuffer(chunk.pcm16(), "<i2").tolist() == [0, 16384, -32767, 32767]
    assert chunk.duration == 4 / 24000
