"""The fixture generator (deterministic, atomic, refuses to overwrite) and the CLI around it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice_cpu.cli.main import main
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.workshop import fixture_writer as fx


def test_same_seed_same_weights_other_seed_other_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = fx.write_fixture(fx.FixtureSpec("cosyvoice2", "tiny", 0), tmp_path / "again")
    other = fx.write_fixture(fx.FixtureSpec("cosyvoice2", "tiny", 1), tmp_path / "other")
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        a, b, c = (torch.load(d / name, weights_only=True) for d in (tiny_model_dir, again, other))
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (tiny_model_dir / "cosyvoice2.yaml").read_text() == (again / "cosyvoice2.yaml").read_text()


def test_hift_checkpoint_uses_the_released_weight_norm_layout(tiny_model_dir: Path) -> None:
    keys = torch.load(tiny_model_dir / "hift.pt", weights_only=True).keys()
    assert "conv_pre.parametrizations.weight.original0" in keys
    assert "ups.0.parametrizations.weight.original1" in keys
    assert "f0_predictor.condnet.0.parametrizations.weight.original0" in keys
    assert "source_downs.0.weight" in keys  # not weight-normed upstream
    assert not any(k.endswith("weight_g") for k in keys)


def test_refuses_to_overwrite_and_bad_specs(tiny_model_dir: Path) -> None:
    with pytest.raises(FileExistsError, match="--force"):
        fx.write_fixture(fx.FixtureSpec(), tiny_model_dir)
    with pytest.raises(ConfigError, match="family"):
        fx.FixtureSpec(family="cosyvoice9").validate()
    with pytest.raises(ConfigError, match="size"):
        fx.FixtureSpec(size="huge").validate()
    with pytest.raises(ConfigError, match="not made for cosyvoice3"):
        fx.FixtureSpec(family="cosyvoice3", size="demo").validate()
    with pytest.raises(ConfigError, match="cosyvoice2 has none"):
        fx.FixtureSpec(variant="base").validate()
    fx.FixtureSpec(family="cosyvoice", variant="instruct").validate()


def test_one_fixture_writer_per_family_of_the_facts_table() -> None:
    from cosyvoice_cpu.facts import FAMILIES
    from cosyvoice_cpu.workshop.parts import PARTS

    assert fx.FAMILIES == FAMILIES and all(PARTS[name].fixture.sizes for name in FAMILIES)


def test_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a, **_k):
        raise OSError("disk full")

    from cosyvoice_cpu.fixtures.weights import cosyvoice2 as weights_v2

    monkeypatch.setattr(weights_v2, "write_campplus_standin", boom)
    with pytest.raises(OSError, match="disk full"):
        fx.write_fixture(fx.FixtureSpec(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_cli_errors_are_one_line(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fixture", "--out", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cosyvoice-cpu: error:") and "--force" in err and err.count("\n") == 1
    assert main(["demo", "--reference", "-m", str(tiny_model_dir / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["demo", "-m", str(tiny_model_dir)]) == 2  # an official directory: export it first
    assert "cosyvoice-cpu export --from" in capsys.readouterr().err


def test_cli_demo_writes_a_wav_and_prints_stage_timings(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import wave

    out = tmp_path / "demo.wav"
    argv = ["demo", "--reference", "-m", str(tiny_model_dir), "-o", str(out), "--text", "Hello there."]
    assert main([*argv, "--flow-steps", "2"]) == 0
    text = capsys.readouterr().out
    for stage in ("load", "lm", "flow", "hift", "total", "RTF"):
        assert stage in text
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getnframes() > 0


def test_force_replaces_atomically_and_leaves_no_backup(tmp_path: Path) -> None:
    out = tmp_path / "fx"
    out.write_text("a file where the directory should go")
    fx.write_fixture(fx.FixtureSpec(), out, force=True)
    assert (out / "cosyvoice2.yaml").is_file()
    fx.write_fixture(fx.FixtureSpec(seed=2), out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fx"]


def test_cli_rejects_bad_numbers_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["demo", "--seed", "-1"], ["demo", "--flow-steps", "0"], ["fixture", "--out", "x", "--seed", "a"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["cosyvoice_cpu", "cosyvoice_cpu.cli"])
def test_both_module_entry_points_run_the_cli(module: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: cosyvoice-cpu" in out.stdout, (out.returncode, out.stdout, out.stderr)
