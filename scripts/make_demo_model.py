"""Regenerate the runtime demo model shipped as package data (src/cosyvoice_cpu/demo_model/).

    python scripts/make_demo_model.py          # needs the [export] extra (PyTorch); ~10 s

The model is the "demo" random-weight fixture (CosyVoice2 structure with a 64-wide flow encoder, ~14 MB) exported
with the default recipe. It lets `cosyvoice-cpu demo` run on a runtime-only install. tests/unit/test_demo.py checks
that a fresh export of the same fixture synthesizes the same audio as the shipped copy.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "src" / "cosyvoice_cpu" / "demo_model"
SOURCE = "cosyvoice-cpu fixture --family cosyvoice2 --size demo --seed 0 (random weights)"


def build(out: Path) -> Path:
    """Write the demo fixture and export it to ``out`` (replaced)."""
    from cosyvoice_cpu.manifest import MANIFEST_NAME
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    with tempfile.TemporaryDirectory() as tmp:
        src = write_fixture(FixtureSpec("cosyvoice2", "demo", 0), Path(tmp) / "demo-fixture")
        export_model(src, out, ExportOptions(max_len=512, force=True))
    manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
    manifest["source"]["path"] = SOURCE  # not the temporary directory it was built in
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def main() -> None:
    if TARGET.exists():
        shutil.rmtree(TARGET)
    build(TARGET)
    size = sum(p.stat().st_size for p in TARGET.iterdir())
    print(f"wrote {TARGET} ({size / 1e6:.1f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
