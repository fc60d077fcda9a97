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
``_DecodeGraph(istft=False)`` (outputs ``magnitude``, ``phase``) exists only to repeat that measurement.

Weight-only int8 (:func:`quantize_hift_weights_int8`): decode file 70.1 -> 17.6 MB, wave 46 dB SNR / 6.6e-3 max
rel err vs fp32 at 10 s, speed unchanged (1.08 s); ORT keeps the ``DequantizeLinear`` nodes (re-run every call,
RSS after a short run 109 vs 137 MB fp32); with ``session.disable_quant_qdq=1`` it folds them to fp32 at load
(RSS 186 MB: fp32 copies plus the int8 originals). ``quantize_dynamic(Conv, QUInt8)`` (ConvInteger): 25 MB,
0.97 s (-10 %), 37 dB / 1.9e-2; with QInt8 weights ConvInteger is 7x slower (7.9 s).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, rel_err, torch_export
from cosyvoice_cpu.reference.hift.cosyvoice import HiFT
from cosyvoice_cpu.reference.hift.source import SourceNoise
from cosyvoice_cpu.vocoder.hift import DECODE_FILE, F0_FILE

logger = logging.getLogger(__name__)

# Gate tolerances, ~10x the worst fp32 max relative errors measured by verify_hift (ORT 1.32, torch 2.13, x86-64)
# on the tiny and full-size fixtures, as released (F0 ~0.15 Hz) and with F0 moved to ~120 Hz (voiced), seeds 0-3:
# f0 3.1e-6 (full, unvoiced: the abs of a nearly cancelled sum), source 2.6e-7, decode 1.2e-6, wave 2.9e-5 (tiny,
# voiced: the graph's ulp-level F0 difference integrated into the phase over 64 frames).
# window: hift_decode in windows (cosyvoice_cpu.vocoder.windows) vs one call, the conv's float rounding only.
TOLERANCE = {"f0": 3e-5, "source": 3e-6, "decode": 1e-5, "wave": 3e-4, "window": 1e-5}
# fixed (not learned) conv weights of the decode graph: the DFT kernels, never quantized
FIXED_WEIGHTS = ("stft_weight", "istft_weight", "window_sq")


def dft_kernels(n_fft: int, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed STFT/iSTFT conv weights (computed in float64, stored fp32).

    Returns:
        forward ``(n_fft + 2, 1, n_fft)``: rows ``w[n] cos(2 pi k n / N)`` then ``-w[n] sin(...)``, k = 0..N/2
        (``torch.stft``'s real and imaginary parts); inverse ``(n_fft + 2, 1, n_fft)``: ``irfft`` of each
        one-sided bin times the window (``ConvTranspose1d`` weight); ``window ** 2`` ``(1, 1, n_fft)``.
    """
    w = window.double()
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    angle = 2 * math.pi * k[:, None] * n[None, :] / n_fft  # (K, N)
    forward = torch.cat([w * torch.cos(angle), -w * torch.sin(angle)])
    scale = torch.full((len(k), 1), 2.0 / n_fft, dtype=torch.float64)
    scale[0] = scale[-1] = 1.0 / n_fft  # DC and Nyquist count once
    inverse = torch.cat([scale * torch.cos(angle) * w, -scale * torch.sin(angle) * w])
    return forward.float()[:, None], inverse.float()[:, None], (w * w).float()[None, None]


class _F0Graph(nn.Module):
    def __init__(self, hift: HiFT) -> None:
        super().__init__()
        self.predictor = hift.f0_predictor

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.predictor(mel)


class _DecodeGraph(nn.Module):
    """``HiFT.decode`` with ``torch.stft``/``torch.istft`` replaced by fixed-weight (transposed) convolutions."""

    def __init__(self, hift: HiFT, istft: bool = True) -> None:
        super().__init__()
        self.hift = hift
        self.istft = istft
        fwd, inv, win2 = dft_kernels(hift.cfg.istft_n_fft, hift.stft_window)
        self.register_buffer("stft_weight", fwd)
        self.register_buffer("istft_weight", inv)
        self.register_buffer("window_sq", win2)

    def forward(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        h, cfg = self.hift, self.hift.cfg
        n_fft, hop = cfg.istft_n_fft, cfg.istft_hop_len
        pad = n_fft // 2
        s = F.conv1d(F.pad(source, (pad, pad), mode="reflect"), self.stft_weight, stride=hop)  # (B, N+2, L/hop+1)
        x = h.conv_pre(mel)
        n_res = len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(h.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(h.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + h.source_resblocks[i](h.source_downs[i](s))
            xs = h.resblocks[i * n_res](x)
            for j in range(1, n_res):
                xs = xs + h.resblocks[i * n_res + j](x)
            x = xs / n_res
        x = h.conv_post(F.leaky_relu(x))
        half = n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clamp(max=1e2)
        phase = torch.sin(x[:, half:])
        if not self.istft:
            return magnitude, phase
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        frames = F.conv_transpose1d(spec, self.istft_weight, stride=hop)  # (B, 1, N + hop * (F - 1))
        envelope = F.conv_transpose1d(torch.ones_like(spec[:1, :1]), self.window_sq, stride=hop)
        end = frames.shape[-1] - pad
        wave = frames[:, 0, pad:end] / envelope[:, 0, pad:end]
        return wave.clamp(-cfg.audio_limit, cfg.audio_limit)


def hift_attrs(hift: HiFT) -> dict[str, Any]:
    """What :class:`cosyvoice_cpu.vocoder.hift.Vocoder` needs besides the graphs (JSON-safe)."""
    cfg, src = hift.cfg, hift.m_source
    return {
        "in_channels": cfg.in_channels,
        "sampling_rate": cfg.sampling_rate,
        "upsample": cfg.upsample,
        "nb_harmonics": cfg.nb_harmonics,
        "nsf_alpha": cfg.nsf_alpha,
        "nsf_sigma": cfg.nsf_sigma,
        "voiced_threshold": float(cfg.nsf_voiced_threshold),
        "sine_type": cfg.sine_type,
        "istft_n_fft": cfg.istft_n_fft,
        "istft_hop": cfg.istft_hop_len,
        "audio_limit": cfg.audio_limit,
        "l_linear_weight": [float(v) for v in src.l_linear.weight.detach()[0]],
        "l_linear_bias": float(src.l_linear.bias.detach()[0]),
    }


@torch.no_grad()
def decode_context(hift: Any, frames: int = 96, seed: int = 0) -> list[int] | None:
    """``[left, right]``: mel frames around a window's own that ``hift_decode`` reads for its samples, measured on
    the decode graph by perturbation (:mod:`cosyvoice_cpu.vocoder.windows` windows long calls with it).

    A mel frame and a frame's source samples near the middle of a ``frames``-long call are changed (two places
    each); the farthest output samples that move give the reach, rounded out to whole frames, plus one frame of
    margin: samples after the change read it from their left (``left``), samples before it from their right.
    The reach is fixed by the convolutions (not by the weights' values), and ``verify_hift`` checks the windowed
    call against one call. None when a change reaches the ends of the call (not a local graph): such a graph is
    never windowed. Full-size CosyVoice2: [16, 16]; the tiny fixture's Fun-CosyVoice3 (causal): [30, 6].
    """
    graph = _DecodeGraph(hift).eval()
    up, gen = hift.cfg.upsample, torch.Generator().manual_seed(seed)
    mel = torch.randn(1, hift.cfg.in_channels, frames, generator=gen) * 2 - 5
    source = torch.rand(1, 1, frames * up, generator=gen) * 2 - 1
    base = graph(mel, source)
    left = right = 0
    for k in (frames // 2, frames // 2 + 1):
        for which in ("mel", "source"):
            m, s = mel.clone(), source.clone()
            if which == "mel":
                m[:, :, k] += 1.0
            else:
                s[:, :, k * up : (k + 1) * up] *= -0.5
            moved = torch.nonzero((graph(m, s) - base)[0] != 0).flatten()
            if moved.numel():  # frame k reaches forward to the samples that read it from the left, and back
                left = max(left, int(moved.max()) // up - k)
                right = max(right, k - int(moved.min()) // up)
    if left >= frames // 2 - 2 or right >= frames // 2 - 3:
        return None
    return [left + 1, right + 1]


def window_error(voc: Any, context: list[int] | None, mel: np.ndarray, source: np.ndarray) -> float:
    """Max relative error of ``voc.decode`` in windows of :data:`~cosyvoice_cpu.vocoder.windows.MIN_WINDOW_FRAMES`
    frames with ``context`` against one call (0.0 when ``context`` is None: nothing is windowed)."""
    from cosyvoice_cpu.vocoder.windows import MIN_WINDOW_FRAMES

    if context is None:
        return 0.0
    before = voc.window_frames, voc.context
    voc.window_frames, voc.context = 0, None
    try:
        whole = voc.decode(mel, source)
        voc.window_frames, voc.context = MIN_WINDOW_FRAMES, (int(context[0]), int(context[1]))
        return rel_err(voc.decode(mel, source), whole)
    finally:
        voc.window_frames, voc.context = before


def window_gate(voc: Any, hift: Any, gen: torch.Generator, frames: int = 64) -> tuple[float, str]:
    """The ``window`` gate of ``verify_hift``: (:func:`window_error` on a random B=2 call, where)."""
    context = decode_context(hift)
    mel = (torch.randn(2, hift.cfg.in_channels, frames, generator=gen) * 2 - 5).numpy()
    source = (torch.rand(2, 1, frames * hift.cfg.upsample, generator=gen) * 2 - 1).numpy()
    return window_error(voc, context, mel, source), f"B=2 T={frames}, context_frames {context}"


@torch.no_grad()
def write_graphs(f0_graph: nn.Module, hift: Any, out_dir: Path) -> None:
    """Trace ``f0_graph`` (mel -> f0) and the decode graph of ``hift`` (mel, source -> wave) to ``hift_f0.onnx`` and
    ``hift_decode.onnx`` in ``out_dir``, batch and time dynamic (shared by the v1/v2 and the causal v3 HiFT)."""
    cfg = hift.cfg
    frames = 12
    mel = torch.randn(2, cfg.in_channels, frames)
    source = torch.rand(2, 1, frames * cfg.upsample) * 2 - 1
    torch_export(
        f0_graph.eval(),
        (mel,),
        out_dir / F0_FILE,
        input_names=["mel"],
        output_names=["f0"],
        dynamic_axes={"mel": {0: "batch", 2: "frames"}, "f0": {0: "batch", 1: "frames"}},
    )
    torch_export(
        _DecodeGraph(hift).eval(),
        (mel, source),
        out_dir / DECODE_FILE,
        input_names=["mel", "source"],
        output_names=["wave"],
        dynamic_axes={
            "mel": {0: "batch", 2: "frames"},
            "source": {0: "batch", 2: "samples"},
            "wave": {0: "batch", 1: "samples"},
        },
    )


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
    from cosyvoice_cpu.vocoder.hift import Vocoder
    from cosyvoice_cpu.vocoder.source import SourceNoise as ArrayNoise
    from cosyvoice_cpu.vocoder.source import harmonic_source

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


def quantize_hift_weights_int8(src: Path, dst: Path, min_elements: int = 1024) -> None:
    """Weight-only int8: ``Conv``/``ConvTranspose`` weights stored int8 (symmetric, per output channel) and
    de-quantized by a ``DequantizeLinear`` feeding the unchanged fp32 conv; activations stay fp32.

    The fixed DFT kernels (:data:`FIXED_WEIGHTS`) and weights with fewer than ``min_elements`` values stay fp32.
    ORT does not constant-fold the ``DequantizeLinear`` by default (it re-runs every call, see the module
    docstring for the cost); with the session option ``session.disable_quant_qdq=1`` it folds them to fp32 at load.
    """
    import onnx
    from onnx import helper, numpy_helper

    from cosyvoice_cpu.export.common import save_onnx

    model = onnx.load(str(src), load_external_data=True)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    replaced: dict[str, str] = {}
    new_nodes, new_inits = [], []
    for node in graph.node:
        if node.op_type not in ("Conv", "ConvTranspose") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        name = node.input[1]
        if name not in replaced:
            w = numpy_helper.to_array(inits[name]).astype(np.float32)
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            if name in FIXED_WEIGHTS or w.size < min_elements or (node.op_type == "ConvTranspose" and group != 1):
                continue
            axis = 0 if node.op_type == "Conv" else 1  # the output-channel axis
            reduce = tuple(i for i in range(w.ndim) if i != axis)
            amax = np.abs(w).max(axis=reduce)
            scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
            shape = [1] * w.ndim
            shape[axis] = -1
            q = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
            new_inits += [
                numpy_helper.from_array(q, name + "_int8"),
                numpy_helper.from_array(scale, name + "_scale"),
                numpy_helper.from_array(np.zeros_like(scale, dtype=np.int8), name + "_zero"),
            ]
            new_nodes.append(
                helper.make_node(
                    "DequantizeLinear",
                    [name + "_int8", name + "_scale", name + "_zero"],
                    [name + "_dq"],
                    name=name + "_DequantizeLinear",
                    axis=axis,
                )
            )
            replaced[name] = name + "_dq"
        node.input[1] = replaced[name]
    kept = [t for t in graph.initializer if t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    nodes = new_nodes + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    save_onnx(model, Path(dst))
    logger.info("weight-only int8: %d conv weights of %s -> %s", len(replaced), Path(src).name, dst)
