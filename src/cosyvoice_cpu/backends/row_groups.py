"""A call's batch rows run side by side: one graph call split into calls of row groups, each on its own thread.

A graph called at small shapes gives each operator too little work to share across cores. The stream estimators run
20-100 new frames per call with two CFG rows (the whole-sentence estimator a few hundred: CosyVoice-300M's streamed
windows); ONNX Runtime's pool threads sleep between operators (spinning is off:
:attr:`~cosyvoice_cpu.backends.base.SessionConfig.spinning`), and waking one for each of a call's operators can cost
what the second core gives (measured: docs/benchmarks-log.md, "2026-12-07 (stop 64)"). Split by rows instead, each
group a whole call on one thread: no thread waits on another inside a call. Rows are independent in the graphs this
serves: every batched input and output names its batch axis ``batch``, and a group's call gives that group's rows.
An input without that axis goes to every group whole: a scalar, or Fun-CosyVoice3's time table ``modulation``,
which the runtime feeds as one row that every row shares (a table of one row per batch row would not split: its
axis is ``time_rows``). Float results are the whole call's up to kernel rounding, and in int8 graphs up to the
dynamic quantization of activations: one scale per call, so each group gets a scale of its own (the CFG rows'
ranges differ: the unconditioned row has mu, spks and cond zeroed).

A call with fewer rows than groups (a stream without guidance) runs on a session with every thread, opened on first
need: a second copy of the graph's weights, only in a process that makes such calls. A call that cannot be split
otherwise (batched inputs that disagree on their rows, an output without a batch axis) runs as one call on the
one-thread session, with a warning: a graph or a caller that breaks the contract above.

Each group's call takes its rows C-contiguous. A row along an inner batch axis (the stream estimators' caches,
``(layers, batch, frames, width)``) is strided in a C-ordered array and would be copied for every call (measured:
docs/benchmarks-log.md, "2026-12-07 (stop 70)"). The session says it prefers its batched inputs :func:`rows_apart`
(``GraphSession.rows_apart``), joins such outputs that way, and the flow streams keep their caches so: a group's
row is then a view.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import numpy as np
from numpy.typing import DTypeLike

from cosyvoice_cpu.backends.base import BoundRun, GraphSession, WrappedSession

logger = logging.getLogger(__name__)

BATCH_AXIS = "batch"  # the axis name the exporters give every batched input and output


def batch_axis(shape: list[int | str | None]) -> int | None:
    """The position of the axis named :data:`BATCH_AXIS` in a graph input's or output's shape, or None."""
    return shape.index(BATCH_AXIS) if BATCH_AXIS in shape else None


def group_bounds(rows: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous (start, stop) row ranges covering ``rows``, the first ones one row longer where the
    rows do not divide evenly."""
    step, extra = divmod(rows, groups)
    bounds, start = [], 0
    for g in range(groups):
        stop = start + step + (1 if g < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def rows_apart(shape: tuple[int, ...], dtype: DTypeLike, axis: int) -> np.ndarray:
    """An uninitialized array of ``shape`` laid out with ``axis`` outermost in memory: each slice along it (a batch
    row) is contiguous, so a group of one row is a view, where a C-ordered array's row along an inner axis is
    strided and must be copied for its call (C order itself where ``axis`` is 0)."""
    order = (axis, *(i for i in range(len(shape)) if i != axis))
    return np.moveaxis(np.empty([shape[i] for i in order], dtype), 0, axis)


def join_rows(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """``parts`` joined along their batch ``axis``, laid out :func:`rows_apart` (one copy, as a concatenation)."""
    if axis == 0:
        return np.concatenate(parts, axis=0)
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    out = rows_apart(tuple(shape), np.result_type(*parts), axis)
    start = 0
    for part in parts:
        stop = start + part.shape[axis]
        out[(slice(None),) * axis + (slice(start, stop),)] = part
        start = stop
    return out


def _rows(value: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """The rows ``[start, stop)`` along ``axis``, C-contiguous: a view where they already are (:func:`rows_apart`),
    else a copy."""
    index = (slice(None),) * axis + (slice(start, stop),)
    return np.ascontiguousarray(value[index])


class RowGroupSession(WrappedSession):
    """A :class:`GraphSession` whose calls run their batch rows in ``groups`` groups at once.

    Args:
        split: the graph opened with one intra-op thread (``wrapped``); every group's call runs on it (a session
            runs concurrent calls).
        groups: row groups per call (>= 2); the first runs on the caller's thread, the others on threads started
            for the call (a thread start is far shorter than an estimator call; no pool outlives a call, so
            nothing is left to a ``fork``).
        whole: opens the graph with every thread, for calls with fewer rows than ``groups`` (on first need).
    """

    def __init__(self, split: GraphSession, groups: int, whole: Callable[[], GraphSession]) -> None:
        if groups < 2:
            raise ValueError(f"row groups must be >= 2, got {groups}")
        super().__init__(split)
        self.groups = groups
        self._open_whole = whole
        self._whole: GraphSession | None = None
        self._lock = threading.Lock()
        self._in_axes = {i.name: batch_axis(list(i.shape)) for i in split.get_inputs()}
        self._out_axes = {o.name: batch_axis(list(o.shape)) for o in split.get_outputs()}

    def bind_in_place(self, pairs: Mapping[str, tuple[str, np.ndarray]]) -> BoundRun:
        return self.whole.bind_in_place(pairs)

    @property
    def rows_apart(self) -> bool:
        return True

    @property
    def whole(self) -> GraphSession:
        """The graph on every thread (opened now if it is not yet)."""
        with self._lock:
            if self._whole is None:
                logger.info(
                    "a call with fewer batch rows than %d: opening the graph again on every thread", self.groups
                )
                self._whole = self._open_whole()
            return self._whole

    def rows(self, feeds: Mapping[str, np.ndarray]) -> int | None:
        """The call's batch rows (every batched input must agree), or None when the call cannot be split."""
        sizes = {v.shape[a] for k, v in feeds.items() if (a := self._in_axes.get(k)) is not None and a < v.ndim}
        return sizes.pop() if len(sizes) == 1 else None

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        """The outputs of one call on ``feeds``: each row group's call on its own thread, joined along the outputs'
        batch axes (:func:`join_rows`); a call with fewer rows than groups runs on :attr:`whole`, one that cannot be
        split otherwise as one call on the one-thread session (module docstring)."""
        names = output_names or [o.name for o in self.wrapped.get_outputs()]
        rows = self.rows(feeds)
        if rows is not None and rows < self.groups:
            return self.whole.run(names, feeds, release_memory)
        if rows is None or any(self._out_axes.get(n) is None for n in names):
            logger.warning("a call whose rows cannot be split (%s): one call on one thread", sorted(feeds))
            return self.wrapped.run(names, feeds, release_memory)
        bounds = group_bounds(rows, self.groups)
        results: list[list[np.ndarray] | None] = [None] * len(bounds)
        errors: list[BaseException | None] = [None] * len(bounds)

        def call(i: int) -> None:
            start, stop = bounds[i]
            try:  # each group takes its own rows of the batched inputs (a copy unless laid out rows apart)
                part = {
                    k: v if (a := self._in_axes.get(k)) is None else _rows(v, a, start, stop) for k, v in feeds.items()
                }
                results[i] = self.wrapped.run(names, part, release_memory)
            except Exception as e:  # handed to the caller, which raises it after every group ended
                errors[i] = e

        threads = [threading.Thread(target=call, args=(i,), name="cosyvoice-rows") for i in range(1, len(bounds))]
        for t in threads:
            t.start()
        try:
            call(0)  # an interrupt here (Ctrl-C) propagates as it is, once the other groups ended
        finally:
            for t in threads:
                t.join()
        for e in errors:  # the caller's group's error first, then the others' in order
            if e is not None:
                raise e
        done = [r for r in results if r is not None]
        return [join_rows([r[j] for r in done], self._out_axes[n]) for j, n in enumerate(names)]
