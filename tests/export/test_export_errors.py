"""``cosyvoice-cpu export`` refuses bad input precisely and never leaves a half-written model directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cosyvoice_cpu.cli.main import main
from cosyvoice_cpu.errors import ConfigError, MissingExtraError, ModelDirError
from cosyvoice_cpu.workshop import exporter
from cosyvoice_cpu.workshop.exporter import ExportError, ExportOptions, export_model


def _linked_copy(src: Path, dst: Path) -> Path:
    """A copy of a model directory made of symlinks (fast); break a file by replacing its link."""
    for p in src.rglob("*"):
        target = dst / p.relative_to(src)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(p, target)
    return dst


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".partial" in p.name or ".old-" in p.name]


@pytest.mark.parametrize(
    ("breakage", "error", "message"),
    [
        (lambda d: (d / "flow.pt").unlink(), ExportError, r"missing flow\.pt"),
        (lambda d: (d / "CosyVoice-BlankEN" / "merges.txt").unlink(), ExportError, "merges.txt"),
        (lambda d: _replace(d / "llm.pt", b"\x80\x02not a checkpoint"), ModelDirError, "not a readable PyTorch"),
        (lambda d: _replace(d / "campplus.onnx", b"garbage"), ExportError, "campplus.onnx is not a readable ONNX"),
        (
            lambda d: _replace(d / "campplus.onnx", (d / "speech_tokenizer_v2.onnx").read_bytes()),
            ExportError,
            r"campplus\.onnx \(campplus\) has 2 inputs of ranks \[3, 1\], expected ranks \[3\]",
        ),
        (
            lambda d: _replace(
                d / "cosyvoice2.yaml",
                (d.parent / "orig.yaml").read_text().replace("llm.llm.Qwen2LM", "llm.llm.CosyVoice3LM").encode(),
            ),
            ExportError,  # the yaml now claims Fun-CosyVoice3, whose files the directory lacks
            r"missing speech_tokenizer_v3\.onnx",
        ),
    ],
    ids=[
        "missing-checkpoint",
        "missing-tokenizer-file",
        "corrupt-checkpoint",
        "corrupt-onnx",
        "wrong-onnx",
        "wrong-family",
    ],
)
def test_broken_sources_fail_precisely_and_leave_nothing(
    tiny_model_dir: Path, tmp_path: Path, breakage, error, message
) -> None:
    (tmp_path / "orig.yaml").write_text((tiny_model_dir / "cosyvoice2.yaml").read_text())
    src = _linked_copy(tiny_model_dir, tmp_path / "src")
    breakage(src)
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        export_model(src, out / "model", ExportOptions(recipe="fp32", verify=False))
    assert not (out / "model").exists()
    if out.exists():
        _no_leftovers(out)


def test_existing_target_needs_force(tiny_model_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"already exists.*--force"):
        export_model(tiny_model_dir, dst, ExportOptions(recipe="fp32", verify=False))
    assert (dst / "keep.txt").read_text() == "mine"


def test_force_only_replaces_a_model_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(ExportError, match=r"holds no cosyvoice_cpu\.json: --force only replaces a cosyvoice-cpu model"):
        export_model(tiny_model_dir, home, ExportOptions(recipe="fp32", force=True, verify=False))
    assert (home / "thesis.tex").read_text() == "years of work"


def test_missing_export_dependency_is_named_before_any_work(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(exporter.EXPORT_MODULES, "no_such_module_xyz", "no-such-dist")
    with pytest.raises(MissingExtraError, match=r"export needs no-such-dist: pip install 'cosyvoice-cpu\[export\]'"):
        export_model(tiny_model_dir, tmp_path / "m", ExportOptions(recipe="fp32", verify=False))
    assert list(tmp_path.iterdir()) == []


def test_unexpected_failures_become_one_line_errors_naming_the_step(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cosyvoice_cpu.export.flow.cosyvoice2 as flow_graph

    def boom(*args, **kwargs):
        raise RuntimeError("tracer exploded\nsecond line")

    monkeypatch.setattr(flow_graph, "export_flow", boom)
    stale = tmp_path / ".m.partial-999999999"  # left by a killed export (no such pid)
    stale.mkdir()
    with pytest.raises(ExportError, match=r"while 'flow: writing the fp32 graphs': RuntimeError: tracer exploded; "):
        export_model(tiny_model_dir, tmp_path / "m", ExportOptions(recipe="fp32", verify=False))
    assert list(tmp_path.iterdir()) == []  # the stale partial directory was swept, the new one removed


def test_replace_dir_puts_the_old_directory_back_when_the_swap_fails(tmp_path: Path) -> None:
    from cosyvoice_cpu.export.common import replace_dir

    old = tmp_path / "model"
    old.mkdir()
    (old / "cosyvoice_cpu.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        replace_dir(tmp_path / "vanished", old)
    assert (old / "cosyvoice_cpu.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_target_inside_source_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ExportError, match="must be outside"):
        export_model(tiny_model_dir, tiny_model_dir / "exported", ExportOptions(recipe="fp32", verify=False))
    assert not (tiny_model_dir / "exported").exists()


def test_too_little_disk_is_refused_before_writing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exporter, "free_bytes", lambda path: 10 << 20)
    with pytest.raises(ExportError, match=r"not enough disk space .* needs about"):
        export_model(tiny_model_dir, tmp_path / "model", ExportOptions(recipe="fp32", verify=False))
    assert list(tmp_path.iterdir()) == []


def test_disk_estimate_covers_an_export_and_widens_half_precision_checkpoints(
    tiny_model_dir: Path, tiny_export_dir: Path, tmp_path: Path
) -> None:
    import torch

    need = exporter.needed_bytes(tiny_model_dir)
    written = sum(f.stat().st_size for f in tiny_export_dir.rglob("*") if f.is_file())
    assert written <= need < 4 * written + (64 << 20)
    state = torch.load(tiny_model_dir / "hift.pt", weights_only=True)
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    torch.save(half, tmp_path / "hift.pt")
    fp32 = exporter._fp32_bytes(tiny_model_dir / "hift.pt")
    assert exporter._fp32_bytes(tmp_path / "hift.pt") == fp32  # widened back to what the fp32 graph holds
    assert (tmp_path / "hift.pt").stat().st_size < 0.8 * fp32  # (a tiny file: zip headers weigh)


def test_bad_recipe_and_max_len_are_config_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown quantization recipe 'int3'"):
        export_model(tiny_model_dir, tmp_path / "m", ExportOptions(recipe="int3"))
    with pytest.raises(ConfigError, match="lm='int2' is not one of"):
        export_model(tiny_model_dir, tmp_path / "m", ExportOptions(recipe="lm=int2"))
    with pytest.raises(ConfigError, match="unknown stage 'vocoder'"):
        export_model(tiny_model_dir, tmp_path / "m", ExportOptions(recipe="vocoder=int8"))
    with pytest.raises(ConfigError, match="max_len"):
        export_model(tiny_model_dir, tmp_path / "m", ExportOptions(max_len=8))


def test_cli_reports_errors_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--from", str(tmp_path / "nope"), "--to", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such directory" in err
    assert main(["export", "--list-recipes"]) == 0
    assert "int4" in capsys.readouterr().out
