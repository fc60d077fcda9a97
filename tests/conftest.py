"""Shared fixtures: tiny random-weight CosyVoice2 and CosyVoice-300M model directories in the official layout."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CosyVoice2 fixture (seed 0), written once per test session."""
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    return write_fixture(FixtureSpec("cosyvoice2", "tiny", 0), tmp_path_factory.mktemp("fixtures") / "tiny")


@pytest.fixture(scope="session")
def tiny_v1_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CosyVoice-300M (v1) fixture (seed 0), written once per test session."""
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    return write_fixture(FixtureSpec("cosyvoice", "tiny", 0), tmp_path_factory.mktemp("fixtures") / "tiny-v1")


@pytest.fixture(scope="session")
def tiny_export_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny fixture exported with the default recipe (a deployable model directory)."""
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("export") / "tiny-default"
    export_model(tiny_model_dir, out, ExportOptions(max_len=256))
    return out


@pytest.fixture(scope="session")
def tiny_v1_export_dir(tiny_v1_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CosyVoice-300M fixture exported with the default recipe (int8w)."""
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("export") / "tiny-v1-default"
    export_model(tiny_v1_model_dir, out, ExportOptions(max_len=1024))
    return out


@pytest.fixture(scope="session")
def tiny_v3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Fun-CosyVoice3 fixture (seed 0), written once per test session."""
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    return write_fixture(FixtureSpec("cosyvoice3", "tiny", 0), tmp_path_factory.mktemp("fixtures") / "tiny-v3")


@pytest.fixture(scope="session")
def tiny_v3_export_dir(tiny_v3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Fun-CosyVoice3 fixture exported with the default recipe (int8w)."""
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("export") / "tiny-v3-default"
    export_model(tiny_v3_model_dir, out, ExportOptions(max_len=1024))
    return out


@pytest.fixture(scope="session")
def tiny_ov_export_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CosyVoice2 fixture exported with ``--openvino int8`` (needs torch, openvino and nncf)."""
    for extra in ("torch", "openvino", "nncf"):
        pytest.importorskip(extra)
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("export") / "tiny-ov-int8"
    export_model(tiny_model_dir, out, ExportOptions(max_len=256, openvino="int8"))
    return out
