"""Where cosyvoice-cpu keeps the files it generates. Ground floor: imports nothing of the package."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where cosyvoice-cpu keeps generated files (fixtures, bench exports, compiled OpenVINO shapes):
    ``$COSYVOICE_CPU_CACHE`` or ``~/.cache/cosyvoice-cpu``."""
    env = os.environ.get("COSYVOICE_CPU_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "cosyvoice-cpu"
