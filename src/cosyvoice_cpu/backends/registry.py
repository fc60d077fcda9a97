"""The inference backends by name, and :func:`open_graph`, through which every stage opens its graphs."""

from __future__ import annotations

from pathlib import Path

from cosyvoice_cpu.backends.base import Backend, GraphSession, SessionConfig
from cosyvoice_cpu.backends.onnxruntime import OnnxRuntime
from cosyvoice_cpu.backends.openvino import OpenVino
from cosyvoice_cpu.errors import ConfigError

# one Backend per name of backends.base.BACKEND_NAMES (the names are defined there, once)
BACKENDS: dict[str, Backend] = {b.name: b for b in (OnnxRuntime(), OpenVino())}


def backend_for(name: str) -> Backend:
    """The backend called ``name``; ConfigError naming the known ones otherwise."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise ConfigError(f"unknown inference backend {name!r} (known: {', '.join(BACKENDS)})")
    return backend


def open_graph(path: str | Path, config: SessionConfig | None = None) -> GraphSession:
    """Open the graph at ``path`` with the backend ``config.backend`` names (ONNX Runtime by default; OpenVINO for the
    graphs :func:`~cosyvoice_cpu.backends.plan.plan_backends` gives it)."""
    config = config or SessionConfig()
    config.validate()
    return backend_for(config.backend).open(Path(path), config)


def release_idle_memory() -> None:
    """Have every backend give back the working memory it keeps for the process once no session is open (the
    engine's release under ``--unload-after``)."""
    for backend in BACKENDS.values():
        backend.release_idle_memory()
