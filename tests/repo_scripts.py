"""The repository's scripts (``bench/*.py``, ``scripts/*.py``) loaded as modules: they are not a package, and their
tests call their functions as well as running them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str) -> ModuleType:
    """``ROOT/path`` (e.g. ``"bench/peer.py"``) as a module named after the file, loaded once and registered in
    ``sys.modules`` (a script's dataclasses look their module up there); later calls return the same module."""
    file = ROOT / path
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        assert Path(getattr(loaded, "__file__", "") or "") == file, f"{name!r} is already the module {loaded!r}"
        return loaded
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None, f"{file} is not a Python file"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
