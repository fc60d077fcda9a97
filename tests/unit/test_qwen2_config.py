"""``CosyVoice-BlankEN/config.json`` as transformers 4 and 5 write it (issue #28: rope_theta under rope_parameters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.reference.lm.qwen2 import Qwen2Config

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}  # fmt: skip


def _v4(theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    """A transformers-4 style config.json: top-level rope_theta and rope_scaling."""
    return {**Qwen2Config(**TINY, rope_theta=theta).to_json_dict(), "rope_scaling": None, **extra}


def _v5(theta: float = 10000.0, rope_type: str = "default", **extra: Any) -> dict[str, Any]:
    """A transformers-5 style config.json: rope_theta only inside rope_parameters."""
    d = {k: v for k, v in _v4(theta).items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    return {**d, "dtype": "float32", "rope_parameters": {"rope_theta": theta, "rope_type": rope_type}, **extra}


def _read(tmp_path: Path, config: dict[str, Any]) -> Qwen2Config:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return Qwen2Config.from_json(path)


def test_transformers4_rope_theta(tmp_path: Path) -> None:
    assert _read(tmp_path, _v4(10000.0)).rope_theta == 10000.0
    assert _read(tmp_path, _v4(5e5, rope_scaling={"rope_type": "default"})).rope_theta == 5e5


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    """The bug: rope_theta only under rope_parameters was ignored and the 1e6 default used."""
    cfg = _read(tmp_path, _v5(10000.0))
    assert cfg.rope_theta == 10000.0
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (64, 2)
    assert _read(tmp_path, {**_v5(10000.0), "rope_theta": 10000.0}).rope_theta == 10000.0  # both, agreeing


def test_rotary_tables_match_transformers(tmp_path: Path) -> None:
    """The tables built from a transformers-5 file equal transformers' own for the same base (theta 1e4)."""
    import torch

    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from cosyvoice_cpu.reference.lm.qwen2 import rope_cos_sin

    ours = _read(tmp_path, _v5(10000.0))
    hf = Qwen2RotaryEmbedding(config=transformers.Qwen2Config(**_v4(10000.0)))
    pos = torch.arange(0, 300, 7)
    cos, sin = rope_cos_sin(ours, pos)
    hf_cos, hf_sin = hf(torch.zeros(1, len(pos), 64), pos[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_v5(10000.0, rope_type="yarn"), "rope_parameters.rope_type is 'yarn'"),
        (_v4(10000.0, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.type is 'linear'"),
        (_v4(10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type is 'dynamic'"),
        ({k: v for k, v in _v4().items() if k != "rope_theta"}, "sets no rope_theta"),
        ({**_v5(10000.0), "rope_theta": 1e6}, "conflicting RoPE bases"),
        (_v4(10000.0, rope_scaling="linear"), "rope_scaling must be an object or null"),
        (_v4(-1.0), "rope_theta must be positive"),
        (_v4(10000.0, head_dim=32), "head_dim 32 differs"),
    ],
)
def test_refused_with_file_and_field(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelDirError) as e:
        _read(tmp_path, config)
    assert message in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_model_dir_reads_transformers5_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """End to end: read_model_config on a directory whose config.json was re-saved by transformers 5."""
    from cosyvoice_cpu.workshop.parts import read_model_config

    d = Path(shutil.copytree(tiny_model_dir, tmp_path / "t5"))
    path = d / "CosyVoice-BlankEN" / "config.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    theta = raw.pop("rope_theta")
    assert theta == 1e6  # the fixture writes the released value ...
    raw["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}  # ... this file says otherwise
    path.write_text(json.dumps(raw), encoding="utf-8")
    assert read_model_config(d).lm.qwen.rope_theta == 10000.0
    raw["rope_parameters"]["rope_type"] = "llama3"
    path.write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(ModelDirError, match=r"config\.json: rope_parameters\.rope_type is 'llama3'"):
        read_model_config(d)
