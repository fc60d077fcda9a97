"""The HiFT vocoder stage at run time: NumPy harmonic source + two ONNX graphs (no torch, no onnx package).

mel ``(B, 80, T)`` -> ``hift_f0.onnx`` -> F0 ``(B, T)`` -> NumPy sine source ``(B, 1, T*480)`` ->
``hift_decode.onnx`` (source STFT as a conv, the conv stack, the inverse STFT as a transposed conv) -> wave
``(B, T*480)``. The graphs and the attrs come from :mod:`cosyvoice_cpu.export.hift_graph`; its docstring gives
the measurements behind the split.

The source is computed here, not in a graph, because its randomness (initial phases, Gaussian noise) must come
from the caller's RNG and because its phase integration is precision-critical: the phase reaches ~1e6 radians
at 10 s (float32 ulp 0.06 rad), so the float32 operations of the PyTorch reference (``hift_source.py``) are
mirrored one by one, including the fused multiply-adds torch's AVX2/AVX-512 ``upsample_linear1d`` kernel
compiles to. Against torch 2.13 on x86-64 the source is then bitwise equal for v2 and equal to float32
rounding (``sin``, the ``H -> 1`` merge) otherwise; on a torch build without FMA expect ulp-level phase
differences, which the sine turns into up to ~1e-2 absolute differences after seconds of audio.

The v3 (Fun-CosyVoice3 causal HiFT) graphs come from :mod:`cosyvoice_cpu.export.hift_graph_v3` with the same
contracts and attrs that say ``causal``: sine type ``"v3"`` (:func:`source_v3`: the frame-rate phase is held
over each frame, the noise is uniform; relative error vs the reference 1.9e-7, the phase bitwise) and
``finalize=False`` calls, which cut the finalize graphs' output to upstream's non-final lengths. Streaming
with bounded work: :class:`cosyvoice_cpu.vocoder_stream_v3.CausalVocoderStream`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.sessions import SessionConfig, as_config, check_io, make_session
from cosyvoice_cpu.vocoder_window import DEFAULT_WINDOW_FRAMES, check_window, context_of, decode_windows, plan

logger = logging.getLogger(__name__)

_F32 = np.float32
SINE_TYPES = ("v1", "v2", "v3")
# attrs of the hift_decode artifact the runtime reads (see export.hift_graph.export_hift)
REQUIRED_ATTRS = ("in_channels", "sampling_rate", "upsample", "nb_harmonics", "nsf_alpha", "nsf_sigma",
                  "voiced_threshold", "sine_type", "istft_n_fft", "istft_hop", "audio_limit",
                  "l_linear_weight", "l_linear_bias")  # fmt: skip


@dataclass
class SourceNoise:
    """The random draws of one source computation (NumPy twin of ``reference.hift_source.SourceNoise``).

    Attributes:
        initial_phase: ``(B, H)`` float32 uniform in ``[0, 1)``, ``H = nb_harmonics + 1``; column 0 is ignored.
        sine_noise: ``(B, L, H)`` float32 standard normal, ``L = T * upsample``; ``"v3"``: uniform in ``[0, 1)``, and
            ``(1 or B, >= L, H)`` (upstream's fixed table: rows ``[0, L)`` are used, batch 1 is shared).
    """

    initial_phase: np.ndarray
    sine_noise: np.ndarray

    @classmethod
    def draw(
        cls, rng: np.random.Generator, batch: int, length: int, harmonics: int, sine_type: str = "v2"
    ) -> SourceNoise:
        """Draw from a NumPy generator (not the same numbers as torch's RNG, the same distributions:
        Gaussian sine noise, uniform for ``"v3"``)."""
        phase = rng.random((batch, harmonics), dtype=_F32)
        if sine_type == "v3":
            return cls(phase, rng.random((batch, length, harmonics), dtype=_F32))
        noise = rng.standard_normal((batch, length, harmonics), dtype=_F32)
        return cls(phase, noise)


@dataclass(frozen=True)
class SourceConfig:
    """The harmonic source's constants (``HarmonicSource`` + the ``l_linear`` merge weights)."""

    sampling_rate: int
    upsample: int
    harmonics: int  # nb_harmonics + 1
    sine_amp: float  # nsf_alpha
    noise_std: float  # nsf_sigma
    voiced_threshold: float
    sine_type: str
    weight: np.ndarray  # (H,) float32, l_linear.weight[0]
    bias: float

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> SourceConfig:
        missing = [k for k in REQUIRED_ATTRS if k not in attrs]
        if missing:
            raise ModelDirError(f"hift attrs lack {missing}; re-export the model directory")
        if attrs["sine_type"] not in SINE_TYPES:
            raise ModelDirError(f"hift sine_type must be one of {SINE_TYPES}, got {attrs['sine_type']!r}")
        weight = np.asarray(attrs["l_linear_weight"], dtype=_F32).reshape(-1)
        if weight.size != int(attrs["nb_harmonics"]) + 1:
            raise ModelDirError(f"hift l_linear_weight has {weight.size} values, expected nb_harmonics + 1")
        return cls(int(attrs["sampling_rate"]), int(attrs["upsample"]), weight.size, float(attrs["nsf_alpha"]),
                   float(attrs["nsf_sigma"]), float(attrs["voiced_threshold"]), str(attrs["sine_type"]), weight,
                   float(attrs["l_linear_bias"]))  # fmt: skip


def nearest_index(start: int, stop: int, upsample: int) -> np.ndarray:
    """Input index of output samples ``[start, stop)`` under torch ``F.interpolate(mode="nearest",
    scale_factor=upsample)`` (float32 ``floor(n * (1 / upsample))``; equals ``n // 480`` below ~1e7 samples)."""
    return _frame_of(np.arange(start, stop), upsample)


def upsample_nearest(f0: np.ndarray, upsample: int) -> np.ndarray:
    """``(B, T)`` -> ``(B, T * upsample)``, torch ``F.interpolate(mode="nearest", scale_factor=upsample)``."""
    idx = nearest_index(0, int(f0.shape[-1] * float(upsample)), upsample)
    return f0[..., np.minimum(idx, f0.shape[-1] - 1)]


def _linear_taps(in_size: int, scale_factor: float, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, ...]:
    """Indices and weights of torch ``upsample_linear1d`` (``align_corners=False``, scale factor given) for the
    output positions ``[start, stop)`` (default: all ``int(in_size * scale_factor)``).

    The source index ``scale * (dst + 0.5) - 0.5`` is one rounding (an FMA in torch's vectorised build).
    """
    out_size = int(in_size * scale_factor) if stop is None else stop
    scale = _F32(1.0 / scale_factor)
    dst = np.arange(start, out_size).astype(_F32) + _F32(0.5)
    src = np.maximum((np.float64(scale) * dst - 0.5).astype(_F32), _F32(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    w1 = np.clip(src - i0.astype(_F32), _F32(0), _F32(1))
    return i0, i0 + (i0 < in_size - 1), _F32(1) - w1, w1


def interpolate_linear(x: np.ndarray, scale_factor: float, start: int = 0, stop: int | None = None) -> np.ndarray:
    """``(..., N)`` -> ``(..., int(N * scale_factor))`` like torch ``F.interpolate(mode="linear")``, or only the
    output positions ``[start, stop)`` of it (the same values).

    torch's vectorised kernel computes ``fma(x0, w0, x1 * w1)``; ``x0 * w0`` is exact in float64, so one float64
    add and a cast to float32 reproduce it (bar a double rounding, ~1 in 2**29 values).
    """
    i0, i1, w0, w1 = _linear_taps(x.shape[-1], scale_factor, start, stop)
    return (x[..., i0].astype(np.float64) * w0 + x[..., i1] * w1).astype(_F32)


def frame_phase_v2(f0_up: np.ndarray, initial_phase: np.ndarray, sampling_rate: int, upsample: int) -> np.ndarray:
    """SineGen2 phase integrated at the frame rate: ``f0_up (B, L)`` Hz -> ``(B, H, L / upsample)`` radians times
    ``upsample``; :func:`interpolate_linear` by ``upsample`` gives the phase of every sample.

    The per-sample increment ``(f0 * k / sr) % 1`` is only evaluated at the samples the linear down-sampling
    reads (two per frame), which is exact: the down-sampling is a gather + blend.
    """
    harmonics = initial_phase.shape[1]
    k = np.arange(1, harmonics + 1, dtype=_F32)
    i0, i1, w0, w1 = _linear_taps(f0_up.shape[-1], 1 / upsample)
    start = initial_phase.astype(_F32).copy()
    start[:, 0] = 0

    def step(idx: np.ndarray) -> np.ndarray:  # (B, H, T) cycles per sample at the given samples
        s = np.remainder(f0_up[:, idx, None] * k / _F32(sampling_rate), _F32(1)).transpose(0, 2, 1)
        if idx[0] == 0:  # the initial phase is added to sample 0 only
            s[:, :, 0] += start
        return s

    frames = (step(i0).astype(np.float64) * w0 + step(i1) * w1).astype(_F32)
    phase = np.cumsum(frames, axis=-1, dtype=np.float64).astype(_F32) * _F32(2) * _F32(math.pi)
    return phase * _F32(upsample)


def sine_phase_v1(
    f0_up: np.ndarray, initial_phase: np.ndarray, sampling_rate: int, carry: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """SineGen phase: ``f0_up (B, L)`` Hz -> (radians ``(B, H, L)``, carry ``(B, H)`` float64), a wrapped running
    sum at the sample rate. ``carry`` is the float64 running sum before these samples (None at sample 0); passing
    the returned one with the next samples continues the sum exactly (sequential float64 adds either way)."""
    harmonics = initial_phase.shape[1]
    step = np.stack([f0_up * _F32(i + 1) / _F32(sampling_rate) for i in range(harmonics)], axis=1)
    start = initial_phase.astype(_F32) * _F32(2 * math.pi) + _F32(-math.pi)
    start[:, 0] = 0
    step = step.astype(np.float64)
    if carry is not None:
        step[:, :, 0] += carry
    total = np.cumsum(step, axis=-1)
    cycles = np.remainder(total.astype(_F32), _F32(1))
    return _F32(2 * math.pi) * cycles + start[..., None], total[:, :, -1]


def _merge(f0_up: np.ndarray, sines: np.ndarray, sine_noise: np.ndarray, cfg: SourceConfig) -> np.ndarray:
    """Voiced/unvoiced gating, noise and the ``Linear(H, 1) + tanh`` merge: ``f0_up (B, L)``, ``sines (B, L, H)``
    (already times ``sine_amp``), ``sine_noise (B or 1, L, H)`` -> ``(B, 1, L)``."""
    uv = (f0_up > _F32(cfg.voiced_threshold)).astype(_F32)[..., None]
    noise_amp = uv * _F32(cfg.noise_std) + (_F32(1) - uv) * _F32(cfg.sine_amp) / _F32(3)
    excitation = sines * uv + noise_amp * sine_noise
    # not ``excitation @ weight``: that is an OpenBLAS gemv, and after every BLAS call OpenBLAS keeps a second
    # thread spinning for a while; called per streamed chunk it held a core busy all along (on the tiny model,
    # 0.35 s of CPU per sentence, taken from concurrent requests). einsum's own loop does not use BLAS.
    merged = np.tanh(np.einsum("blh,h->bl", excitation, cfg.weight) + _F32(cfg.bias))  # (B, L)
    return merged[:, None, :]


SOURCE_BLOCK = 24000  # samples per block of the sample-rate arithmetic: 1 s at 24 kHz


def harmonic_source(f0: np.ndarray, cfg: SourceConfig, noise: SourceNoise, block: int = SOURCE_BLOCK) -> np.ndarray:
    """Merged excitation: ``f0 (B, T)`` Hz at the frame rate -> ``(B, 1, T * upsample)`` in ``[-1, 1]``.

    Everything at the sample rate (phase, sines, gating, merge) runs ``block`` samples at a time into the output,
    with the same per-sample arithmetic (the v1 running sum carried across blocks), so the result does not
    depend on ``block`` while the temporaries stay ~``block * harmonics`` floats: 10 s of CosyVoice2 source
    held ~40 MB of them at once before (tracemalloc peak), a few MB now.
    """
    if block <= 0:
        raise ConfigError(f"source block must be > 0 samples, got {block}")
    f0 = np.asarray(f0, dtype=_F32)
    if f0.ndim != 2:
        raise ConfigError(f"hift source expects f0 (B, T), got shape {f0.shape}")
    if cfg.sine_type == "v3":
        return source_v3(f0, cfg, noise, block=block)[0]
    f0_up = upsample_nearest(f0, cfg.upsample)
    batch, length = f0_up.shape
    phase0 = np.asarray(noise.initial_phase, dtype=_F32)
    sine_noise = np.asarray(noise.sine_noise, dtype=_F32)
    if phase0.shape != (batch, cfg.harmonics) or sine_noise.shape != (batch, length, cfg.harmonics):
        raise ConfigError(
            f"SourceNoise shapes {phase0.shape}/{sine_noise.shape} do not match "
            f"{(batch, cfg.harmonics)}/{(batch, length, cfg.harmonics)}"
        )
    frame_phase = frame_phase_v2(f0_up, phase0, cfg.sampling_rate, cfg.upsample) if cfg.sine_type == "v2" else None
    out = np.empty((batch, 1, length), _F32)
    carry = None
    for a in range(0, length, block):
        b = min(a + block, length)
        if frame_phase is not None:
            phase = interpolate_linear(frame_phase, float(cfg.upsample), a, b)
        else:
            phase, carry = sine_phase_v1(f0_up[:, a:b], phase0, cfg.sampling_rate, carry)
        sines = (np.sin(phase) * _F32(cfg.sine_amp)).transpose(0, 2, 1)  # (B, b - a, H)
        out[:, :, a:b] = _merge(f0_up[:, a:b], sines, sine_noise[:, a:b], cfg)
    return out


def source_v3(
    f0: np.ndarray,
    cfg: SourceConfig,
    noise: SourceNoise,
    start: int = 0,
    carry: np.ndarray | None = None,
    block: int = SOURCE_BLOCK,
) -> tuple[np.ndarray, np.ndarray]:
    """Causal ``SineGen2`` (v3) source of the frames ``[start, start + T)`` of an utterance.

    ``f0 (B, T)`` Hz -> ``(source (B, 1, T * upsample), carry (B, H) float64)``. As the torch reference: the
    per-sample increment ``(f0 * k / sr) % 1`` is linearly down-sampled to the frame rate (two samples inside each
    frame are read), summed in float64 (``cumsum``) and cast, ``* 2 pi * upsample``, then *held* (nearest) over
    the frame's samples. ``carry`` is the running float64 sum before ``start`` (None at 0); passing the returned
    one to the next call continues the sum exactly, so consecutive calls equal one call over all frames (indices
    are absolute). ``noise.sine_noise`` rows are the samples of these frames (``(1 or B, >= T*upsample, H)``,
    uniform; longer tables are cut); ``initial_phase`` only touches sample 0, which is never read (upsample > 1).
    ``block``: samples per step of the sample-rate gather and merge (memory only: the same bits for any value).
    """
    f0 = np.asarray(f0, dtype=_F32)
    batch, frames = f0.shape
    up, harmonics = cfg.upsample, cfg.harmonics
    length = frames * up
    table = np.asarray(noise.sine_noise, dtype=_F32)
    if table.ndim != 3 or table.shape[0] not in (1, batch) or table.shape[1] < length or table.shape[2] != harmonics:
        raise ConfigError(f"v3 SourceNoise.sine_noise {table.shape} must be (1 or {batch}, >= {length}, {harmonics})")
    k = np.arange(1, harmonics + 1, dtype=_F32)
    i0, i1, w0, w1 = _linear_taps((start + frames) * up, 1 / up, start, start + frames)  # absolute sample indices

    def step(idx: np.ndarray) -> np.ndarray:  # (B, H, T) cycles per sample at the given absolute samples
        fr = np.clip(_frame_of(idx, up) - start, 0, frames - 1)
        s = np.remainder(f0[:, fr, None] * k / _F32(cfg.sampling_rate), _F32(1)).transpose(0, 2, 1)
        if start == 0 and idx.size and idx[0] == 0:  # the initial phase: sample 0 only (never read when up > 1)
            first = np.asarray(noise.initial_phase, dtype=_F32).copy()
            first[:, 0] = 0
            s[:, :, 0] += first
        return s

    steps = (step(i0).astype(np.float64) * w0 + step(i1) * w1).astype(_F32).astype(np.float64)
    if carry is not None:
        steps[:, :, 0] += carry
    total = np.cumsum(steps, axis=-1)  # sequential float64, as torch's CPU cumsum of float32
    phase = total.astype(_F32) * _F32(2) * _F32(math.pi)
    sines = np.sin(phase * _F32(up)) * _F32(cfg.sine_amp)  # (B, H, T): constant over each frame's samples
    fr = np.minimum(nearest_index(start * up, start * up + length, up) - start, frames - 1)
    source = np.empty((batch, 1, length), _F32)
    for a in range(0, length, block):  # the sample-rate gather and merge, block samples at a time
        at = fr[a : a + block]
        source[:, :, a : a + len(at)] = _merge(f0[:, at], sines[:, :, at].transpose(0, 2, 1), table[:, a : a + len(at)],
                                               cfg)  # fmt: skip
    return source, total[:, :, -1]


def _frame_of(samples: np.ndarray, upsample: int) -> np.ndarray:
    """Frame index (torch nearest) of the given absolute sample indices."""
    return np.floor(samples.astype(_F32) * _F32(1.0 / float(upsample))).astype(np.int64)


F0_FILE = "hift_f0.onnx"  # file names in an exported model directory
DECODE_FILE = "hift_decode.onnx"


class Vocoder:
    """mel -> wave with ``hift_f0.onnx``, the NumPy source and ``hift_decode.onnx`` (``HiFT.inference``).

    Args:
        f0_path: ``hift_f0.onnx``: ``mel (B, 80, T)`` -> ``f0 (B, T)``.
        decode_path: ``hift_decode.onnx``: ``mel (B, 80, T)``, ``source (B, 1, T*480)`` -> ``wave (B, T*480)``.
        attrs: the ``hift_decode`` artifact's attrs (:data:`REQUIRED_ATTRS`).
        threads: ORT intra-op threads per session.
        window_frames: ``hift_decode`` calls longer than this many mel frames run in overlapping windows of
            at most this length (:mod:`cosyvoice_cpu.vocoder_window`: the same samples, bounded activation
            memory); 0 never splits. Directories exported without ``context_frames`` are never split.
    Raises:
        ModelDirError: a graph is missing, unloadable, or its inputs/outputs differ from the contract.
    """

    def __init__(
        self,
        f0_path: str | Path,
        decode_path: str | Path,
        attrs: dict[str, Any],
        threads: int | SessionConfig = 1,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
    ) -> None:
        self.source_cfg = SourceConfig.from_attrs(attrs)
        self.window_frames = check_window(window_frames)
        self.context = context_of(attrs)  # (left, right) mel frames a window needs around the samples it keeps
        self.in_channels = int(attrs["in_channels"])
        self.audio_limit = float(attrs["audio_limit"])
        self.attrs = dict(attrs)
        # causal (v3) HiFT: mel frames the F0 predictor / conv_pre read to the right of a frame (0 = not causal)
        self.causal = bool(attrs.get("causal", False))
        self.f0_look_right = int(attrs.get("f0_look_right", 0))
        self.conv_pre_look_right = int(attrs.get("conv_pre_look_right", 0))
        paths = (Path(f0_path), Path(decode_path))
        for p in paths:
            if not p.is_file():
                raise ModelDirError(f"hift graph {p} not found; export the model directory first")
        config = as_config(threads)
        self.f0_sess = make_session(paths[0], config)
        self.decode_sess = make_session(paths[1], config)
        f32 = "tensor(float)"
        check_io(self.f0_sess, paths[0], {"mel": (f32, 3)}, {"f0": (f32, 2)})
        check_io(self.decode_sess, paths[1], {"mel": (f32, 3), "source": (f32, 3)}, {"wave": (f32, 2)})
        logger.debug("vocoder ready: %s, %s (%d threads)", paths[0].name, paths[1].name, config.threads)

    @classmethod
    def from_dir(cls, model_dir: str | Path, attrs: dict[str, Any], threads: int | SessionConfig = 1,
                 window_frames: int = DEFAULT_WINDOW_FRAMES) -> Vocoder:  # fmt: skip
        """The vocoder from the standard file names in an exported directory (``attrs``: ``hift_decode``'s)."""
        d = Path(model_dir)
        return cls(d / F0_FILE, d / DECODE_FILE, attrs, threads, window_frames)

    def f0(self, mel: np.ndarray) -> np.ndarray:
        """``mel (B, 80, T)`` -> F0 in Hz ``(B, T)``."""
        return self.f0_sess.run(["f0"], {"mel": self._mel(mel)})[0]

    def decode(self, mel: np.ndarray, source: np.ndarray) -> np.ndarray:
        """``mel (B, 80, T)``, ``source (B, 1, T * upsample)`` -> wave ``(B, T * upsample)`` in ±audio_limit; in
        windows when ``T`` exceeds :attr:`window_frames` (the same samples up to float rounding)."""
        mel = self._mel(mel)
        source = np.ascontiguousarray(source, dtype=_F32)
        up = self.source_cfg.upsample
        want = (mel.shape[0], 1, mel.shape[2] * up)
        if source.shape != want:
            raise ConfigError(f"hift decode expects source {want} for mel {mel.shape}, got {source.shape}")

        def run(m: np.ndarray, s: np.ndarray) -> np.ndarray:
            return self.decode_sess.run(["wave"], {"mel": m, "source": s})[0]

        return decode_windows(run, mel, source, up, plan(mel.shape[2], self.window_frames, self.context))

    def __call__(
        self,
        mel: np.ndarray,
        rng: np.random.Generator | None = None,
        noise: SourceNoise | None = None,
        cache_source: np.ndarray | None = None,
        finalize: bool = True,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``mel (B, 80, T)`` -> ``(wave (B, T*480), source (B, 1, T*480))``, like ``HiFT.inference``.

        ``noise`` (any object with ``initial_phase``/``sine_noise`` arrays) wins over ``rng``; without both a
        fresh ``default_rng()`` draws it. ``cache_source (B or 1, 1, n)`` overwrites the first ``n`` source
        samples (streaming overlap); the returned source holds it.

        ``finalize=False`` (causal v3 only, ``CausalHiFT.inference(finalize=False)``): the last mel frames are
        look-ahead only; F0 and source cover ``T - 3`` frames and the wave ``T - 8`` frames. The graphs are the
        finalize ones (zero right padding); the frames whose look-ahead would read those zeros are cut here.
        """
        mel = self._mel(mel)
        f0 = self.f0(mel)
        cfg = self.source_cfg
        frames = mel.shape[2]
        if not finalize:
            if not self.causal:
                raise ConfigError("finalize=False needs a causal (v3) HiFT; v1/v2 vocode every chunk whole")
            cut = self.f0_look_right + self.conv_pre_look_right + 1
            if frames <= cut:
                raise ConfigError(f"a non-final HiFT call needs more than {cut} mel frames, got {frames}")
            f0, mel = f0[:, : frames - self.f0_look_right], mel[:, :, : frames - self.f0_look_right]
        if noise is None:
            rng = rng if rng is not None else np.random.default_rng()
            noise = SourceNoise.draw(rng, mel.shape[0], mel.shape[2] * cfg.upsample, cfg.harmonics, cfg.sine_type)
        source = harmonic_source(f0, cfg, noise)
        if cache_source is not None and np.shape(cache_source)[-1] != 0:
            cache = np.asarray(cache_source, dtype=_F32)
            if (
                cache.ndim != 3
                or cache.shape[1] != 1
                or cache.shape[0] not in (1, source.shape[0])
                or (cache.shape[-1] > source.shape[-1])
            ):
                raise ConfigError(f"cache_source {cache.shape} must be (B or 1, 1, n) with n <= {source.shape[-1]}")
            source[:, :, : cache.shape[-1]] = cache
        wave = self.decode(mel, source)
        if not finalize:
            wave = wave[:, : (frames - self.f0_look_right - self.conv_pre_look_right - 1) * cfg.upsample]
        return wave, source

    def _mel(self, mel: np.ndarray) -> np.ndarray:
        mel = np.ascontiguousarray(mel, dtype=_F32)
        if mel.ndim != 3 or mel.shape[1] != self.in_channels or mel.shape[2] == 0:
            raise ConfigError(f"hift expects mel (B, {self.in_channels}, T>0), got shape {mel.shape}")
        return mel
