"""`cosyvoice-cpu demo` runs on a runtime-only install: the packaged demo model, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import soundfile as sf

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.manifest import Manifest


def test_the_demo_model_is_packaged_and_intact() -> None:
    m = Manifest.load(DEMO_MODEL, check_hashes=True)
    assert m.family == "cosyvoice2" and m.source["path"].startswith("cosyvoice-cpu fixture --family cosyvoice2")
    assert all(v["passed"] for v in m.verification)
    assert sum(f.size for f in m.all_files()) < 20e6  # small enough to ship in the wheel


def test_demo_runs_with_torch_blocked(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from cosyvoice_cpu.cli.main import main\n"
            "raise SystemExit(main(sys.argv[1:]))\n")  # fmt: skip
    out = tmp_path / "demo.wav"
    r = subprocess.run([sys.executable, "-c", code, "demo", "-o", str(out), "--flow-steps", "2", "--text", "Hello."],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for row in ("load", "voice", "lm", "flow", "hift", "first", "total", "RTF", "no torch"):
        assert row in r.stdout
    wave, sr = sf.read(out)
    assert sr == 24000 and len(wave) > 0
