"""What the chunk-streamed flows share (CosyVoice2, Fun-CosyVoice3): the look-ahead encoder, the fixed noise
table, whole sentences on the stream graph, and the checks of a streamed chunk.

    [prompt tokens, tokens] (1, T) --flow_encoder.onnx (token, context, embedding, chunk_size)-->
        mu (1, 80, token_mel_ratio T), spks (1, 80)
    cond = prompt mel then zeros; x_0 = the official fixed noise (``flow_noise.npy``) at each frame's position
    Euler/CFG over the estimator (:meth:`FlowStage.solve <cosyvoice_cpu.flow.base.FlowStage.solve>`)

A family here gives its stream graph's contract (:attr:`~cosyvoice_cpu.flow.base.FlowStage.stream_io`) and the
feeds that make that graph the full-attention estimator (:meth:`ChunkedFlow.empty_stream_feeds`).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol, Self

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES, GraphSession, SessionConfig
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.flow.base import N_MELS, Attrs, Feeds, FlowSettings, FlowStage, prompt_mel, token_ids
from cosyvoice_cpu.flow.graphs import ENCODER_IO, IO, ShapedGraph

logger = logging.getLogger(__name__)

# the files every chunk-streamed flow has in an exported model directory (manifest keys -> file names)
FILES = {
    "flow_encoder": "flow_encoder.onnx",
    "flow_estimator": "flow_estimator.onnx",
    "flow_estimator_stream": "flow_estimator_stream.onnx",
    "flow_estimator_ov": "flow_estimator.ov.xml",  # OpenVINO model of flow_estimator (export --openvino)
    "flow_noise": "flow_noise.npy",
}


def load_noise(path: str | Path) -> np.ndarray:
    """The fixed noise table ``flow_noise.npy`` (1, 80, frames) float32, memory-mapped."""
    if not Path(path).is_file():
        raise ModelDirError(f"flow noise table {path} is missing; export the model directory again")
    noise = np.load(path, mmap_mode="r")
    if noise.ndim != 3 or noise.shape[:2] != (1, N_MELS) or noise.dtype != np.float32:
        raise ModelDirError(f"{path}: expected float32 noise (1, 80, frames), got {noise.dtype} {noise.shape}")
    return noise


class ChunkFlowStream(Protocol):
    """One utterance's chunk-streamed flow (:class:`~cosyvoice_cpu.flow.cosyvoice2_stream.CosyVoice2FlowStream`,
    :class:`~cosyvoice_cpu.flow.cosyvoice3_stream.CosyVoice3FlowStream`; not thread-safe, one per request).

    ``lookahead`` is the number of tokens after a chunk the encoder needs before the chunk can be rendered
    (``pre_lookahead_len``); ``push(tokens (C,), lookahead (1..lookahead,) or None for the last chunk)`` returns
    the chunk's mel (1, 80, C * token_mel_ratio) float32. ``grid`` is None when a chunk may end anywhere at the
    same cost, else ``(phase, period)`` in tokens: chunks that end where ``phase + end`` is a multiple of
    ``period`` (a boundary of the estimator's own attention chunks) leave nothing to compute twice.
    """

    lookahead: int

    @property
    def grid(self) -> tuple[int, int] | None: ...

    def push(self, tokens: ArrayLike, lookahead: ArrayLike | None = None) -> np.ndarray: ...


@dataclass
class ChunkPlan:
    """Token chunk boundaries for one utterance.

    Args:
        first: tokens in the first chunk; largest: the cap of later chunks (each doubles the previous one);
        lookahead: tokens the flow needs after a chunk's end before it can be cut (pre_lookahead_len).
        grid: ``(phase, period)`` (:class:`ChunkFlowStream`): every chunk after the first ends on it when it can,
            cut back to the last grid line inside the planned chunk if that keeps at least half of it (a chunk
            never grows: the next line would keep the listener waiting); else as planned. None: plain doubling.
    """

    first: int
    largest: int
    lookahead: int
    offset: int = 0  # tokens already cut into chunks
    grid: tuple[int, int] | None = None
    size: int = field(init=False)  # the next chunk's tokens
    planned: int = field(init=False)  # ... before it was moved to the grid

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.largest or self.lookahead < 0:
            raise ConfigError(f"bad chunk plan: first {self.first}, largest {self.largest}, lookahead {self.lookahead}")
        if self.grid is not None and (self.grid[0] < 0 or self.grid[1] < 1):
            raise ConfigError(f"bad chunk grid {self.grid}: (phase >= 0, period >= 1) tokens")
        self.size = self.planned = self.first

    def ready(self, available: int) -> bool:
        """Whether the next chunk can be cut when ``available`` tokens exist."""
        return available - self.offset >= self.size + self.lookahead

    def cut(self) -> tuple[int, int]:
        """The next chunk's (start, end) token indices; advances the plan."""
        start, end = self.offset, self.offset + self.size
        self.offset = end
        self.planned = min(2 * self.planned, self.largest)
        self.size = self._on_grid(self.planned)
        return start, end

    def _on_grid(self, size: int) -> int:
        """``size`` tokens from ``offset``, moved to end on the grid (the rule in the class doc)."""
        if self.grid is None:
            return size
        phase, period = self.grid
        past = (phase + self.offset + size) % period  # tokens past the last grid line
        if past == 0:
            return size
        back = size - past  # the chunk up to the last grid line inside it (< 1: there is none)
        return back if 2 * back >= size else size


class ChunkedStream:
    """A :class:`~cosyvoice_cpu.flow.base.FlowStream` of chunks of ``first`` tokens doubling up to ``largest``
    (moved to the flow's :attr:`~ChunkFlowStream.grid`), each cut once the flow's look-ahead tokens exist and
    rendered by a :class:`ChunkFlowStream` (CosyVoice2, Fun-CosyVoice3)."""

    def __init__(self, flow: ChunkFlowStream, first: int, largest: int) -> None:
        self.flow = flow
        self.plan = ChunkPlan(first, largest, max(flow.lookahead, 1), grid=flow.grid)
        self.hold_at = self.plan.first + self.plan.lookahead

    def next_window(self, available: int, done: bool) -> tuple[int, int, bool] | None:
        """The next chunk (start, end, final): everything left once ``done``, else a planned chunk once its
        look-ahead exists, or None."""
        if done:
            return self.plan.offset, available, True
        return (*self.plan.cut(), False) if self.plan.ready(available) else None

    def render(self, tokens: Sequence[int], start: int, end: int, final: bool) -> np.ndarray:
        """The chunk's mel (1, 80, ratio (end - start)), with the next ``lookahead`` tokens unless ``final``."""
        return self.flow.push(tokens[start:end], None if final else tokens[end : end + self.flow.lookahead])


class ChunkedFlow(FlowStage):
    """A flow stage whose encoder takes look-ahead ``context`` ids and a ``chunk_size``, whose noise is a fixed
    table, and whose stream graph serves whole sentences with empty caches (one copy of the estimator's weights
    for both modes; ``flow_estimator.onnx`` is opened only for padded rows or without the stream graph).

    Args:
        noise: ``flow_noise.npy`` (the official fixed noise), or None: then every ``solve`` needs ``noise=``.
        others: as :class:`~cosyvoice_cpu.flow.base.FlowStage`.
    """

    encoder_io: ClassVar[IO] = ENCODER_IO
    stream_serves_whole: ClassVar[bool] = True

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        estimator_stream: str | Path | None,
        noise: str | Path | None,
        settings: FlowSettings,
        threads: int | SessionConfig = 1,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> None:
        super().__init__(encoder, estimator, estimator_stream, settings, threads, arena_shrink_frames, whole)
        if noise is not None:
            self.noise = load_noise(noise)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        settings: FlowSettings | Attrs | None = None,
        threads: int | SessionConfig = 1,
        streaming: bool = True,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> Self:
        """The stage from the standard file names (:data:`FILES`) in an exported directory, with the family's
        own graphs (:meth:`extra_files`)."""
        d = Path(model_dir)
        stream = d / FILES["flow_estimator_stream"] if streaming else None
        return cls(
            d / FILES["flow_encoder"],
            d / FILES["flow_estimator"],
            stream,
            d / FILES["flow_noise"],
            settings,
            threads,
            arena_shrink_frames=arena_shrink_frames,
            whole=whole,
            **cls.extra_files(d),
        )

    @classmethod
    def extra_files(cls, model_dir: Path) -> dict[str, Path]:
        """The family's own graph files beyond :data:`FILES`, as keyword arguments of its constructor."""
        return {}

    @abstractmethod
    def empty_stream_feeds(self, sess: GraphSession, n: int) -> Feeds:
        """The stream graph's feeds besides x, mu, spks, cond and time that make a call on ``n`` rows the
        whole-sentence estimator (empty caches, nothing kept)."""

    def whole_call(self, padded: bool, n: int) -> tuple[GraphSession, Feeds]:
        """(session, extra feeds) for a whole-sentence estimator call on ``n`` rows: the stream graph with empty
        caches (:meth:`~cosyvoice_cpu.flow.base.FlowStage.whole_on_stream_graph`), else the whole-sentence
        estimator (extra feeds: none; the caller adds the mask)."""
        if not self.whole_on_stream_graph(padded):
            return self.estimator, {}
        sess = stream_session(self)
        return sess, self.empty_stream_feeds(sess, n)

    def encode(
        self,
        tokens: ArrayLike,
        prompt_tokens: ArrayLike,
        embedding: ArrayLike,
        context: ArrayLike | None = None,
        streaming: bool = False,
        shrink: bool | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode prompt + tokens.

        Args:
            tokens: (T,) or (1, T) ids to synthesise; prompt_tokens: (T_p,) or (1, T_p) (may be empty).
            embedding: (1, 192) or (192,) raw speaker x-vector.
            context: None for a final chunk, else the 1..pre_lookahead_len look-ahead ids after ``tokens``
                (the official ``finalize=False`` call with those ids appended to ``tokens``).
            streaming: chunk-causal encoder attention (``static_chunk_size`` tokens).
            shrink: give the backend's free working memory back after the call (None: when the call is long,
                :meth:`~cosyvoice_cpu.flow.base.FlowStage.releases_memory`).
        Returns:
            mu (1, 80, ratio (T_p + T)) float32, spks (1, 80) float32.
        """
        new = token_ids(tokens, "tokens")
        token = np.concatenate([token_ids(prompt_tokens, "prompt_tokens"), new], axis=1)
        ctx = np.zeros((1, 0), np.int64) if context is None else token_ids(context, "context")
        if ctx.shape[1] > self.settings.pre_lookahead_len:
            raise ConfigError(
                f"context has {ctx.shape[1]} tokens, at most pre_lookahead_len = "
                f"{self.settings.pre_lookahead_len} are used"
            )
        if token.shape[1] == 0:
            raise ConfigError("no tokens to encode")
        emb = self.embedding_row(embedding)
        chunk = np.array(self.settings.static_chunk_size if streaming else 0, dtype=np.int64)
        feeds = {"token": token, "context": ctx, "embedding": emb, "chunk_size": chunk}
        frames = (new.shape[1] + ctx.shape[1]) * self.settings.token_mel_ratio
        release = self.releases_memory(frames) if shrink is None else shrink
        mu, spks = self.encoder.run(None, feeds, release)
        return mu, spks

    def inference(
        self,
        tokens: ArrayLike,
        prompt_tokens: ArrayLike,
        prompt_feat: ArrayLike,
        embedding: ArrayLike,
        *,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
        context: ArrayLike | None = None,
        streaming: bool = False,
    ) -> np.ndarray:
        """Tokens -> mel, as the reference ``inference`` (``context`` given = ``finalize=False``) with full
        attention in the estimator (``streaming`` only makes the encoder chunk-causal).

        Args: as :meth:`~cosyvoice_cpu.flow.base.FlowStage.inference` (``noise`` None: the fixed noise table;
            ``rng`` is not used); ``context``, ``streaming``: as :meth:`encode`.
        Returns:
            (1, 80, ratio T) float32 mel without the prompt frames.
        """
        mu, spks = self.encode(tokens, prompt_tokens, embedding, context, streaming)
        feat = prompt_mel(prompt_feat)
        n_prompt = feat.shape[1]
        if n_prompt >= mu.shape[2]:
            raise ConfigError(f"prompt_feat has {n_prompt} frames but the tokens give only {mu.shape[2]}")
        cond = np.zeros_like(mu)
        cond[:, :, :n_prompt] = feat.transpose(0, 2, 1)
        mel = self.solve(mu, spks, cond, None, n_timesteps, cfg_rate, noise)
        return mel[:, :, n_prompt:]


def stream_session(stage: FlowStage) -> GraphSession:
    """The stage's stream estimator; ConfigError when the stage was loaded without it."""
    sess = stage.stream_estimator
    if sess is None:
        raise ConfigError(
            "streaming needs flow_estimator_stream.onnx: load the flow with streaming=True "
            "(EngineConfig(streaming_estimator=True))"
        )
    return sess


def chunk_ids(
    tokens: ArrayLike, lookahead: ArrayLike | None, finished: bool, stream: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """The checked arguments of a chunked stream's ``push``: new ids (1, C) with C >= 1, and the look-ahead ids
    (1, K) or None (None or no ids: the last chunk). ``finished``: the stream already had its last chunk."""
    if finished:
        raise ConfigError(f"this stream is finished (its last chunk had no look-ahead); start a new {stream}")
    new = token_ids(tokens, "tokens")
    if new.shape[1] == 0:
        raise ConfigError("push needs at least one new token")
    ahead = None if lookahead is None else token_ids(lookahead, "lookahead")
    return new, ahead if ahead is not None and ahead.shape[1] else None


def prompt_frames(prompt_feat: ArrayLike, frames: int) -> np.ndarray:
    """(frames, 80) or (1, frames, 80) prompt mel -> (1, 80, frames) float32."""
    feat = np.asarray(prompt_feat, dtype=np.float32)
    feat = feat[0] if feat.ndim == 3 else feat
    if feat.ndim != 2 or feat.shape != (frames, N_MELS):
        raise ConfigError(f"prompt_feat must be ({frames}, 80) for the prompt tokens, got {feat.shape}")
    return np.ascontiguousarray(feat.T[None])
