"""Row groups (``SessionConfig.row_groups``): a call's batch rows split into calls that run at once, joined back.

A fake session checks the split itself (which rows each call gets, on which thread, the join along each output's
batch axis, the fallbacks and errors); a real ONNX graph checks ONNX Runtime's side: the split session runs on
``threads / groups`` intra-op threads and gives the one-call outputs.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.backends.base import GraphSession, NodeInfo, SessionConfig
from cosyvoice_cpu.backends.onnxruntime import OrtSession
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.backends.row_groups import RowGroupSession, batch_axis, group_bounds, join_rows, rows_apart
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.flow.graphs import extend_cache


class _Node:
    def __init__(self, name: str, shape: list[int | str | None]) -> None:
        self.name, self.type, self.shape = name, "tensor(float)", shape


class RowWise(GraphSession):
    """y = 2 x (batch on axis 0), h2 = h + 1 (batch on axis 1), n = the call's row count (no batch axis)."""

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.calls: list[tuple[int, str]] = []  # (rows, thread name) per call
        self.seen_h: list[np.ndarray] = []  # the ``h`` each call was given
        self.fail_rows: int | None = None
        self.barrier = barrier  # every call waits there for the others: calls in sequence would time out

    def get_inputs(self) -> list[NodeInfo]:
        return [_Node("x", ["batch", 3]), _Node("h", [4, "batch", "time"]), _Node("k", [])]

    def get_outputs(self) -> list[NodeInfo]:
        return [_Node("y", ["batch", 3]), _Node("h2", [4, "batch", "time"]), _Node("n", [1])]

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        rows = feeds["x"].shape[0]
        assert feeds["h"].shape[1] == rows and feeds["h"].flags.c_contiguous
        self.calls.append((rows, threading.current_thread().name))
        self.seen_h.append(feeds["h"])
        if self.barrier is not None:
            self.barrier.wait()
        if rows == self.fail_rows:
            raise RuntimeError(f"a call of {rows} rows failed")
        out = {"y": 2 * feeds["x"] + feeds["k"], "h2": feeds["h"] + 1, "n": np.array([rows], np.float32)}
        return [out[n] for n in output_names or ["y", "h2", "n"]]


def _feeds(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {
        "x": rng.standard_normal((rows, 3)).astype(np.float32),
        "h": rng.standard_normal((4, rows, 5)).astype(np.float32),
        "k": np.array(0.5, np.float32),
    }


def test_rows_split_into_contiguous_groups() -> None:
    assert group_bounds(2, 2) == [(0, 1), (1, 2)]
    assert group_bounds(5, 2) == [(0, 3), (3, 5)]
    assert group_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert batch_axis([56, "batch", "frames", 256]) == 1 and batch_axis([56, "frames"]) is None


def test_each_group_runs_as_its_own_call_at_once_and_the_outputs_join() -> None:
    split, wholes = RowWise(threading.Barrier(2, timeout=10)), []
    session = RowGroupSession(split, 2, lambda: wholes.append(RowWise()) or wholes[-1])
    for rows in (2, 4, 5):
        feeds = _feeds(rows)
        y, h2 = session.run(["y", "h2"], feeds)
        np.testing.assert_array_equal(y, 2 * feeds["x"] + 0.5)
        np.testing.assert_array_equal(h2, feeds["h"] + 1)
    caller = threading.current_thread().name
    assert {t for _, t in split.calls} == {caller, "cosyvoice-rows"}  # the second group: a thread of its own
    assert [r for r, t in split.calls if t == caller] == [1, 2, 3]  # the first group (the larger one) stays here
    assert [r for r, t in split.calls if t != caller] == [1, 2, 2]
    assert not wholes  # splittable calls never open the graph on every thread


def test_rows_laid_out_apart_reach_their_calls_without_a_copy() -> None:
    """An input with an inner batch axis laid out rows apart reaches each group's call as a view of the caller's
    array (a C-ordered one is copied row by row); an output with an inner batch axis comes back laid out so."""
    split = RowWise()
    session = RowGroupSession(split, 2, RowWise)
    assert session.rows_apart and not split.rows_apart
    feeds = _feeds(2)
    h = rows_apart(feeds["h"].shape, np.float32, 1)
    h[...] = feeds["h"]
    assert h.shape == (4, 2, 5) and not h.flags.c_contiguous and np.array_equal(h, feeds["h"])
    y, h2 = session.run(["y", "h2"], {**feeds, "h": h})
    assert [np.shares_memory(seen, h) for seen in split.seen_h] == [True, True]
    np.testing.assert_array_equal(h2, feeds["h"] + 1)
    assert all(h2[:, r].flags.c_contiguous for r in range(2)) and not h2.flags.c_contiguous
    assert y.flags.c_contiguous  # batch axis first: C order is rows apart already
    session.run(["h2"], feeds)
    assert len(split.seen_h) == 4 and not any(np.shares_memory(seen, feeds["h"]) for seen in split.seen_h[2:])


@pytest.mark.parametrize("apart", [False, True])
def test_a_cache_grows_by_its_new_frames_in_the_sessions_layout(apart: bool) -> None:
    """``flow.graphs.extend_cache``: the cache's frames then the new ones, the last ``keep`` of them, laid out as the
    session takes them (rows apart for a session that splits its calls by rows)."""
    sess = RowGroupSession(RowWise(), 2, RowWise) if apart else RowWise()
    rng = np.random.default_rng(0)
    cache, new = (rng.standard_normal((3, 2, n, 4)).astype(np.float16) for n in (5, 3))
    for keep, frames in ((None, 8), (10, 8), (6, 6), (2, 2), (1, 1), (0, 0)):
        out = extend_cache(sess, cache, new, keep)
        np.testing.assert_array_equal(out, np.concatenate([cache, new], axis=2)[:, :, 8 - frames :])
        assert out.dtype == np.float16 and (out[:, 1].flags.c_contiguous == apart or frames == 0)
    first = extend_cache(sess, cache[:, :, :0], new, 2)  # a stream's first push: an empty context
    np.testing.assert_array_equal(first, new[:, :, 1:])
    assert first[:, 1].flags.c_contiguous == apart
    assert extend_cache(sess, cache, new[:, :, :0]) is cache  # nothing new, nothing dropped: no copy
    # a chunk as long as the bound replaces the context: the new frames as they are, if in the session's layout
    laid = extend_cache(sess, np.zeros_like(cache[:, :, :0]), new)
    assert extend_cache(sess, cache, laid, 3) is laid
    other = new if apart else join_rows([new], 1)  # the other layout: copied into the session's
    out = extend_cache(sess, cache, other, 3)
    assert out is not other and np.array_equal(out, new) and out[:, 1].flags.c_contiguous == apart


def test_a_call_with_fewer_rows_than_groups_runs_whole_on_every_thread(caplog: pytest.LogCaptureFixture) -> None:
    split, wholes = RowWise(), []
    session = RowGroupSession(split, 2, lambda: wholes.append(RowWise()) or wholes[-1])
    feeds = _feeds(1)  # one row (a stream without guidance)
    np.testing.assert_array_equal(session.run(["y"], feeds)[0], 2 * feeds["x"] + 0.5)
    session.run(None, _feeds(1))
    assert split.calls == [] and len(wholes) == 1 and [r for r, _ in wholes[0].calls] == [1, 1]  # opened once
    # a call that breaks the contract (an output without a batch axis) runs as one call, said, no second copy
    session.run(["y", "n"], _feeds(2))
    assert [r for r, _ in split.calls] == [2] and len(wholes) == 1
    assert "cannot be split" in caplog.text


def test_a_failing_group_raises_after_every_group_ended() -> None:
    split = RowWise()
    session = RowGroupSession(split, 2, RowWise)
    for failing in (2, 3):  # 5 rows: the caller's group has 3, the other thread's 2
        split.fail_rows, split.calls = failing, []
        with pytest.raises(RuntimeError, match=f"{failing} rows failed"):
            session.run(["y"], _feeds(5))
        assert sorted(r for r, _ in split.calls) == [2, 3]  # both groups ran: none is left running
    with pytest.raises(ValueError, match=">= 2"):
        RowGroupSession(split, 1, RowWise)
    with pytest.raises(ConfigError, match="row_groups"):
        SessionConfig(row_groups=1).validate()


def _graph(path: Path) -> Path:
    """y = x @ W (batch on axis 0), g = h * 2 (batch on axis 1)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["h", "h"], ["g"])],
        "rows",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "time", 16]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [3, "batch", 4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "time", 8]),
            helper.make_tensor_value_info("g", TensorProto.FLOAT, [3, "batch", 4]),
        ],
        [w],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_onnx_runtime_splits_on_a_thread_share_and_gives_the_one_call_outputs(tmp_path: Path) -> None:
    path = _graph(tmp_path / "rows.onnx")
    one = open_graph(path, SessionConfig(threads=2))
    split = open_graph(path, SessionConfig(threads=2, row_groups=2))
    assert isinstance(one, OrtSession) and isinstance(split, RowGroupSession)
    assert isinstance(split.wrapped, OrtSession)
    assert split.wrapped.ort.get_session_options().intra_op_num_threads == 1
    assert one.ort.get_session_options().intra_op_num_threads == 2
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((2, 7, 16)).astype(np.float32),
        "h": rng.standard_normal((3, 2, 4)).astype(np.float32),
    }
    for a, b in zip(split.run(None, feeds), one.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    whole = split.whole  # a one-row call's session: every thread
    assert isinstance(whole, OrtSession) and whole.ort.get_session_options().intra_op_num_threads == 2
    # more threads than groups: one call on every thread (concurrent calls would share one pool)
    for threads in (3, 4):
        other = open_graph(path, SessionConfig(threads=threads, row_groups=2))
        assert isinstance(other, OrtSession) and other.ort.get_session_options().intra_op_num_threads == threads


def test_doctor_lists_the_row_thread_where_the_rows_split() -> None:
    from cosyvoice_cpu.hardware.pools import thread_pools

    rows = {t: [p for p in thread_pools(t, 4) if p.name == "flow-rows"] for t in (1, 2, 3, 4)}
    assert [len(rows[t]) for t in (1, 2, 3, 4)] == [0, 1, 0, 0]
    assert "each a call on one thread" in rows[2][0].what
    assert not [p for p in thread_pools(2, 4, split_rows=False) if p.name == "flow-rows"]
