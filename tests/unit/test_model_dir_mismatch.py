"""A checkpoint that does not fit its configs: the error names keys, shapes and the declaring file (issue #28)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from cosyvoice_cpu.errors import ModelDirError

pytest.importorskip("torch")


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _blank(d: Path) -> Path:
    return d / "CosyVoice-BlankEN" / "config.json"


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (  # the LM's layer count lives in config.json, not in the yaml
            lambda d: _replace(_blank(d), '"num_hidden_layers": 2', '"num_hidden_layers": 3'),
            ["built from cosyvoice2.yaml and CosyVoice-BlankEN/config.json",
             "llm.model.model.layers: 2 in llm.pt, 3 per CosyVoice-BlankEN/config.json (num_hidden_layers)",
             "12 keys are missing from llm.pt (llm.model.model.layers.2.self_attn.q_proj.weight"],
        ),
        (
            lambda d: _replace(_blank(d), '"num_hidden_layers": 2', '"num_hidden_layers": 1'),
            ["llm.model.model.layers: 2 in llm.pt, 1 per CosyVoice-BlankEN/config.json",
             "12 keys in llm.pt are not in the model (llm.model.model.layers.1."],
        ),
        (
            lambda d: _replace(_blank(d), '"intermediate_size": 128', '"intermediate_size": 96'),
            ["6 tensors differ in shape",
             "llm.model.model.layers.0.mlp.gate_proj.weight: [128, 64] in llm.pt, [96, 64] per "
             "CosyVoice-BlankEN/config.json"],
        ),
        (  # a flow size declared by the yaml
            lambda d: _replace(d / "cosyvoice2.yaml", "linear_units: 64", "linear_units: 48"),
            ["flow.pt does not match the architecture built from cosyvoice2.yaml:",
             "encoder.encoders.0.feed_forward.w_1.weight: [64, 512] in flow.pt, [48, 512] per cosyvoice2.yaml"],
        ),
        (
            lambda d: shutil.copy(d / "flow.pt", d / "llm.pt"),
            ["does not match the architecture", "keys are missing from llm.pt (llm_embedding.weight",
             "keys in llm.pt are not in the model ("],
        ),
    ],
)  # fmt: skip
def test_mismatch_names_keys_shapes_and_files(
    tiny_model_dir: Path, tmp_path: Path, breakage: Callable[[Path], None], expected: list[str]
) -> None:
    from cosyvoice_cpu.workshop.parts import load_reference

    d = Path(shutil.copytree(tiny_model_dir, tmp_path / "mismatch"))
    breakage(d)
    with pytest.raises(ModelDirError) as e:
        load_reference(d)
    msg = str(e.value)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"
    assert "..." not in msg and "\n" not in msg
