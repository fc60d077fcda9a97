"""Export the HiFT vocoder to two fp32 ONNX graphs and verify them (plus the NumPy source) against the reference.

Graphs (dynamic ``batch``/``frames``/``samples``, fp32, weight norm folded at load by the reference):

* ``hift_f0.onnx``: ``mel (B, 80, T) float32 -> f0 (B, T) float32`` (the F0 predictor).
* ``hift_decode.onnx``: ``mel (B, 80, T)``, ``source (B, 1, T*480) float32 -> wave (B, T*480) float32``: the
  source's STFT as a strided ``Conv`` with fixed DFT x periodic-Hann weights (after a reflect pad, as
  ``torch.stft(center=True)``), the conv stack, and the inverse STFT as a ``ConvTranspose`` with the inverse
  real DFT x window, divided by the overlap-added squared window and trimmed as ``torch.istft(center=True)``.

The sine source and its ``Linear(9, 1) + tanh`` merge run in NumPy (:mod:`cosyvoice_cpu.vocoder.hift`): the noise must
come from the runtime RNG, the phase integration needs float64 accumulation and mirrored float32 rounding, and
``cache_source`` overwrites the *merged* source, which ``decode`` takes as input. The merge weights travel in
the ``hift_decode`` artifact's attrs (no extra file).

Measured on the full-size random model, 2 ORT threads, 500 frames (10 s), best of 8 on a shared 2-core VM:
f0 graph 14 ms, NumPy noise draw 17 ms + source 26 ms (the merge matvec + tanh 0.3 ms of it), decode graph
1.08 s (Conv 67 %, ``Sin`` of the Snakes 20 %: ORT runs ``Sin`` single-threaded), whole vocoder 1.17 s (RTF 0.12).
The iSTFT alone: in the graph (ConvTranspose) 3.0 ms (B=1) / 7.6 ms (B=2), NumPy irfft + overlap-add 8.4 / 9.1 ms,
both rel err ~6e-7 vs ``torch.istft``; so it stays in the graph (one output, no spectrogram copy-out).
``DecodeGraph(istft=False)`` (:mod:`.common`; outputs ``magnitude``, ``phase``) exists only to repeat that measurement.

Weight-only int8 (:func:`.common.quantize_hift_weights_int8`): decode file 70.1 -> 17.6 MB, wave 46 dB SNR / 6.6e-3 max
rel err vs fp32 at 10 s, speed unchanged (1.08 s); ORT keeps the ``DequantizeLinear`` nodes (re-run every call,
RSS after a short run 109 vs 137 MB fp32); with ``session.disable_quant_qdq=1`` it folds them to fp32 at load
(RSS 186 MB: fp32 copies plus the int8 originals). ``quantize_dynamic(Conv, QUInt8)`` (ConvInteger): 25 MB,
0.97 s (-10 %), 37 dB / 1.9e-2; with QInt8 weights ConvInteger is 7x slower (7.9 s).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, rel_err
from cosyvoice_cpu.export.hift.common import decode_context, hift_attrs, window_gate, write_graphs
from cosyvoice_cpu.reference.hift.cosyvoice import HiFT
from cosyvoice_cpu.reference.hift.source import SourceNoise
from cosyvoice_cpu.vocoder.hift import DECODE_FILE, F0_FILE, Vocoder
from cosyvoice_cpu.vocoder.source import SourceNoise as ArrayNoise
from cosyvoice_cpu.vocoder.source import harmonic_source

logger = logging.getLogger(__name__)

# Gate tolerances, ~10x the worst fp32 max relative errors measured by verify_hift (ORT 1.32, torch 2.13, x86-64)
# on the tiny and full-size fixtures, as released (F0 ~0.15 Hz) and with F0 moved to ~120 Hz (voiced), seeds 0-3:
# f0 3.1e-6 (full, unvoiced: the abs of a nearly cancelled sum), source 2.6e-7, decode 1.2e-6, wave 2.9e-5 (tiny,
# voiced: the graph's ulp-level F0 difference integrated into the phase over 64 frames).
# window: hift_decode in windows (cosyvoice_cpu.vocoder.windows) vs one call, the conv's float rounding only.
TOLERANCE = {"f0": 3e-5, "source": 3e-6, "decode": 1e-5, "wave": 3e-4, "window": 1e-5}


class _F0Graph(nn.Module):
    def __init__(self, hift: HiFT) -> None:
        super().__init__()
        self.predictor = hift.f0_predictor

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.predictor(mel)


def export_hift(hift: HiFT, out_dir: Path) -> list[GraphArtifact]:
    """Write ``hift_f0.onnx`` and ``hift_decode.onnx`` (+ ``.data``) into ``out_dir``; see the module docstring."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hift = hift.eval()
    cfg = hift.cfg
    write_graphs(_F0Graph(hift), hift, out_dir)
    artifacts = [
        GraphArtifact.of(out_dir, "hift_f0", F0_FILE, {"in_channels": cfg.in_channels}),
        GraphArtifact.of(
            out_dir, "hift_decode", DECODE_FILE, {**hift_attrs(hift), "context_frames": decode_context(hift)}
        ),
    ]
    logger.info("exported hift graphs to %s", out_dir)
    return artifacts


@torch.no_grad()
def verify_hift(
    hift: HiFT,
    out_dir: Path,
    seed: int = 0,
    files: dict[str, str] | None = None,
    tolerance: dict[str, float] | None = None,
) -> list[GateResult]:
    """Check the exported graphs and the NumPy source against the reference on random mels (B 1 and 2).

    Gates (max relative error over the cases): ``f0`` graph vs ``HiFT.f0``; ``source``: NumPy source vs
    ``HiFT.source`` from the reference F0 and the same :class:`SourceNoise`; ``decode`` graph vs ``HiFT.decode``
    for the same source; ``wave``: the whole :class:`~cosyvoice_cpu.vocoder.hift.Vocoder` vs ``HiFT.inference`` with
    the same noise and a ``cache_source``; ``window``: ``decode`` in windows with the context
    :func:`decode_context` measures (what the export writes) vs one call. ``files`` maps ``hift_f0``/``hift_decode``
    to other file names in ``out_dir`` (e.g. quantized graphs); ``tolerance`` overrides entries of :data:`TOLERANCE`.
    """

    out_dir = Path(out_dir)
    unknown = sorted(set(tolerance or {}) - set(TOLERANCE)) + sorted(set(files or {}) - {"hift_f0", "hift_decode"})
    if unknown:
        raise ConfigError(
            f"verify_hift: unknown keys {unknown}; tolerance keys are {sorted(TOLERANCE)}, "
            "files keys hift_f0, hift_decode"
        )
    tol = {**TOLERANCE, **(tolerance or {})}
    names = {"hift_f0": F0_FILE, "hift_decode": DECODE_FILE, **(files or {})}
    hift = hift.eval()
    cfg = hift.cfg
    voc = Vocoder(out_dir / names["hift_f0"], out_dir / names["hift_decode"], hift_attrs(hift), threads=1)
    gen = torch.Generator().manual_seed(seed)
    worst: dict[str, tuple[float, str]] = {k: (0.0, "") for k in ("f0", "source", "decode", "wave")}
    for batch, frames in ((1, 37), (2, 64), (1, 3)):
        mel = torch.randn(batch, cfg.in_channels, frames, generator=gen) * 2 - 5
        length = frames * cfg.upsample
        noise = SourceNoise.draw(batch, length, hift.m_source.harmonics, cfg.sine_type, generator=gen)
        arrays = ArrayNoise(noise.initial_phase.numpy(), noise.sine_noise.numpy())
        cache = torch.rand(1, 1, min(length, 2 * cfg.upsample), generator=gen) * 2 - 1
        f0 = hift.f0(mel)
        source = hift.source(f0, noise)
        want_wave, want_source = hift.inference(mel, noise, cache)
        got_wave, got_source = voc(mel.numpy(), noise=arrays, cache_source=cache.numpy())
        errors = {
            "f0": rel_err(voc.f0(mel.numpy()), f0.numpy()),
            "source": rel_err(harmonic_source(f0.numpy(), voc.source_cfg, arrays), source.numpy()),
            "decode": rel_err(voc.decode(mel.numpy(), source.numpy()), hift.decode(mel, source).numpy()),
            "wave": max(rel_err(got_wave, want_wave.numpy()), rel_err(got_source, want_source.numpy())),
        }
        for key, value in errors.items():
            if not value <= worst[key][0]:  # also keeps NaN
                worst[key] = (value, f"B={batch} T={frames}")
    worst["window"] = window_gate(voc, hift, gen)
    # graph keys as in the manifest; "hift_source" is the NumPy source, "hift" the whole chain
    graphs = {
        "f0": "hift_f0",
        "source": "hift_source",
        "decode": "hift_decode",
        "wave": "hift",
        "window": "hift_decode",
    }
    results = [
        GateResult(graphs[k], f"{k} max rel err", v, tol[k], f"worst at {where}") for k, (v, where) in worst.items()
    ]
    for r in results:
        logger.info("%s", r)
    return results
