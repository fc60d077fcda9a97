"""The full-size CosyVoice2 fixture loads strictly into our reference and into the official classes, with the
released model's parameter counts (bench/fullsize_check.py; prints load time and peak RSS)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.parity]

ROOT = Path(__file__).resolve().parents[1]


def test_full_fixture_matches_released_parameter_counts(full_model_dir: Path) -> None:
    from tests.parity.official import official

    official("cosyvoice.llm.llm")  # skip locally / fail in CI when the official code is absent
    spec = importlib.util.spec_from_file_location("fullsize_check", ROOT / "bench" / "fullsize_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    report = mod.main(["--dir", str(full_model_dir), "--official"])
    for who in ("ours", "official"):
        for key, released in mod.RELEASED_M.items():
            assert abs(report[who][key] - released) < 0.05, (who, key, report[who][key], released)
