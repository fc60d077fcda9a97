"""``--unload-after`` gives ONNX Runtime's shared arena back: it lives in ORT's process-wide environment and keeps
its regions after every session closed, until a run with arena shrinkage (``registry.release_idle_memory``)."""

from __future__ import annotations

import gc
from importlib import resources

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.registry import open_graph, release_idle_memory
from cosyvoice_cpu.server.unload import rss_mb


def test_the_shared_arena_is_given_back_once_its_sessions_are_closed() -> None:
    path = resources.files("cosyvoice_cpu").joinpath("calibration/attention.onnx")  # one MultiHeadAttention
    session = open_graph(str(path), SessionConfig(threads=1))
    q = np.ones((2, 2000, 512), np.float32)
    session.run(None, {"q": q, "k": q, "v": q})  # its scores and work space come from the shared arena
    del session, q
    gc.collect()
    before = rss_mb()
    release_idle_memory()
    assert before - rss_mb() > 10, (before, rss_mb())
