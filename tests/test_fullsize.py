"""The full-size CosyVoice2 fixture: it loads strictly into our reference and into the official classes with the
released model's parameter counts (bench/fullsize_check.py), and it exports with the default recipe, every gate
passing, and the runtime runs it.

Both tests share one module-scoped fixture that is deleted when the module ends: it is the suite's largest
directory, and a suite that kept it (and every passing test's ``tmp_path``) until the session ended once filled the
CI machine's disk (docs/benchmarks-log.md, "2026-12-04 (night)").
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.repo_scripts import load_script

pytestmark = pytest.mark.slow

PROBE = """
import sys, json
sys.modules["torch"] = None
import numpy as np
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.manifest import Manifest
d = sys.argv[1]
m = Manifest.load(d)
lm = LMSession.from_dir(d, m.graphs["lm"].attrs, threads=2)
cache = lm.new_cache(2)
prompt = [lm.special("sos")[None], lm.embed_text([1, 2, 3]), lm.special("task_id")[None]]
a = lm.prefill(cache, 0, np.concatenate(prompt))
b = lm.decode(cache, [0], [int(a.argmax())])
print(json.dumps({"shape": list(b.shape), "finite": bool(np.isfinite(b).all())}))
"""


@pytest.fixture(scope="module")
def full_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The full-size CosyVoice2 fixture (random weights, real shapes; gigabytes, about a minute to write)."""
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    root = tmp_path_factory.mktemp("fixtures")
    yield write_fixture(FixtureSpec("cosyvoice2", "full", 0), root / "full")
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parity
def test_full_fixture_matches_released_parameter_counts(full_model_dir: Path) -> None:
    from tests.parity.official import official

    official("cosyvoice.llm.llm")  # skip locally / fail in CI when the official code is absent
    mod = load_script("bench/fullsize_check.py")
    report = mod.main(["--dir", str(full_model_dir), "--official"])
    for who in ("ours", "official"):
        for key, released in mod.RELEASED_M.items():
            assert abs(report[who][key] - released) < 0.05, (who, key, report[who][key], released)


def test_full_size_default_export(full_model_dir: Path, tmp_path: Path) -> None:
    from cosyvoice_cpu.export.quantize import DEFAULT_RECIPE
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    lines: list[str] = []
    m = export_model(full_model_dir, tmp_path / "model", ExportOptions(), progress=lines.append)
    assert m.recipe["name"] == DEFAULT_RECIPE
    assert all(v["passed"] for v in m.verification) and len(m.verification) >= 20
    lm = m.graphs["lm"].attrs
    assert (lm["num_layers"], lm["hidden"], lm["kv_heads"], lm["text_vocab"]) == (24, 896, 2, 151936)
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "model")], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert '"shape": [1, 6564], "finite": true' in out
