"""The official yaml read as data: tags become records, !ref resolves (with arithmetic), nothing executes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.reference.yamlconf import Tagged, load_yaml_data

YAML = """
__set_seed: !apply:os.system ['echo should-never-run > {marker}']
rate: 25
ratio: 2
path: ''
model: !new:pkg.mod.Model
    size: !ref <rate> * <ratio>
    inner: !new:pkg.mod.Inner
        where: !ref <path>
    fn: !name:pkg.mod.func
        top_p: 0.8
    eps: 1e-06
"""


def test_tags_refs_and_overrides(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    f = tmp_path / "x.yaml"
    f.write_text(YAML.format(marker=marker))
    data = load_yaml_data(f, overrides={"path": "/models/BlankEN"})
    model = data["model"]
    assert isinstance(model, Tagged) and model.kind == "new" and model.class_name == "Model"
    assert model["size"] == 50
    assert model["inner"]["where"] == "/models/BlankEN"
    assert model["fn"].kind == "name" and model["fn"]["top_p"] == 0.8
    assert model["eps"] == 1e-6 and isinstance(model["eps"], float)
    assert data["__set_seed"].kind == "apply"
    assert not marker.exists(), "a tag was executed"


def test_bad_refs_are_model_dir_errors(tmp_path: Path) -> None:
    f = tmp_path / "x.yaml"
    f.write_text("a: !ref <b>\nb: !ref <a>\n")
    with pytest.raises(ModelDirError, match="circular"):
        load_yaml_data(f)
    f.write_text("a: !ref <missing>\n")
    with pytest.raises(ModelDirError, match="names no top-level entry"):
        load_yaml_data(f)
    f.write_text("a: !ref <b> ** 99999\nb: 2\n")
    with pytest.raises(ModelDirError, match="unsupported expression"):
        load_yaml_data(f)
