"""Public configuration of the runtime: how to load the engine and how to synthesize one request.

Each dataclass validates itself with messages that name the field, the value and the allowed range, so bad
parameters fail before any work (and a server can answer 4xx with the message).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from cosyvoice_cpu.backends.base import DEFAULT_SHRINK_FRAMES
from cosyvoice_cpu.backends.plan import CHOICES as BACKEND_CHOICES
from cosyvoice_cpu.errors import ConfigError, need
from cosyvoice_cpu.vocoder.windows import DEFAULT_WINDOW_FRAMES, MIN_WINDOW_FRAMES

logger = logging.getLogger(__name__)

DEFAULT_LM_BATCH_ROWS = 4  # EngineConfig.lm_batch_rows: the LM decodes ahead in its own thread
DEFAULT_PROMPT_CACHE_MB = 1024  # EngineConfig.prompt_cache_mb (MiB): the voices' streaming caches
MAX_PROMPT_CACHE_MB = 1 << 20  # its largest value (1 TiB)
MAX_FLOW_STEPS = 100  # SynthesisConfig.flow_steps: the most Euler steps a synthesis may ask for


def _types(obj: object, ints: tuple[str, ...], floats: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Integer fields must be ints (not bools), float fields real numbers; ``optional`` ones may also be None."""
    for name in ints + floats:
        value = getattr(obj, name)
        if value is None and name in optional:
            continue
        ok = isinstance(value, int) and not isinstance(value, bool)
        if name in floats:
            ok = ok or isinstance(value, float)
        if not ok:
            kind = "an integer" if name in ints else "a number"
            raise ConfigError(f"{name} must be {kind}{' or None' if name in optional else ''}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How to load a model directory.

    Attributes:
        threads: ONNX Runtime intra-op threads per session; 0 = the usable physical cores (cgroup quota and
            affinity respected) minus ``leave_cores``.
        leave_cores: cores to leave to the OS and other processes when ``threads`` is 0.
        spinning: let idle ORT threads spin (lower latency for a single stream; keep off when requests overlap).
        verify_hashes: recompute every file's sha256 at load (seconds per GB).
        streaming_estimator: load the streaming flow estimator (needed for ``stream=True``). On CosyVoice2 it
            also runs whole sentences, so one estimator is in memory for both modes; False loads only
            ``flow_estimator.onnx`` (whole sentences only, marginally faster per flow step: its q/k/v share one
            activation quantization; measured: docs/benchmarks-log.md, "Where the time goes").
        prompt_cache_mb: MiB for per-voice streaming caches (the prompt's flow activations: full size, 3 s
            voice, 87 MB for CosyVoice2 and 185 MB for Fun-CosyVoice3 with the int8 recipes, whose stream
            graphs take float16 caches; twice that with fp32 graphs); 0 rebuilds them for every streamed request.
        prompt_cache_fp16: with an fp32 stream graph, store those caches in float16 anyway: half the memory for a
            streamed-mel rel. error of 2.6e-3 and a little more time per stream-estimator call (NumPy widens the
            cache back to float32; measured: docs/benchmarks-log.md, "Memory"). The int8 recipes' graphs take
            float16 caches themselves (no widening); there this setting changes nothing.
        lm_batch_rows: decode the LM in a background thread (:class:`~cosyvoice_cpu.lm.scheduler.LMScheduler`),
            up to this many concurrent requests in one batched call per step. A streamed request's LM then
            decodes its next chunk while the flow renders the current one (faster streaming; measured:
            docs/benchmarks-log.md, "First audio"); requests beyond N wait for a free row. 0 = the LM runs in the
            caller's thread, each request alone. Servers set it to the number of requests run at once.
        malloc_mmap_threshold_kb: on glibc, blocks of at least this many KiB get their own mapping and go back to
            the OS when freed, and glibc stops raising that threshold as big buffers are freed
            (:func:`~cosyvoice_cpu.hardware.malloc.fix_mmap_threshold`). Process-wide, set by ``Engine.load``: it lowers
            the peak of a process doing whole and streamed sentences (measured: docs/benchmarks-log.md, "Memory").
            0 leaves malloc alone; ``MALLOC_MMAP_THRESHOLD_`` in the environment wins.
        malloc_arenas: on glibc, the most heaps (arenas) malloc makes for the process's threads
            (:func:`~cosyvoice_cpu.hardware.malloc.limit_arenas`; glibc gives each new thread one, up to 8 per
            core). Process-wide, set by ``Engine.load``, best before other threads start: freed memory spread over
            many heaps stays resident, and a server's request threads, LM scheduler and OpenVINO calls spread it
            (measured: docs/server.md, "A server's memory over time"). 0 leaves malloc alone;
            ``MALLOC_ARENA_MAX`` in the environment wins.
        release_weight_pages: after opening each graph, have the kernel reclaim the pages of its weight file
            that ORT touched while packing its own copies (``SessionConfig.release_weight_pages``): full-size
            CosyVoice2 int8w, the LM's 44 MB of block scales; a lower peak for a process doing whole and streamed
            sentences (``bench/memory_steps.py``; measured: docs/benchmarks-log.md, "Memory"). False keeps them.
        vocoder_window_frames: vocoder calls on more mel frames than this run in overlapping windows of at most
            this many frames (:mod:`cosyvoice_cpu.vocoder.windows`): the same samples up to float rounding, with
            HiFT's activations bounded by the window instead of growing with the sentence, which ORT's arena
            would keep for the process's life (measured: docs/benchmarks-log.md, "Memory").
            0 never splits; directories exported before windows existed are never split.
        arena_shrink_frames: after a flow-encoder call for more mel frames of new speech than this (the voice
            prompt's not counted: a long prompt makes every call of its voice big, and those calls reuse the
            memory), ORT's arena gives its unused memory back to the OS
            (``GraphSession.run``'s ``release_memory``).
            The encoder's attention grows with the square of the length (even with its query rows in 4 blocks;
            measured: docs/benchmarks-log.md, "Memory"), and the arena would otherwise keep that for the life of
            the process; the calls after a shrink fault their working memory in again. 0 never shrinks.
        backend: ``auto``, ``onnxruntime`` or ``openvino``: which inference backend runs the graphs that have an
            OpenVINO model in the directory (``export --openvino``); ``auto`` picks per graph from the CPU and the
            directory (:func:`~cosyvoice_cpu.backends.plan.plan_backends`; ``cosyvoice-cpu doctor`` prints the
            plan). A machine without ``openvino`` or without bf16 runs everything on ONNX Runtime.
        compiled_shapes: 0 (default) compiles each OpenVINO graph once with its dynamic axes; N > 0 compiles per
            input shape (static shapes, somewhat faster per call) and keeps N in memory, least recently used out.
            Each compiled shape holds its own copy of everything, and a shape not in memory costs a compile or a
            load from OpenVINO's on-disk cache on the request path (``SessionConfig.max_shapes``; measured:
            docs/backends.md).
        split_rows: with 2 threads, run a flow estimator call's two CFG rows side by side, each as a call on one
            thread, instead of one call on both (``SessionConfig.row_groups``; other thread counts keep one call):
            the stream estimator's, and the whole-sentence estimator's where it runs on ONNX Runtime. At the
            chunks' and short sentences' shapes a call's operators are too small to share cores (measured:
            docs/benchmarks-log.md, "2026-12-07"). A call without guidance (``cfg_rate`` 0) opens the graph again
            on both threads.
        compile_ahead: compile the whole-sentence OpenVINO estimator in a background thread at load, so the first
            sentence does not wait for it (a no-op on ONNX Runtime). False compiles it on the first sentence: for
            a process that only makes voices (``voice add``). Either way :meth:`Engine.close` (and the interpreter
            at exit) waits for a compile in flight: OpenVINO's compile cannot be cancelled, and a process that
            exits under it dies in its C++ runtime.
    """

    threads: int = 0
    leave_cores: int = 0
    spinning: bool = False
    verify_hashes: bool = False
    streaming_estimator: bool = True
    prompt_cache_mb: int = DEFAULT_PROMPT_CACHE_MB
    prompt_cache_fp16: bool = False
    lm_batch_rows: int = DEFAULT_LM_BATCH_ROWS
    malloc_mmap_threshold_kb: int = 1024
    malloc_arenas: int = 2
    release_weight_pages: bool = True
    vocoder_window_frames: int = DEFAULT_WINDOW_FRAMES
    arena_shrink_frames: int = DEFAULT_SHRINK_FRAMES
    backend: str = "auto"
    compiled_shapes: int = 0
    compile_ahead: bool = True
    split_rows: bool = True

    def validate(self) -> EngineConfig:
        _types(
            self,
            (
                "threads",
                "leave_cores",
                "prompt_cache_mb",
                "lm_batch_rows",
                "malloc_mmap_threshold_kb",
                "malloc_arenas",
                "vocoder_window_frames",
                "arena_shrink_frames",
                "compiled_shapes",
            ),
            (),
        )
        need(self.backend in BACKEND_CHOICES, "backend", self.backend, "one of " + ", ".join(BACKEND_CHOICES))
        need(0 <= self.compiled_shapes <= 64, "compiled_shapes", self.compiled_shapes, "0 (one dynamic compile) to 64")
        need(self.arena_shrink_frames >= 0, "arena_shrink_frames", self.arena_shrink_frames, "0 (never) or more")
        need(
            self.vocoder_window_frames == 0 or self.vocoder_window_frames >= MIN_WINDOW_FRAMES,
            "vocoder_window_frames",
            self.vocoder_window_frames,
            f"0 (never split) or >= {MIN_WINDOW_FRAMES}",
        )
        need(
            0 <= self.malloc_mmap_threshold_kb <= 32768,
            "malloc_mmap_threshold_kb",
            self.malloc_mmap_threshold_kb,
            "0 (leave malloc alone) to 32768",
        )
        need(0 <= self.malloc_arenas <= 1024, "malloc_arenas", self.malloc_arenas, "0 (leave malloc alone) to 1024")
        need(0 <= self.lm_batch_rows <= 256, "lm_batch_rows", self.lm_batch_rows, "0 (off) to 256")
        need(
            0 <= self.prompt_cache_mb <= MAX_PROMPT_CACHE_MB,
            "prompt_cache_mb",
            self.prompt_cache_mb,
            f"0 to {MAX_PROMPT_CACHE_MB}",
        )
        need(0 <= self.threads <= 512, "threads", self.threads, "0 (auto) to 512")
        need(0 <= self.leave_cores <= 64, "leave_cores", self.leave_cores, "0 to 64")
        need(isinstance(self.compile_ahead, bool), "compile_ahead", self.compile_ahead, "True or False")
        need(isinstance(self.split_rows, bool), "split_rows", self.split_rows, "True or False")
        return self


@dataclass(frozen=True)
class SynthesisConfig:
    """Per-request settings.

    Attributes:
        seed: seed of the request's random numbers (LM sampling, vocoder source); None = fresh entropy.
        flow_steps: Euler steps of the flow (quality/speed knob; official 10).
        cfg_rate: classifier-free guidance strength of the flow (official 0.7; 0 halves the flow's work).
        speed: speaking-rate factor applied to the mel (1.0 = as generated; 0.5-2.0).
        stream: yield audio chunk by chunk as tokens are generated (needs ``EngineConfig.streaming_estimator``).
        first_chunk_tokens: speech tokens in the first streamed chunk (25 tokens = 1 s); later chunks double up
            to ``chunk_tokens`` (Fun-CosyVoice3 moves them to end on its 25-token attention chunks).
        chunk_tokens: the largest streamed chunk, in tokens (bigger chunks: less overhead, coarser latency).
        context_tokens: generated history each streamed chunk's flow attends to besides the prompt, in tokens
            (bounded memory and work per chunk; larger = closer to one-shot chunk-causal output;
            docs/streaming.md).
        normalize: run text normalization (numbers, dates, symbols) before tokenizing.
        top_p, top_k, win_size, tau_r: RAS sampling overrides (None = the model's defaults).
        min_tokens, max_tokens: speech tokens per sentence (None = the model's rule: 2x to 20x the text tokens);
            equal values force an exact length (benchmarks).
        forced_token_ratio: benchmarks of random weights (which seldom sample EOS): every sentence, and every
            passage of a text stream, gets exactly this many speech tokens per text token (its stop ids masked
            until then); None = the model decides. Excludes ``min_tokens`` / ``max_tokens``.
    """

    seed: int | None = None
    flow_steps: int = 10
    cfg_rate: float = 0.7
    speed: float = 1.0
    stream: bool = False
    first_chunk_tokens: int = 10
    chunk_tokens: int = 50
    context_tokens: int = 25
    normalize: bool = True
    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    forced_token_ratio: float | None = None

    def validate(self) -> SynthesisConfig:
        _types(
            self,
            (
                "seed",
                "flow_steps",
                "first_chunk_tokens",
                "chunk_tokens",
                "context_tokens",
                "top_k",
                "win_size",
                "min_tokens",
                "max_tokens",
            ),
            ("cfg_rate", "speed", "top_p", "tau_r", "forced_token_ratio"),
            optional=("seed", "top_p", "top_k", "win_size", "tau_r", "min_tokens", "max_tokens", "forced_token_ratio"),
        )
        need(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "0 to 2**63-1, or None")
        steps = f"1 to {MAX_FLOW_STEPS} (official 10)"
        need(1 <= self.flow_steps <= MAX_FLOW_STEPS, "flow_steps", self.flow_steps, steps)
        need(0.0 <= self.cfg_rate <= 10.0, "cfg_rate", self.cfg_rate, "0 to 10 (official 0.7)")
        need(0.5 <= self.speed <= 2.0, "speed", self.speed, "0.5 to 2.0")
        need(5 <= self.first_chunk_tokens <= 500, "first_chunk_tokens", self.first_chunk_tokens, "5 to 500")
        need(
            self.first_chunk_tokens <= self.chunk_tokens <= 1000,
            "chunk_tokens",
            self.chunk_tokens,
            f"first_chunk_tokens ({self.first_chunk_tokens}) to 1000",
        )
        need(0 <= self.context_tokens <= 1000, "context_tokens", self.context_tokens, "0 to 1000")
        need(self.top_p is None or 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        need(self.top_k is None or 1 <= self.top_k <= 6561, "top_k", self.top_k, "1 to 6561")
        need(self.win_size is None or 1 <= self.win_size <= 1000, "win_size", self.win_size, "1 to 1000")
        need(self.tau_r is None or 0.0 <= self.tau_r <= 1.0, "tau_r", self.tau_r, "0 to 1")
        need(self.min_tokens is None or 0 <= self.min_tokens <= 5000, "min_tokens", self.min_tokens, "0 to 5000")
        need(self.max_tokens is None or 1 <= self.max_tokens <= 5000, "max_tokens", self.max_tokens, "1 to 5000")
        if self.min_tokens is not None and self.max_tokens is not None:
            need(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"at most max_tokens ({self.max_tokens})",
            )
        r = self.forced_token_ratio
        need(r is None or 0.5 <= r <= 20.0, "forced_token_ratio", r, "0.5 to 20 speech tokens per text token")
        need(
            r is None or (self.min_tokens is None and self.max_tokens is None),
            "forced_token_ratio",
            r,
            "unset when min_tokens or max_tokens is set (both fix the length)",
        )
        return self

    def token_budget(self, n_text: int) -> tuple[int | None, int | None]:
        """(min, max) speech tokens of a sentence of ``n_text`` text tokens (None: the model's rule):
        ``forced_token_ratio`` x ``n_text`` (at least 1) for both when set, else ``min_tokens``, ``max_tokens``."""
        if self.forced_token_ratio is None:
            return self.min_tokens, self.max_tokens
        n = max(1, round(self.forced_token_ratio * n_text))
        return n, n

    def with_(self, **changes: object) -> SynthesisConfig:
        """A validated copy with some fields changed."""
        return replace(self, **changes).validate()

    def rngs(self) -> tuple[np.random.Generator, np.random.Generator]:
        """The request's two independent random generators (LM sampling, vocoder source noise), children of
        ``SeedSequence(seed)``: streamed and whole-sentence synthesis draw the same numbers for a seed."""
        lm, vocoder = np.random.SeedSequence(self.seed).spawn(2)
        return np.random.default_rng(lm), np.random.default_rng(vocoder)


@dataclass
class AudioChunk:
    """A piece of synthesized audio.

    Attributes:
        samples: (N,) float32 in [-1, 1].
        sample_rate: samples per second (24000 for CosyVoice2).
        final: True for the last chunk of the request.
        text: the input text this chunk speaks (the sentence, for non-streamed chunks).
        span: (start, end) character offsets of ``text`` in the request's input.
    """

    samples: np.ndarray
    sample_rate: int
    final: bool = False
    text: str = ""
    span: tuple[int, int] = (0, 0)

    @property
    def duration(self) -> float:
        return len(self.samples) / self.sample_rate

    def pcm16(self) -> bytes:
        """Little-endian 16-bit PCM bytes of the samples (clipped)."""
        return (np.clip(self.samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
