"""The runtime wall: without torch the package and its CLI import, and torch-only commands say what to install."""

from __future__ import annotations

import subprocess
import sys

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120)


def test_package_and_cli_import_without_torch() -> None:
    r = _run(
        "import cosyvoice_cpu, cosyvoice_cpu.cli, cosyvoice_cpu.errors, cosyvoice_cpu.reference.yamlconf\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    assert r.returncode == 0, r.stderr


def test_torch_commands_explain_the_missing_extra(tmp_path) -> None:
    r = _run(f"from cosyvoice_cpu.cli import main; raise SystemExit(main(['fixture', '--out', r'{tmp_path / 'x'}']))")
    assert r.returncode == 2, r.stderr
    assert "[export] extra" in r.stderr and "Traceback" not in r.stderr
