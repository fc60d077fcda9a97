"""The Fun-CosyVoice3 (v3) flow at run time (NumPy + ONNX Runtime, no torch): speech tokens -> 80-bin mel.

    tokens --flow_encoder.onnx (the v2 contract: token, context, embedding, chunk_size)--> mu (1, 80, 2T), spks
        (inside: Embedding(6561, 80) -> PreLookaheadLayer 80 -> 1024 -> 80 -> repeat x2; chunk_size is unused)
    cond = prompt mel then zeros; x_0 = the official fixed noise (``flow_noise.npy``, the same table as v2)
    Euler/CFG over ``flow_estimator.onnx`` (the DiT, official contract) = :meth:`FlowStage.solve
        <cosyvoice_cpu.flow.base.FlowStage.solve>`
    flow_time.onnx: t (N,) -> the DiT's time table (N, L x 6D + 2D), everything that depends on t alone

The encoder, noise and solve are the chunk-streamed families' (:class:`~cosyvoice_cpu.flow.common.ChunkedFlow`);
:class:`CosyVoice3Flow` gives the stream estimator's contract (``flow_estimator_stream.onnx`` of v3: a window of frames
on a key/value cache, :mod:`cosyvoice_cpu.export.flow.cosyvoice3_stream`), runs whole sentences on that graph too (empty
caches: the full-attention DiT, so a process that does both modes holds one copy of the DiT's weights, 202 MB at int8
full size; ``flow_estimator.onnx`` is opened only for padded rows or without the stream graph) and adds the DiT's
attention chunk (``chunk_frames``, 50). Streaming is
:class:`~cosyvoice_cpu.flow.cosyvoice3_stream.CosyVoice3FlowStream`.

The stream graph takes the DiT's time table for the step's ``t`` (``modulation``) instead of ``t``: the AdaLN
weights that map the time embedding to every block's shift/scale/gate are 42 % of the DiT's (138 M of 327 M
parameters at full size), but a schedule has a handful of ``t`` values. :meth:`CosyVoice3Flow.time_table` opens
``flow_time.onnx``, computes a schedule's table (0.55 MB per step at full size), keeps it and closes the graph,
so a synthesizing process never holds those weights (format 5). The OpenVINO whole-sentence DiT
(``export --openvino``) takes the same table (:data:`TABLE_ESTIMATOR_IO`); one exported before it took ``t``, and
still runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES, GraphSession, SessionConfig
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.flow.base import Attrs, Feeds, FlowSettings, Schedule
from cosyvoice_cpu.flow.common import FILES as CHUNKED_FILES
from cosyvoice_cpu.flow.common import ChunkedFlow
from cosyvoice_cpu.flow.graphs import ESTIMATOR_IO, IO, ShapedGraph, cache_dtype, open_checked

logger = logging.getLogger(__name__)

# manifest keys -> file names: the chunk-streamed families' names (the stream estimator has the contract below)
# and the time graph
FILES = {**CHUNKED_FILES, "flow_time": "flow_time.onnx"}
TIME_IO = ({"t": ("float", 1)}, ("modulation",))
TIME_TABLES = 8  # schedules whose time table a stage keeps (10 steps: 5.5 MB at full size)
# the whole-sentence DiT on its time table (the OpenVINO model: export.flow.cosyvoice3.TableEstimatorGraphV3)
TABLE_ESTIMATOR_IO: IO = (
    {**{k: v for k, v in ESTIMATOR_IO[0].items() if k != "t"}, "modulation": ("float", 2)},
    ESTIMATOR_IO[1],
)
STREAM_IO: IO = (
    {
        "x": ("float", 3),
        "mu": ("float", 3),
        "modulation": ("float", 2),
        "spks": ("float", 2),
        "cond": ("float", 3),
        "prompt_k": ("float|float16", 4),
        "prompt_v": ("float|float16", 4),
        "context_k": ("float|float16", 4),
        "context_v": ("float|float16", 4),
        "conv_state": ("float", 3),
        "offset": ("int64", 0),
        "keep_frames": ("int64", 0),
        "chunk_frames": ("int64", 0),
    },
    ("velocity", ("new_k", "float|float16"), ("new_v", "float|float16"), "conv_in"),
)


def stream_layout(sess: GraphSession) -> tuple[int, int, int, int]:
    """(L, I, 2D, K-1) of a v3 stream estimator from its input shapes (prompt_k (L, B, P, I), conv_state
    (B, 2D, K-1))."""
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    return (
        int(shapes["prompt_k"][0]),
        int(shapes["prompt_k"][3]),
        int(shapes["conv_state"][1]),
        int(shapes["conv_state"][2]),
    )


@dataclass
class CosyVoice3FlowSettings(FlowSettings):
    """:class:`FlowSettings` plus the DiT's streaming attention chunk (frames).

    ``static_chunk_size`` (tokens) is kept for the encoder contract but has no effect in v3 (no conformer).
    """

    chunk_frames: int = 50  # DiT static_chunk_size: key j visible from query i iff j < (i // 50 + 1) * 50

    @classmethod
    def from_attrs(cls, attrs: Attrs | FlowSettings | None) -> CosyVoice3FlowSettings:
        """As :meth:`FlowSettings.from_attrs <cosyvoice_cpu.flow.base.FlowSettings.from_attrs>`, with
        ``chunk_frames`` checked."""
        settings = super().from_attrs(attrs)
        assert isinstance(settings, CosyVoice3FlowSettings)
        if settings.chunk_frames <= 0 or settings.chunk_frames % settings.token_mel_ratio:
            raise ConfigError(
                f"flow chunk_frames must be a positive multiple of token_mel_ratio "
                f"{settings.token_mel_ratio}, got {settings.chunk_frames}; export the model "
                "again"
            )
        return settings


class CosyVoice3Flow(ChunkedFlow):
    """Tokens -> mel with the exported Fun-CosyVoice3 flow graphs: the look-ahead encoder, the DiT estimator, its
    key/value-cache stream graph (which also serves whole sentences: empty caches, chunk_frames 0, format 4).

    Args: as :class:`~cosyvoice_cpu.flow.cosyvoice2.CosyVoice2Flow`; ``settings`` may carry ``chunk_frames`` (the
        stream graph's attrs); ``time_graph``: ``flow_time.onnx``, which the stream graph needs
        (:meth:`time_table`).
    """

    stream_io: ClassVar[IO | None] = STREAM_IO
    whole_alternatives: ClassVar[tuple[IO, ...]] = (TABLE_ESTIMATOR_IO,)
    settings: CosyVoice3FlowSettings

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        estimator_stream: str | Path | None = None,
        noise: str | Path | None = None,
        settings: FlowSettings | Attrs | None = None,
        threads: int | SessionConfig = 1,
        time_graph: str | Path | None = None,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> None:
        if not isinstance(settings, CosyVoice3FlowSettings):
            settings = CosyVoice3FlowSettings.from_attrs(settings)
        super().__init__(encoder, estimator, estimator_stream, noise, settings, threads, arena_shrink_frames, whole)
        self._time_graph = None if time_graph is None else Path(time_graph)
        if estimator_stream is not None and (self._time_graph is None or not self._time_graph.is_file()):
            raise ModelDirError(
                f"{time_graph or 'flow_time.onnx'} is missing (the v3 stream graph takes the DiT's "
                "time table from it); export the model directory again"
            )
        self._tables: OrderedDict[tuple[float, ...], np.ndarray] = OrderedDict()
        self._tables_lock = threading.Lock()

    @classmethod
    def extra_files(cls, model_dir: Path) -> dict[str, Path]:
        """``flow_time.onnx``, the DiT's time table (:meth:`time_table`)."""
        return {"time_graph": model_dir / FILES["flow_time"]}

    def time_table(self, schedule: Schedule) -> np.ndarray:
        """(steps, L x 6D + 2D) float32: ``flow_time.onnx`` at the schedule's t values (row k for step k).

        Computed once per schedule and kept (the last :data:`TIME_TABLES`); the graph is opened for it and closed
        again, so its weights (164 MB at full size int8) are held only while the table is computed, not while
        synthesizing (measured: docs/benchmarks-log.md, "2026-12-02: Fun-CosyVoice3, the time table split off").
        """
        key = tuple(float(t) for t, _ in schedule)
        with self._tables_lock:  # concurrent requests wait for one computation instead of each running it
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
                return table
            if self._time_graph is None:
                raise ModelDirError("this v3 flow stage has no flow_time.onnx; export the model directory again")
            t0 = time.perf_counter()
            self._shrink_arena()
            sess = open_checked(self._time_graph, self.threads, TIME_IO)
            table = sess.run(None, {"t": np.array(key, np.float32)})[0]
            del sess
            self._tables[key] = table
            while len(self._tables) > TIME_TABLES:
                self._tables.popitem(last=False)
        logger.info("DiT time table for %d steps: %.2f s (once per schedule)", len(key), time.perf_counter() - t0)
        return table

    def _shrink_arena(self) -> None:
        """Give the ORT arena's free regions back to the OS (one token through the flow encoder with ORT's shrink
        run option, ``GraphSession.run``'s ``release_memory``) before the time graph is
        opened: opening it briefly holds its weights twice (as read and as packed), and that then lands partly on
        what the arena gave back instead of on top of it (measured: docs/benchmarks-log.md, "2026-12-02:
        Fun-CosyVoice3, the time table split off"). The next calls fault their arena pages in again, once per new
        schedule."""
        self.encode(np.zeros(1, np.int64), [], np.zeros(self.emb_dim, np.float32), shrink=True)

    def time_feeds(self, sess: GraphSession, schedule: Schedule, rows: int) -> list[Feeds]:
        """Per Euler step, the time table row ``modulation`` (1, L x 6D + 2D) for a graph that takes it (the stream
        graph, the OpenVINO DiT; one row serves every row: they share t); ``flow_estimator.onnx`` keeps the official
        ``t`` input."""
        if "modulation" not in {i.name for i in sess.get_inputs()}:
            return super().time_feeds(sess, schedule, rows)
        table = self.time_table(schedule)
        return [{"modulation": table[k : k + 1]} for k in range(len(schedule))]

    def empty_stream_feeds(self, sess: GraphSession, n: int) -> Feeds:
        """Empty key/value caches, zero conv state, ``offset`` 0, ``chunk_frames`` 0 (full attention: ORT's flash
        kernel) and ``keep_frames`` 0 (no key/value is returned: ~117 MB of float16 at 650 frames)."""
        layers, width, state, hist = stream_layout(sess)
        empty = np.zeros((layers, n, 0, width), cache_dtype(sess, "prompt_k"))
        conv = np.zeros((n, state, hist), np.float32)
        return {
            "prompt_k": empty,
            "prompt_v": empty,
            "context_k": empty,
            "context_v": empty,
            "conv_state": conv,
            "offset": np.array(0, np.int64),
            "keep_frames": np.array(0, np.int64),
            "chunk_frames": np.array(0, np.int64),
        }

    @property
    def chunk_frames(self) -> int:
        """The DiT's streaming attention chunk in mel frames."""
        return int(self.settings.chunk_frames)
