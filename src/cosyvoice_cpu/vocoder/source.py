"""The HiFT vocoder's harmonic source in NumPy: F0 ``(B, T)`` -> source ``(B, 1, T * upsample)``.

It is computed here, not in a graph, because its randomness (initial phases, Gaussian noise) must come from the
caller's RNG and because its phase integration is precision-critical: the phase reaches ~1e6 radians at 10 s
(float32 ulp 0.06 rad), so the float32 operations of the PyTorch reference (``hift_source.py``) are mirrored one
by one, including the fused multiply-adds torch's AVX2/AVX-512 ``upsample_linear1d`` kernel compiles to. Against
torch 2.13 on x86-64 the source is then bitwise equal for v2 and equal to float32 rounding (``sin``, the
``H -> 1`` merge) otherwise; on a torch build without FMA expect ulp-level phase differences, which the sine turns
into up to ~1e-2 absolute differences after seconds of audio.

Sine types: ``"v1"``/``"v2"`` (:func:`harmonic_source`) and ``"v3"`` (:func:`source_v3`, Fun-CosyVoice3's causal
HiFT: the frame-rate phase is held over each frame, the noise is uniform; relative error vs the reference
1.9e-7, the phase bitwise). The work runs :data:`SOURCE_BLOCK` samples at a time to bound its temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.jsontypes import JsonValue

_F32 = np.float32
SINE_TYPES = ("v1", "v2", "v3")
# attrs of the hift_decode artifact the runtime reads (see export.hift.common.hift_attrs)
REQUIRED_ATTRS = (
    "in_channels",
    "sampling_rate",
    "upsample",
    "nb_harmonics",
    "nsf_alpha",
    "nsf_sigma",
    "voiced_threshold",
    "sine_type",
    "istft_n_fft",
    "istft_hop",
    "audio_limit",
    "l_linear_weight",
    "l_linear_bias",
)


class NoiseStream:
    """One row of sine noise drawn from a generator block by block, as the source reads it (in order from sample
    0): the numbers of one ``(1, length, H)`` draw (NumPy fills an array in order, so consecutive draws continue
    one sequence), without holding them all: 36 bytes per sample, 52 MB for 60 s at 24 kHz."""

    def __init__(self, rng: np.random.Generator, length: int, harmonics: int, uniform: bool) -> None:
        self.rng, self.length, self.harmonics, self.uniform = rng, length, harmonics, uniform
        self._next = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (1, self.length, self.harmonics)

    def take(self, a: int, b: int) -> np.ndarray:
        """Samples ``[a, b)``: ``(1, b - a, H)`` float32; ``a`` must be where the previous call ended."""
        if a != self._next or not a <= b <= self.length:
            raise ConfigError(
                f"streamed source noise is read in order: samples [{a}, {b}) asked after {self._next} of {self.length}"
            )
        self._next = b
        shape = (1, b - a, self.harmonics)
        return self.rng.random(shape, dtype=_F32) if self.uniform else self.rng.standard_normal(shape, dtype=_F32)


@dataclass
class SourceNoise:
    """The random draws of one source computation (NumPy twin of ``reference.hift.source.SourceNoise``).

    Attributes:
        initial_phase: ``(B, H)`` float32 uniform in ``[0, 1)``, ``H = nb_harmonics + 1``; column 0 is ignored.
        sine_noise: ``(B, L, H)`` float32 standard normal, ``L = T * upsample``; ``"v3"``: uniform in ``[0, 1)``, and
            ``(1 or B, >= L, H)`` (upstream's fixed table: rows ``[0, L)`` are used, batch 1 is shared). Or a
            :class:`NoiseStream` (:meth:`stream`), read once.
    """

    initial_phase: np.ndarray
    sine_noise: np.ndarray | NoiseStream

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

    @classmethod
    def stream(
        cls, rng: np.random.Generator, batch: int, length: int, harmonics: int, sine_type: str = "v2"
    ) -> SourceNoise:
        """As :meth:`draw`, the same numbers, but one row's sine noise is drawn as the source reads it (a
        :class:`NoiseStream`: its memory does not grow with the length); several rows are drawn at once."""
        if batch != 1:  # a (B, L, H) draw fills row by row, which block-wise draws could not reproduce
            return cls.draw(rng, batch, length, harmonics, sine_type)
        phase = rng.random((batch, harmonics), dtype=_F32)
        return cls(phase, NoiseStream(rng, length, harmonics, uniform=sine_type == "v3"))


def _noise_table(noise: np.ndarray | NoiseStream) -> np.ndarray | NoiseStream:
    """``sine_noise`` as float32 array, or the :class:`NoiseStream` itself."""
    return noise if isinstance(noise, NoiseStream) else np.asarray(noise, dtype=_F32)


def _noise_rows(noise: np.ndarray | NoiseStream, a: int, b: int) -> np.ndarray:
    """Samples ``[a, b)`` of sine noise held as an array ``(B, >= b, H)`` or drawn by a :class:`NoiseStream`."""
    return noise.take(a, b) if isinstance(noise, NoiseStream) else noise[:, a:b]


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
    def from_attrs(cls, attrs: dict[str, JsonValue]) -> SourceConfig:
        missing = [k for k in REQUIRED_ATTRS if k not in attrs]
        if missing:
            raise ModelDirError(f"hift attrs lack {missing}; re-export the model directory")
        if attrs["sine_type"] not in SINE_TYPES:
            raise ModelDirError(f"hift sine_type must be one of {SINE_TYPES}, got {attrs['sine_type']!r}")
        weight = np.asarray(attrs["l_linear_weight"], dtype=_F32).reshape(-1)
        if weight.size != int(attrs["nb_harmonics"]) + 1:
            raise ModelDirError(f"hift l_linear_weight has {weight.size} values, expected nb_harmonics + 1")
        return cls(
            int(attrs["sampling_rate"]),
            int(attrs["upsample"]),
            weight.size,
            float(attrs["nsf_alpha"]),
            float(attrs["nsf_sigma"]),
            float(attrs["voiced_threshold"]),
            str(attrs["sine_type"]),
            weight,
            float(attrs["l_linear_bias"]),
        )


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
    # thread spinning for a while; called per streamed chunk it held a core busy all along (CPU time taken from
    # concurrent requests; measured: docs/benchmarks-log.md, "Concurrency"). einsum's own loop does not use BLAS.
    merged = np.tanh(np.einsum("blh,h->bl", excitation, cfg.weight) + _F32(cfg.bias))  # (B, L)
    return merged[:, None, :]


SOURCE_BLOCK = 24000  # samples per block of the sample-rate arithmetic: 1 s at 24 kHz


def harmonic_source(f0: np.ndarray, cfg: SourceConfig, noise: SourceNoise, block: int = SOURCE_BLOCK) -> np.ndarray:
    """Merged excitation: ``f0 (B, T)`` Hz at the frame rate -> ``(B, 1, T * upsample)`` in ``[-1, 1]``.

    Everything at the sample rate (phase, sines, gating, merge) runs ``block`` samples at a time into the output,
    with the same per-sample arithmetic (the v1 running sum carried across blocks), so the result does not
    depend on ``block`` while the temporaries stay ~``block * harmonics`` floats instead of growing with the
    length (tracemalloc peak; measured: docs/benchmarks-log.md, "Vocoder").
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
    sine_noise = _noise_table(noise.sine_noise)
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
        out[:, :, a:b] = _merge(f0_up[:, a:b], sines, _noise_rows(sine_noise, a, b), cfg)
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
    table = _noise_table(noise.sine_noise)
    if (
        len(table.shape) != 3
        or table.shape[0] not in (1, batch)
        or table.shape[1] < length
        or table.shape[2] != harmonics
    ):
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
        rows = _noise_rows(table, a, a + len(at))
        source[:, :, a : a + len(at)] = _merge(f0[:, at], sines[:, :, at].transpose(0, 2, 1), rows, cfg)
    return source, total[:, :, -1]


def _frame_of(samples: np.ndarray, upsample: int) -> np.ndarray:
    """Frame index (torch nearest) of the given absolute sample indices."""
    return np.floor(samples.astype(_F32) * _F32(1.0 / float(upsample))).astype(np.int64)
