"""``--unload-after`` gives ONNX Runtime's shared arena back: it lives in ORT's process-wide environment and keeps
its regions after every session closed, until a run with arena shrinkage (``registry.release_idle_memory``).

Measured in a fresh interpreter: in the test process the arena's regions hold whatever earlier tests left in
them (a CI run once saw the release free nothing there after the suite's order changed; docs/benchmarks-log.md,
"2026-12-04 (night)"), so the RSS difference would say more about the order of the suite than about the release.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
from importlib import resources
import numpy as np
from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.registry import open_graph, release_idle_memory
from cosyvoice_cpu.server.unload import rss_mb
path = resources.files("cosyvoice_cpu").joinpath("calibration/attention.onnx")  # one MultiHeadAttention
session = open_graph(str(path), SessionConfig(threads=1))
q = np.ones((2, 2000, 512), np.float32)
session.run(None, {"q": q, "k": q, "v": q})  # its scores and work space come from the shared arena
del session, q
gc.collect()
before = rss_mb()
release_idle_memory()
print(json.dumps({"before": before, "after": rss_mb()}))
"""


def test_the_shared_arena_is_given_back_once_its_sessions_are_closed() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    rss = json.loads(out.strip().splitlines()[-1])
    assert rss["before"] - rss["after"] > 10, rss
