"""The session factory: one CPU arena shared by all sessions, so stages that run one after the other reuse memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")

N = 25_000_000  # 100 MB of float32 per intermediate

PROBE = """
import json, sys
import numpy as np
from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.onnxruntime import make_session

def hwm_mb():
    return int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmHWM"].split()[0]) // 1024

shared = sys.argv[3] == "1"
a = make_session(sys.argv[1], SessionConfig(threads=1, shared_arena=shared))
b = make_session(sys.argv[2], SessionConfig(threads=1, shared_arena=shared))
x = np.ones({n}, np.float32)
before = hwm_mb()
for s in (a, b):  # one stage after the other, as LM -> flow -> vocoder
    assert float(s.run(None, {{"x": x}})[0]) == 4.0 * {n}
print(json.dumps({{"grew_mb": hwm_mb() - before}}))
"""


def _graph(path: Path, name: str) -> Path:
    """x (N,) -> sum((x * x + x) * 2): intermediates of N floats that live in the session's arena."""
    from onnx import TensorProto, helper

    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Add", ["sq", "x"], ["s"]),
             helper.make_node("Mul", ["s", "two"], ["d"]),
             helper.make_node("ReduceSum", ["d"], ["y"], keepdims=0)]  # fmt: skip
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [two])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path / f"{name}.onnx"))
    return path / f"{name}.onnx"


def _grew(a: Path, b: Path, shared: bool) -> float:
    r = subprocess.run([sys.executable, "-c", PROBE.format(n=N), str(a), str(b), "1" if shared else "0"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])["grew_mb"]


def test_sessions_run_one_after_the_other_share_their_activation_memory(tmp_path: Path) -> None:
    a, b = _graph(tmp_path, "a"), _graph(tmp_path, "b")
    separate, shared = _grew(a, b, shared=False), _grew(a, b, shared=True)
    # each arena keeps its peak (~200 MB here) for good: separate arenas add up (measured 398 MB), a shared one
    # serves b from what a freed (199 MB)
    assert separate >= 300, separate
    assert separate - shared >= 150, (separate, shared)


SHRINK_PROBE = """
import json, sys
import numpy as np
from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.engine import Engine

def rss_mb():
    return int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmRSS"].split()[0]) // 1024

engine = Engine.load(DEMO_MODEL, EngineConfig(threads=1, arena_shrink_frames=int(sys.argv[1])))
tokens = np.random.default_rng(0).integers(0, 100, 2000)
engine.flow.encode(tokens[:50], [], np.zeros(192, np.float32))  # the arena's usual size
before = rss_mb()
mu, _ = engine.flow.encode(tokens, [], np.zeros(192, np.float32))  # 4000 frames: attention ~T**2
print(json.dumps({"frames": mu.shape[2], "kept_mb": rss_mb() - before}))
"""


def _kept_after_long_encode(shrink_frames: int) -> dict:
    r = subprocess.run([sys.executable, "-c", SHRINK_PROBE, str(shrink_frames)], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_long_flow_encoder_call_gives_its_memory_back() -> None:
    """The demo model's encoder on 2000 tokens (4000 mel frames): the arena grows by ~170 MB for its attention
    and keeps it unless the engine shrinks it after calls longer than ``arena_shrink_frames`` (default 1000)."""
    from cosyvoice_cpu.config import EngineConfig

    assert EngineConfig().arena_shrink_frames == 1000
    kept, shrunk = _kept_after_long_encode(0), _kept_after_long_encode(1000)
    assert kept["frames"] == shrunk["frames"] == 4000
    assert kept["kept_mb"] >= 100, kept  # measured 170 MB (162 MB at 2000 frames before the query blocks)
    assert shrunk["kept_mb"] <= 40, shrunk  # measured 5 MB


def _shrink_spy(session):  # type: ignore[no-untyped-def]
    """A stand-in for a session that records, per run, whether it was asked to release memory (the shrink)."""
    shrunk: list[bool] = []

    class Spy:
        def run(self, names, feeds, release_memory=False):  # type: ignore[no-untyped-def]
            shrunk.append(release_memory)
            return session.run(names, feeds, release_memory)

    return Spy(), shrunk


def test_only_new_speech_counts_toward_the_shrink() -> None:
    """A long voice prompt makes every call of its voice big (streamed chunks too) and those calls reuse the
    arena, so its frames do not count: 600 prompt tokens + 20 new do not shrink, 600 new tokens do."""
    import numpy as np

    from cosyvoice_cpu.cli.speech import DEMO_MODEL
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.engine import Engine

    engine = Engine.load(DEMO_MODEL, EngineConfig(threads=1))
    engine.flow.encoder, shrunk = _shrink_spy(engine.flow.encoder)
    tokens, emb = np.random.default_rng(0).integers(0, 100, 600), np.zeros(192, np.float32)
    engine.flow.encode(tokens[:20], tokens, emb)
    engine.flow.encode(tokens, tokens[:20], emb)
    assert shrunk == [False, True]


def test_a_vocoder_call_split_in_windows_shrinks_the_arena_after_its_last_window() -> None:
    """A call long enough to run in windows is a long sentence: its last window gives the shared arena's free
    memory back (the LM's, the estimator's and HiFT's growth); a one-window call does not shrink."""
    import numpy as np

    from cosyvoice_cpu.cli.speech import DEMO_MODEL
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.engine import Engine

    engine = Engine.load(DEMO_MODEL, EngineConfig(threads=1, vocoder_window_frames=20))
    engine.vocoder.decode_sess, shrunk = _shrink_spy(engine.vocoder.decode_sess)
    mel = np.random.default_rng(0).standard_normal((1, 80, 50)).astype(np.float32)
    engine.vocoder(mel, rng=np.random.default_rng(0))
    assert len(shrunk) >= 3 and shrunk[-1] and not any(shrunk[:-1])
    shrunk.clear()
    engine.vocoder(mel[:, :, :20], rng=np.random.default_rng(0))
    assert shrunk == [False]
