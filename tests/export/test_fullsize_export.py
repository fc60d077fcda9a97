"""The full-size CosyVoice2 fixture exports with the default recipe, every gate passing, and the runtime runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
