"""The HiFT vocoder stage at run time: NumPy harmonic source + two ONNX graphs (no torch, no onnx package).

mel ``(B, 80, T)`` -> ``hift_f0.onnx`` -> F0 ``(B, T)`` -> NumPy sine source ``(B, 1, T*480)`` ->
``hift_decode.onnx`` (source STFT as a conv, the conv stack, the inverse STFT as a transposed conv) -> wave
``(B, T*480)``. The graphs and the attrs come from :mod:`cosyvoice_cpu.export.hift.cosyvoice`; its docstring gives
the measurements behind the split.

The source (:mod:`cosyvoice_cpu.vocoder.source`) is NumPy, not a graph: its randomness must come from the
caller's RNG and its phase integration mirrors the reference's float32 operations one by one.

The v3 (Fun-CosyVoice3 causal HiFT) graphs come from :mod:`cosyvoice_cpu.export.hift.cosyvoice3` with the same
contracts and attrs that say ``causal``: sine type ``"v3"`` (:func:`~cosyvoice_cpu.vocoder.source.source_v3`) and
``finalize=False`` calls, which cut the finalize graphs' output to upstream's non-final lengths. Streaming
with bounded work: :class:`cosyvoice_cpu.vocoder.causal_stream.CausalVocoderStream`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig, as_config, check_io
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.jsontypes import JsonValue
from cosyvoice_cpu.vocoder.source import SourceConfig, SourceNoise, harmonic_source
from cosyvoice_cpu.vocoder.windows import DEFAULT_WINDOW_FRAMES, check_window, context_of, decode_windows, plan

logger = logging.getLogger(__name__)

_F32 = np.float32
F0_FILE = "hift_f0.onnx"  # file names in an exported model directory
DECODE_FILE = "hift_decode.onnx"


class Vocoder:
    """mel -> wave with ``hift_f0.onnx``, the NumPy source and ``hift_decode.onnx`` (``HiFT.inference``).

    Args:
        f0_path: ``hift_f0.onnx``: ``mel (B, 80, T)`` -> ``f0 (B, T)``.
        decode_path: ``hift_decode.onnx``: ``mel (B, 80, T)``, ``source (B, 1, T*480)`` -> ``wave (B, T*480)``.
        attrs: the ``hift_decode`` artifact's attrs (:data:`~cosyvoice_cpu.vocoder.source.REQUIRED_ATTRS`).
        threads: ORT intra-op threads per session.
        window_frames: ``hift_decode`` calls longer than this many mel frames run in overlapping windows of
            at most this length (:mod:`cosyvoice_cpu.vocoder.windows`: the same samples, bounded activation
            memory); 0 never splits. Directories exported without ``context_frames`` are never split.
    Raises:
        ModelDirError: a graph is missing, unloadable, or its inputs/outputs differ from the contract.
    """

    def __init__(
        self,
        f0_path: str | Path,
        decode_path: str | Path,
        attrs: dict[str, JsonValue],
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
        self.config = config
        self.f0_sess = open_graph(paths[0], config)
        self.decode_sess = open_graph(paths[1], config)
        f32 = "tensor(float)"
        check_io(self.f0_sess, paths[0], {"mel": (f32, 3)}, {"f0": (f32, 2)})
        check_io(self.decode_sess, paths[1], {"mel": (f32, 3), "source": (f32, 3)}, {"wave": (f32, 2)})
        logger.debug("vocoder ready: %s, %s (%d threads)", paths[0].name, paths[1].name, config.threads)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        attrs: dict[str, JsonValue],
        threads: int | SessionConfig = 1,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
    ) -> Vocoder:
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

        def run(m: np.ndarray, s: np.ndarray, release_memory: bool = False) -> np.ndarray:
            return self.decode_sess.run(["wave"], {"mel": m, "source": s}, release_memory)[0]

        # the last window of a call long enough to be split gives the shared ORT arena's free memory back: ORT
        # keeps what a run grew it to, and a long sentence grows it past the usual (LM, flow, vocoder)
        return decode_windows(
            run,
            mel,
            source,
            up,
            plan(mel.shape[2], self.window_frames, self.context),
            run_last=lambda m, s: run(m, s, release_memory=True),
        )

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
            noise = SourceNoise.stream(rng, mel.shape[0], mel.shape[2] * cfg.upsample, cfg.harmonics, cfg.sine_type)
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
