"""The flow stage's contract and what every family's flow shares: speech tokens -> 80-bin mel.

Every family's flow is a :class:`FlowStage` (:mod:`~cosyvoice_cpu.flow.cosyvoice`,
:mod:`~cosyvoice_cpu.flow.cosyvoice2`, :mod:`~cosyvoice_cpu.flow.cosyvoice3`): an encoder graph turns tokens into
``mu`` (1, 80, F) and ``spks`` (1, 80), and the same Euler solve with classifier-free guidance integrates the
estimator graph from noise (t = 0) to mel (t = 1); the families differ in the encoder's contract, the noise and
the stream graph. The solve here is the reference's time bookkeeping, so results match it bit for bit in fp32.

The estimators are opened on first use (:meth:`FlowStage.estimator`, :meth:`FlowStage.stream_estimator`), on the
backend the engine's plan gives the whole-sentence graph (:class:`~cosyvoice_cpu.flow.graphs.ShapedGraph`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES, GraphSession, SessionConfig, as_config
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.flow.graphs import ESTIMATOR_IO, ESTIMATOR_PADDING, IO, ShapedGraph, estimator_shapes, open_checked
from cosyvoice_cpu.flow.guidance import guidance_rows, guide, guided_rows

logger = logging.getLogger(__name__)

N_MELS = 80
Attrs = dict[str, object]  # a graph artifact's attrs (manifest JSON values)
Feeds = dict[str, np.ndarray]
Schedule = list[tuple[np.float32, np.float32]]  # Euler steps as (t, dt)


@dataclass
class FlowSettings:
    """Stage facts from the export (the graph artifacts' attrs); the defaults are the released CosyVoice2 values.

    ``n_timesteps``, ``cfg_rate`` and ``t_scheduler`` drive every family's solve; ``token_mel_ratio``,
    ``pre_lookahead_len`` and ``static_chunk_size`` are the chunk-streamed families' encoder facts.
    """

    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    static_chunk_size: int = 25  # encoder chunk in tokens for the official streaming mode
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    t_scheduler: str = "cosine"

    @classmethod
    def from_attrs(cls, attrs: Attrs | FlowSettings | None) -> FlowSettings:
        """Pick the known keys out of a dict or another settings object (unknown keys, e.g. other artifact attrs,
        are ignored)."""
        given = vars(attrs) if isinstance(attrs, FlowSettings) else (attrs or {})
        names = {f.name for f in fields(cls)}
        settings = cls(**{k: v for k, v in given.items() if k in names})  # type: ignore[arg-type]
        if settings.t_scheduler not in ("cosine", "linear"):
            raise ConfigError(f"flow t_scheduler {settings.t_scheduler!r} is unknown (want 'cosine' or 'linear')")
        return settings


def time_span(n_timesteps: int, scheduler: str = "cosine") -> np.ndarray:
    """(n_timesteps+1,) float32 times 0..1, cosine-warped ``1 - cos(pi/2 * t)`` for ``scheduler='cosine'``."""
    span = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    if scheduler == "cosine":
        span = (1.0 - np.cos(span * np.float32(0.5 * math.pi))).astype(np.float32)
    return span


def token_ids(tokens: ArrayLike, what: str) -> np.ndarray:
    """Token ids (T,) or (1, T) -> int64 (1, T)."""
    arr = np.asarray(tokens)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[0] != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(f"{what} must be integer ids of shape (T,) or (1, T), got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)


def prompt_mel(prompt_feat: ArrayLike) -> np.ndarray:
    """A voice's prompt mel (T_pm, 80) or (1, T_pm, 80) -> (1, T_pm, 80) float32."""
    feat = np.asarray(prompt_feat, dtype=np.float32)
    feat = feat[None] if feat.ndim == 2 else feat
    if feat.ndim != 3 or feat.shape[0] != 1 or feat.shape[2] != N_MELS:
        raise ConfigError(f"prompt_feat must be (T_pm, 80) or (1, T_pm, 80), got {feat.shape}")
    return feat


class FlowStream(Protocol):
    """One utterance's flow, rendered piece by piece as its speech tokens are decoded; what every family's stream
    gives the loop that drives it (:func:`cosyvoice_cpu.sentence.stream_pieces`). Not thread-safe: one per request.

    The loop appends each decoded token to a list and asks :meth:`next_window` with the list's length; a window
    ``(start, end, final)`` is rendered with :meth:`render` (the whole list is passed: a window may need tokens
    after ``end`` as look-ahead). Once the LM is done it asks with ``done=True`` for the final window.

    Attributes:
        hold_at: tokens after which the LM may pause until the first window's audio exists (the first window
            plus whatever it waits for after it).
    """

    hold_at: int

    def next_window(self, available: int, done: bool) -> tuple[int, int, bool] | None:
        """The next window as (start, end, final) token indices given ``available`` decoded tokens (``done``: the
        LM has finished), or None to wait for more tokens."""
        ...

    def render(self, tokens: Sequence[int], start: int, end: int, final: bool) -> np.ndarray:
        """The mel (1, 80, frames) float32 of window ``tokens[start:end]`` (``final``: the utterance's last)."""
        ...


class FlowStage(ABC):
    """Tokens -> mel with a family's exported flow graphs; what every family's flow stage honours.

    Args:
        encoder: the family's encoder graph (opened now, checked against :attr:`encoder_io`).
        estimator: ``flow_estimator.onnx`` (the official estimator contract, :data:`ESTIMATOR_IO`).
        estimator_stream: the family's stream estimator (checked against :attr:`stream_io`), or None.
        settings: the stage facts (:class:`FlowSettings` or a family's subclass).
        threads: intra-op threads per session, or the sessions' :class:`SessionConfig`.
        arena_shrink_frames: an encoder call for more mel frames of new speech than this (the voice prompt not
            counted) has the backend give its free memory back after it (0: never;
            ``EngineConfig.arena_shrink_frames``).
        whole: the whole-sentence estimator on another backend (the OpenVINO model, and whether its calls are
            padded to buckets: :class:`~cosyvoice_cpu.flow.graphs.ShapedGraph`), or None: then ``estimator`` on
            ONNX Runtime (or the stream graph with empty caches, where it serves whole sentences) runs them.

    Attributes:
        split_rows: run an estimator call's CFG rows side by side, each row a call on one thread, where the stage
            has as many threads as rows (:attr:`SessionConfig.row_groups`, which only ONNX Runtime acts on;
            ``EngineConfig.split_rows``). Read when an estimator is opened (on first use).
    """

    encoder_io: ClassVar[IO]  # the family's encoder contract
    stream_io: ClassVar[IO | None] = None  # the family's stream estimator contract (None: it has none)
    # whether the stream graph also runs whole sentences (empty caches), so a process that does both modes holds
    # one copy of the estimator's weights
    stream_serves_whole: ClassVar[bool] = False
    # contracts the whole-sentence graph may have besides the official one (Fun-CosyVoice3's OpenVINO DiT takes its
    # time table in t's place); what it takes is asked of the graph (time_feeds)
    whole_alternatives: ClassVar[tuple[IO, ...]] = ()
    settings: FlowSettings

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        estimator_stream: str | Path | None,
        settings: FlowSettings,
        threads: int | SessionConfig = 1,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> None:
        self.settings = settings
        self.arena_shrink_frames = arena_shrink_frames
        self.whole = whole
        self.threads = threads
        self.encoder = open_checked(Path(encoder), threads, self.encoder_io)
        emb_shape = next(i.shape for i in self.encoder.get_inputs() if i.name == "embedding")
        self.emb_dim = int(emb_shape[1]) if isinstance(emb_shape[1], int) else 192
        self._estimators: dict[str, tuple[Path, IO]] = {
            "whole": (Path(estimator) if whole is None else whole.path, ESTIMATOR_IO)
        }
        if estimator_stream is not None and self.stream_io is not None:
            self._estimators["stream"] = (Path(estimator_stream), self.stream_io)
        for path, _ in self._estimators.values():
            if not path.is_file():
                raise ModelDirError(f"{path} is missing; export the model directory again")
        self._sessions: dict[str, GraphSession] = {}
        self._lock = threading.Lock()
        self.split_rows = True
        self.noise: np.ndarray | None = None  # a fixed noise table (1, 80, frames), for families that have one

    @classmethod
    @abstractmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        settings: FlowSettings | Attrs | None = None,
        threads: int | SessionConfig = 1,
        streaming: bool = True,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> FlowStage:
        """The family's stage from the standard file names in an exported directory; ``streaming``: open the
        stream estimator too (families that stream without one ignore it)."""

    @abstractmethod
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
    ) -> np.ndarray:
        """Tokens -> mel of a whole sentence.

        Args:
            tokens: (T,) or (1, T) speech tokens to render; prompt_tokens: the voice's (T_p,) or (1, T_p).
            prompt_feat: (T_pm, 80) or (1, T_pm, 80) prompt mel.
            embedding: (192,) or (1, 192) x-vector.
            n_timesteps, cfg_rate: solver settings (None: the stage's defaults).
            noise: (1, 80, >= frames) starting noise; None: the family's own (a fixed table, or a draw from
                ``rng``).
        Returns:
            (1, 80, frames) float32 mel of ``tokens`` without the prompt frames.
        """

    # ------------------------------------------------------------------ the estimator sessions

    def _estimator(self, kind: str) -> GraphSession:
        session = self._sessions.get(kind)
        if session is not None:  # opened: no lock (opening one must not stall callers of the other)
            return session
        with self._lock:
            if kind not in self._sessions:
                path, io = self._estimators[kind]
                rows = guidance_rows(self.settings.cfg_rate) if self.split_rows else 0
                config = replace(as_config(self.threads), row_groups=rows if rows > 1 else 0)
                if kind == "stream":  # its cache gathers run early: see SessionConfig.priority_order
                    config = replace(config, priority_order=True)
                if kind == "whole" and self.whole is not None:  # padding: where its backend compiles per shape
                    padding = ESTIMATOR_PADDING if self.whole.pad else None
                    config = replace(config, backend=self.whole.backend, padding=padding)
                session = open_checked(path, config, io, *(self.whole_alternatives if kind == "whole" else ()))
                self._sessions[kind] = session
                logger.info("opened %s (%s)", path.name, config.backend)
            return self._sessions[kind]

    def warm(self, frames: int = 650) -> None:
        """Open the whole-sentence estimator and compile it now (for a ``frames``-frame call with guidance), where
        its backend compiles (OpenVINO): the engine runs this in the background at load, so the first sentence
        does not wait for the compile (docs/backends.md). A graph that takes its time table gets the default
        schedule's computed now too (:meth:`time_feeds`). A no-op on ONNX Runtime."""
        if self.whole is None:
            return
        t0 = time.perf_counter()
        session = self._estimator("whole")
        time_feed = self.time_feeds(session, self.schedule(self.settings.n_timesteps), 2)[0]
        session.prepare(estimator_shapes(frames, time={k: v.shape for k, v in time_feed.items()}))
        logger.info("whole-sentence estimator ready on %s in %.1f s", self.whole.backend, time.perf_counter() - t0)

    @property
    def estimator(self) -> GraphSession:
        """The full-attention estimator session (``flow_estimator.onnx``), opened on first use."""
        return self._estimator("whole")

    @property
    def can_stream(self) -> bool:
        """Whether the chunk estimator is available (:attr:`stream_estimator` is not None)."""
        return "stream" in self._estimators

    @property
    def stream_estimator(self) -> GraphSession | None:
        """The chunk-causal estimator session on cached activations (streaming), opened on first use; None if
        the stage was made without it."""
        return self._estimator("stream") if self.can_stream else None

    def whole_on_stream_graph(self, padded: bool) -> bool:
        """Whether a whole-sentence call runs on the stream graph with empty caches: when that graph serves whole
        sentences, no row is padded (it has no mask) and no other backend was given the whole-sentence graph."""
        return not padded and self.stream_serves_whole and self.can_stream and self.whole is None

    def whole_call(self, padded: bool, n: int) -> tuple[GraphSession, Feeds]:
        """(session, extra feeds) for a whole-sentence estimator call on ``n`` rows: the whole-sentence estimator
        and no extra feeds (the caller adds the mask); a family whose stream graph serves whole sentences
        overrides this."""
        return self.estimator, {}

    def releases_memory(self, frames: int) -> bool:
        """Whether an encoder call for ``frames`` mel frames of new speech gives the backend's free working memory
        back when it ends (``GraphSession.run``'s ``release_memory``): when they exceed
        :attr:`arena_shrink_frames`. The voice prompt's frames do not count: a long prompt makes every call of
        that voice big, and those calls reuse the arena's memory; shrinking after each would fault it in again per
        streamed chunk."""
        return 0 < self.arena_shrink_frames < frames

    # ------------------------------------------------------------------ the Euler solve

    def solve(
        self,
        mu: np.ndarray,
        spks: np.ndarray,
        cond: np.ndarray,
        mask: np.ndarray | None = None,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: np.ndarray | None = None,
    ) -> np.ndarray:
        """Euler flow matching from noise (t=0) to mel (t=1) with classifier-free guidance (full attention).

        Args:
            mu: (B, 80, T), spks: (B, 80), cond: (B, 80, T), mask: (B, 1, T) float (default all ones).
            n_timesteps: Euler steps (default settings, 10); cfg_rate: r in ``(1+r) v_cond - r v_uncond``
                (default settings, 0.7; 0 skips the unconditioned rows).
            noise: (1|B, 80, >= T) float32 starting noise (first T frames); default the fixed noise table.
        Returns:
            (B, 80, T) float32 mel.
        """
        n_timesteps, cfg_rate = self.solver_params(n_timesteps, cfg_rate)
        mu = np.asarray(mu, dtype=np.float32)
        if mu.ndim != 3 or mu.shape[1] != N_MELS:
            raise ConfigError(f"mu must be (B, 80, T), got {mu.shape}")
        b, size = mu.shape[0], mu.shape[2]
        spks = np.asarray(spks, dtype=np.float32).reshape(b, N_MELS)
        cond = np.asarray(cond, dtype=np.float32)
        mask = np.ones((b, 1, size), np.float32) if mask is None else np.asarray(mask, dtype=np.float32)
        if cond.shape != mu.shape or mask.shape != (b, 1, size):
            raise ConfigError(f"cond must be {mu.shape} and mask {(b, 1, size)}, got {cond.shape} and {mask.shape}")
        rows = guidance_rows(cfg_rate)
        estimator, feeds = self.whole_call(bool((mask != 1).any()), rows * b)
        feeds.update(guided_rows(mu, spks, cond, rows))
        if "keep_frames" not in feeds:
            feeds["mask"] = np.concatenate([mask] * rows)
        x = self.initial_noise(noise, b, size)
        schedule = self.schedule(n_timesteps)
        # a backend that keeps each graph's largest working memory (OpenVINO) gives it back after the sentence's
        # last step: otherwise the longest sentence met sets the process's size for its life (docs/backends.md)
        release = estimator.keeps_working_memory
        for k, ((_, dt), time_feed) in enumerate(zip(schedule, self.time_feeds(estimator, schedule, rows * b))):
            feeds["x"] = np.concatenate([x] * rows) if rows > 1 else x
            feeds.update(time_feed)
            v = estimator.run(None, feeds, release and k == len(schedule) - 1)[0]
            x = x + dt * guide(v, cfg_rate, b)
        return x

    def solver_params(self, n_timesteps: int | None, cfg_rate: float | None) -> tuple[int, float]:
        """(steps, cfg rate) with the stage defaults filled in and checked."""
        n_timesteps = self.settings.n_timesteps if n_timesteps is None else int(n_timesteps)
        cfg_rate = self.settings.cfg_rate if cfg_rate is None else float(cfg_rate)
        if n_timesteps < 1 or cfg_rate < 0:
            raise ConfigError(f"need n_timesteps >= 1 and cfg_rate >= 0, got {n_timesteps} and {cfg_rate}")
        return n_timesteps, cfg_rate

    def schedule(self, n_timesteps: int) -> Schedule:
        """The Euler steps as (t, dt) float32 pairs, with the official bookkeeping (t accumulates dt, the next
        dt is ``span[k+1] - t``), so results match the reference bit for bit in fp32."""
        span = time_span(n_timesteps, self.settings.t_scheduler)
        t, dt = span[0], np.float32(span[1] - span[0])
        steps = []
        for step in range(1, n_timesteps + 1):
            steps.append((t, dt))
            t = np.float32(t + dt)
            if step < n_timesteps:
                dt = np.float32(span[step + 1] - t)
        return steps

    def time_feeds(self, sess: GraphSession, schedule: Schedule, rows: int) -> list[Feeds]:
        """Per Euler step of ``schedule``, the estimator ``sess``'s time input for ``rows`` rows: ``t`` (rows,)
        (Fun-CosyVoice3's stream graph takes its time table instead: :mod:`cosyvoice_cpu.flow.cosyvoice3`)."""
        return [{"t": np.full(rows, t, dtype=np.float32)} for t, _ in schedule]

    def initial_noise(self, noise: ArrayLike | None, b: int, size: int, offset: int = 0) -> np.ndarray:
        """x_0 (b, 80, size) float32: frames ``offset:offset+size`` of the caller noise or the fixed table."""
        if noise is None:
            if self.noise is None:
                raise ModelDirError("this flow stage has no noise table (flow_noise.npy); pass noise=")
            noise = self.noise
        noise = np.asarray(noise) if not isinstance(noise, np.ndarray) else noise
        end = offset + size
        if noise.ndim != 3 or noise.shape[0] not in (1, b) or noise.shape[1] != N_MELS or noise.shape[2] < end:
            raise ConfigError(
                f"noise must be (1 or {b}, 80, >= {end}) frames, got {noise.shape}; for longer "
                "outputs split the text into shorter sentences"
            )
        return np.ascontiguousarray(np.broadcast_to(noise[:, :, offset:end], (b, N_MELS, size)), dtype=np.float32)

    def embedding_row(self, embedding: ArrayLike) -> np.ndarray:
        """The x-vector as the encoder's (1, E) float32 input (E = 192 for the released models)."""
        emb = np.asarray(embedding, dtype=np.float32)
        if emb.size != self.emb_dim:
            raise ConfigError(f"embedding must hold {self.emb_dim} values ((1, {self.emb_dim})), got {emb.shape}")
        return emb.reshape(1, self.emb_dim)
