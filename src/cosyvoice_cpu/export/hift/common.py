"""What the vocoder export of every family shares: the decode graph (:class:`DecodeGraph`: the conv stack with the
STFT/iSTFT as fixed-weight convolutions, for the HiFT of CosyVoice-300M/CosyVoice2 and the causal HiFT of
Fun-CosyVoice3 alike), the tracing of both graphs (:func:`write_graphs`), the attrs the runtime reads
(:func:`hift_attrs`), the measured decode context of windowed calls (:func:`decode_context`, :func:`window_gate`)
and the weight-only int8 recipe (:func:`quantize_hift_weights_int8`; its measured cost is in
:mod:`cosyvoice_cpu.export.hift.cosyvoice`'s docstring).
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

from cosyvoice_cpu.export.common import rel_err, save_onnx, torch_export
from cosyvoice_cpu.reference.hift.common import HiFTBase
from cosyvoice_cpu.vocoder.hift import DECODE_FILE, F0_FILE
from cosyvoice_cpu.vocoder.windows import MIN_WINDOW_FRAMES

logger = logging.getLogger(__name__)

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


class DecodeGraph(nn.Module):
    """``HiFT.decode`` with ``torch.stft``/``torch.istft`` replaced by fixed-weight (transposed) convolutions."""

    def __init__(self, hift: HiFTBase, istft: bool = True) -> None:
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


def hift_attrs(hift: HiFTBase) -> dict[str, Any]:
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
    graph = DecodeGraph(hift).eval()
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
    ``hift_decode.onnx`` in ``out_dir``, batch and time dynamic (every family's HiFT)."""
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
        DecodeGraph(hift).eval(),
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


def quantize_hift_weights_int8(src: Path, dst: Path, min_elements: int = 1024) -> None:
    """Weight-only int8: ``Conv``/``ConvTranspose`` weights stored int8 (symmetric, per output channel) and
    de-quantized by a ``DequantizeLinear`` feeding the unchanged fp32 conv; activations stay fp32.

    The fixed DFT kernels (:data:`FIXED_WEIGHTS`) and weights with fewer than ``min_elements`` values stay fp32.
    ORT does not constant-fold the ``DequantizeLinear`` by default (it re-runs every call, see the module
    docstring for the cost); with the session option ``session.disable_quant_qdq=1`` it folds them to fp32 at load.
    """
    import onnx
    from onnx import helper, numpy_helper

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
