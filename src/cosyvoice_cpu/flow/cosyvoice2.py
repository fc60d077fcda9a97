"""The flow stage at run time (NumPy + ONNX Runtime, no torch): speech tokens -> 80-bin mel.

    tokens --flow_encoder.onnx--> mu (1, 80, 2T), spks (1, 80)
    cond = prompt mel then zeros; x_0 = the official fixed noise (``flow_noise.npy``) or caller noise
    Euler over a cosine time schedule, classifier-free guidance as one batch-2 call of ``flow_estimator.onnx``:
    rows [conditioned; mu = spks = cond = 0]. Streaming (``flow_estimator_stream.onnx``, chunk by chunk on cached
    activations) is :mod:`cosyvoice_cpu.flow.cosyvoice2_stream`.

Numerically this is :meth:`cosyvoice_cpu.reference.flow.Flow.inference` (same time bookkeeping, same noise);
graph contracts are documented in :mod:`cosyvoice_cpu.export.flow_graph`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES, SessionConfig, as_config
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.flow.buckets import BucketedSession, ShapedGraph
from cosyvoice_cpu.flow.graphs import ENCODER_IO, ESTIMATOR_IO, STREAM_IO, cache_dtype, open_checked, stream_layout
from cosyvoice_cpu.flow.guidance import guidance_rows, guide, guided_rows

logger = logging.getLogger(__name__)

N_MELS = 80
# the stage's files in an exported model directory (manifest keys -> file names)
FILES = {
    "flow_encoder": "flow_encoder.onnx",
    "flow_estimator": "flow_estimator.onnx",
    "flow_estimator_stream": "flow_estimator_stream.onnx",
    "flow_estimator_ov": "flow_estimator.ov.xml",  # OpenVINO model of flow_estimator (export --openvino)
    "flow_noise": "flow_noise.npy",
}


@dataclass
class FlowSettings:
    """Stage facts from the export (the graph artifacts' attrs); defaults are the released CosyVoice2 values."""

    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    static_chunk_size: int = 25  # encoder chunk in tokens for the official streaming mode
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    t_scheduler: str = "cosine"

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any] | None) -> FlowSettings:
        """Pick the known keys out of a dict (unknown keys, e.g. other artifact attrs, are ignored)."""
        names = {f.name for f in fields(cls)}
        settings = cls(**{k: v for k, v in (attrs or {}).items() if k in names})
        if settings.t_scheduler not in ("cosine", "linear"):
            raise ConfigError(f"flow t_scheduler {settings.t_scheduler!r} is unknown (want 'cosine' or 'linear')")
        return settings


def time_span(n_timesteps: int, scheduler: str = "cosine") -> np.ndarray:
    """(n_timesteps+1,) float32 times 0..1, cosine-warped ``1 - cos(pi/2 * t)`` for ``scheduler='cosine'``."""
    span = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    if scheduler == "cosine":
        span = (1.0 - np.cos(span * np.float32(0.5 * math.pi))).astype(np.float32)
    return span


def token_ids(tokens: Any, what: str) -> np.ndarray:
    """Token ids (T,) or (1, T) -> int64 (1, T)."""
    arr = np.asarray(tokens)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[0] != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ConfigError(f"{what} must be integer ids of shape (T,) or (1, T), got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64, copy=False)


class CosyVoice2Flow:
    """Tokens -> mel with the exported flow graphs.

    Args:
        encoder, estimator: ``flow_encoder.onnx`` and ``flow_estimator.onnx`` paths.
        estimator_stream: ``flow_estimator_stream.onnx`` (needed for streaming), or None.
        noise: ``flow_noise.npy`` (the official fixed noise), or None: then every ``solve`` needs ``noise=``.
        settings: :class:`FlowSettings` or the artifacts' attrs dict.
        threads: ORT intra-op threads per session.
        arena_shrink_frames: an encoder call for more mel frames of new speech than this (the voice prompt not
            counted) has ORT's arena give its free memory back after it (0: never;
            ``EngineConfig.arena_shrink_frames``).
        whole: the whole-sentence estimator on another backend (the OpenVINO model, and whether its calls are
            padded to buckets: :class:`~cosyvoice_cpu.flow.buckets.ShapedGraph`), or None: then ``estimator`` on
            ONNX Runtime (or the stream graph with empty caches) runs whole sentences.
    """

    # the encoder graph's contract; a subclass with another encoder (v1: :mod:`cosyvoice_cpu.flow.cosyvoice`) swaps it
    encoder_io: ClassVar[tuple[dict[str, tuple[str, int]], tuple[str, ...]]] = ENCODER_IO
    # the stream estimator's contract (v3's key/value-cache graph: :mod:`cosyvoice_cpu.flow.cosyvoice3`)
    stream_io: ClassVar[tuple[dict[str, tuple[str, int]], tuple[str, ...]]] = STREAM_IO
    # whether that graph also runs whole sentences (v2: empty caches and keep_frames = 0 are the full-attention
    # estimator), so a process that does both modes holds one copy of the estimator's weights
    stream_serves_whole: ClassVar[bool] = True

    def __init__(
        self,
        encoder: str | Path,
        estimator: str | Path,
        estimator_stream: str | Path | None = None,
        noise: str | Path | None = None,
        settings: FlowSettings | dict[str, Any] | None = None,
        threads: int | SessionConfig = 1,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> None:
        self.settings = settings if isinstance(settings, FlowSettings) else FlowSettings.from_attrs(settings)
        self.arena_shrink_frames = arena_shrink_frames
        self.whole = whole
        self.encoder = open_checked(Path(encoder), threads, self.encoder_io)
        emb_shape = next(i.shape for i in self.encoder.get_inputs() if i.name == "embedding")
        self._emb_dim = int(emb_shape[1]) if isinstance(emb_shape[1], int) else 192
        # the estimators are opened on first use. With the stream graph present (and ``stream_serves_whole``),
        # whole sentences run on it too and ``flow_estimator.onnx`` is opened only for padded rows: one copy of
        # the weights (~94 MB at int8 full size) serves both modes
        self._estimators: dict[str, tuple[Path, tuple]] = {
            "whole": (Path(estimator) if whole is None else whole.path, ESTIMATOR_IO)
        }
        if estimator_stream is not None:
            self._estimators["stream"] = (Path(estimator_stream), self.stream_io)
        for path, _ in self._estimators.values():
            if not path.is_file():
                raise ModelDirError(f"{path} is missing; export the model directory again")
        self._threads = threads
        self._sessions: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.noise: np.ndarray | None = None
        if noise is not None:
            if not Path(noise).is_file():
                raise ModelDirError(f"flow noise table {noise} is missing; export the model directory again")
            self.noise = np.load(noise, mmap_mode="r")
            if self.noise.ndim != 3 or self.noise.shape[:2] != (1, N_MELS) or self.noise.dtype != np.float32:
                raise ModelDirError(
                    f"{noise}: expected float32 noise (1, 80, frames), got {self.noise.dtype} {self.noise.shape}"
                )

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        settings: FlowSettings | dict[str, Any] | None = None,
        threads: int | SessionConfig = 1,
        streaming: bool = True,
        arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES,
        whole: ShapedGraph | None = None,
    ) -> CosyVoice2Flow:
        """The stage from the standard file names in an exported directory."""
        d = Path(model_dir)
        stream = d / FILES["flow_estimator_stream"] if streaming else None
        return cls(
            d / FILES["flow_encoder"],
            d / FILES["flow_estimator"],
            stream,
            d / FILES["flow_noise"],
            settings,
            threads,
            arena_shrink_frames,
            whole,
        )

    def _estimator(self, kind: str) -> Any:
        session = self._sessions.get(kind)
        if session is not None:  # opened: no lock (opening one must not stall callers of the other)
            return session
        with self._lock:
            if kind not in self._sessions:
                path, io = self._estimators[kind]
                config = as_config(self._threads)
                if kind == "stream":  # its new_h/new_conv_state gathers run early: see SessionConfig
                    config = replace(config, priority_order=True)
                if kind == "whole" and self.whole is not None:
                    config = replace(config, backend=self.whole.backend)
                session = open_checked(path, config, io)
                if kind == "whole" and self.whole is not None:
                    session = BucketedSession(session, self.whole.pad)
                self._sessions[kind] = session
                logger.info("opened %s (%s)", path.name, config.backend)
            return self._sessions[kind]

    def warm(self, frames: int = 650) -> None:
        """Open the whole-sentence estimator and compile it now (for a ``frames``-frame call with guidance), where
        its backend compiles (OpenVINO): the engine runs this in the background at load, so the first sentence
        does not wait for the compile (docs/backends.md). A no-op on ONNX Runtime."""
        if self.whole is None:
            return
        t0 = time.perf_counter()
        self.estimator.warm([frames])
        logger.info("whole-sentence estimator ready on %s in %.1f s", self.whole.backend, time.perf_counter() - t0)

    @property
    def estimator(self) -> Any:
        """The full-attention estimator session (``flow_estimator.onnx``), opened on first use."""
        return self._estimator("whole")

    @property
    def can_stream(self) -> bool:
        """Whether the chunk estimator is available (:attr:`stream_estimator` is not None)."""
        return "stream" in self._estimators

    @property
    def stream_estimator(self) -> Any:
        """The chunk-causal estimator session on cached activations (streaming), opened on first use; None if
        the stage was made without it."""
        return self._estimator("stream") if self.can_stream else None

    def whole_on_stream_graph(self, padded: bool) -> bool:
        """Whether a whole-sentence call runs on the stream graph with empty caches: when that graph serves whole
        sentences, no row is padded (it has no mask) and no other backend was given the whole-sentence graph."""
        return not padded and self.stream_serves_whole and self.can_stream and self.whole is None

    def _whole_call(self, padded: bool, n: int) -> tuple[Any, dict[str, np.ndarray]]:
        """(session, extra feeds) for a whole-sentence estimator call on ``n`` rows: the stream graph with empty
        caches (:meth:`whole_on_stream_graph`), else the whole-sentence estimator (extra feeds: none; the caller
        adds the mask)."""
        if not self.whole_on_stream_graph(padded):
            return self.estimator, {}
        sess = self.stream_estimator
        layers, width, state = stream_layout(sess)
        empty = np.zeros((layers, n, 0, width), cache_dtype(sess))
        return sess, {
            "prompt_h": empty,
            "context_h": empty,
            "conv_state": np.zeros((n, state, 2), np.float32),
            "keep_frames": np.array(0, np.int64),
        }

    def encode(
        self,
        tokens: Any,
        prompt_tokens: Any,
        embedding: np.ndarray,
        context: Any = None,
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
                :meth:`releases_memory`).
        Returns:
            mu (1, 80, 2 (T_p + T)) float32, spks (1, 80) float32.
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
        emb = np.asarray(embedding, dtype=np.float32)
        if emb.size != self._emb_dim:
            raise ConfigError(f"embedding must hold {self._emb_dim} values ((1, {self._emb_dim})), got {emb.shape}")
        emb = emb.reshape(1, self._emb_dim)
        chunk = np.array(self.settings.static_chunk_size if streaming else 0, dtype=np.int64)
        feeds = {"token": token, "context": ctx, "embedding": emb, "chunk_size": chunk}
        frames = (new.shape[1] + ctx.shape[1]) * self.settings.token_mel_ratio
        release = self.releases_memory(frames) if shrink is None else shrink
        mu, spks = self.encoder.run(None, feeds, release)
        return mu, spks

    def releases_memory(self, frames: int) -> bool:
        """Whether an encoder call for ``frames`` mel frames of new speech gives the backend's free working memory
        back when it ends (``GraphSession.run``'s ``release_memory``): when they exceed
        :attr:`arena_shrink_frames`. The voice prompt's frames do not count: a long prompt makes every call of
        that voice big, and those calls reuse the arena's memory; shrinking after each would fault it in again per
        streamed chunk."""
        return 0 < self.arena_shrink_frames < frames

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
            noise: (1|B, 80, >= T) float32 starting noise (first T frames); default the official fixed noise.
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
        estimator, feeds = self._whole_call(bool((mask != 1).any()), rows * b)
        feeds.update(guided_rows(mu, spks, cond, rows))
        if "keep_frames" not in feeds:
            feeds["mask"] = np.concatenate([mask] * rows)
        x = self.initial_noise(noise, b, size)
        schedule = self.schedule(n_timesteps)
        for (_, dt), time_feed in zip(schedule, self.time_feeds(estimator, schedule, rows * b)):
            feeds["x"] = np.concatenate([x] * rows) if rows > 1 else x
            feeds.update(time_feed)
            v = estimator.run(None, feeds)[0]
            x = x + dt * guide(v, cfg_rate, b)
        return x

    def solver_params(self, n_timesteps: int | None, cfg_rate: float | None) -> tuple[int, float]:
        """(steps, cfg rate) with the stage defaults filled in and checked."""
        n_timesteps = self.settings.n_timesteps if n_timesteps is None else int(n_timesteps)
        cfg_rate = self.settings.cfg_rate if cfg_rate is None else float(cfg_rate)
        if n_timesteps < 1 or cfg_rate < 0:
            raise ConfigError(f"need n_timesteps >= 1 and cfg_rate >= 0, got {n_timesteps} and {cfg_rate}")
        return n_timesteps, cfg_rate

    def schedule(self, n_timesteps: int) -> list[tuple[np.float32, np.float32]]:
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

    def time_feeds(
        self, sess: Any, schedule: list[tuple[np.float32, np.float32]], rows: int
    ) -> list[dict[str, np.ndarray]]:
        """Per Euler step of ``schedule``, the estimator ``sess``'s time input for ``rows`` rows: ``t`` (rows,)
        (Fun-CosyVoice3's stream graph takes its time table
        instead: :class:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow`)."""
        return [{"t": np.full(rows, t, dtype=np.float32)} for t, _ in schedule]

    def initial_noise(self, noise: np.ndarray | None, b: int, size: int, offset: int = 0) -> np.ndarray:
        """x_0 (b, 80, size) float32: frames ``offset:offset+size`` of the caller noise or the official table."""
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

    def inference(
        self,
        tokens: Any,
        prompt_tokens: Any,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        *,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
        context: Any = None,
        streaming: bool = False,
    ) -> np.ndarray:
        """Tokens -> mel, as :meth:`Flow.inference` (``context`` given = ``finalize=False``) with full attention
        in the estimator (``streaming`` only makes the encoder chunk-causal). Every flow stage has this signature.

        Args:
            tokens: (T,) or (1, T) speech tokens to render; prompt_tokens: the voice's (T_p,) or (1, T_p).
            prompt_feat: (1, T_pm, 80) or (T_pm, 80) prompt mel (T_pm = token_mel_ratio * T_p normally).
            embedding: (192,) or (1, 192) x-vector.
            n_timesteps, cfg_rate: solver settings (None: the stage's defaults).
            noise: (1, 80, >= frames) starting noise; None: the stage's fixed noise table (this stage ignores
                ``rng``; CosyVoice-300M's draws fresh noise from it).
            context, streaming: as :meth:`encode`.
        Returns:
            (1, 80, T_mel - T_pm) float32 mel without the prompt frames.
        """
        mu, spks = self.encode(tokens, prompt_tokens, embedding, context, streaming)
        feat = np.asarray(prompt_feat, dtype=np.float32)
        feat = feat[None] if feat.ndim == 2 else feat
        if feat.ndim != 3 or feat.shape[0] != 1 or feat.shape[2] != N_MELS:
            raise ConfigError(f"prompt_feat must be (1, T_pm, 80), got {feat.shape}")
        n_prompt = feat.shape[1]
        if n_prompt >= mu.shape[2]:
            raise ConfigError(f"prompt_feat has {n_prompt} frames but the tokens give only {mu.shape[2]}")
        cond = np.zeros_like(mu)
        cond[:, :, :n_prompt] = feat.transpose(0, 2, 1)
        mel = self.solve(mu, spks, cond, None, n_timesteps, cfg_rate, noise)
        return mel[:, :, n_prompt:]
