"""Export the Fun-CosyVoice3 (v3) causal HiFT to ONNX and verify it (plus the NumPy source and the stream).

Same files and contracts as v2 (:mod:`.cosyvoice`; the shared pieces: :mod:`.common`), so
:class:`~cosyvoice_cpu.vocoder.hift.Vocoder` runs both:

* ``hift_f0.onnx``: ``mel (B, 80, T) float32 -> f0 (B, T) float32``, the causal F0 predictor computed in
  **float64** inside the graph (cast in, cast out), as upstream runs it. ONNX Runtime's CPU provider has no
  double ``Conv`` or ``Elu``, so each conv is an unfold (``k`` shifted slices, ``Concat``) + double ``MatMul`` and
  ELU is ``Where(x > 0, x, Exp(min(x, 0)) - 1)``. The first conv looks 3 frames right (zero padded: the
  ``finalize`` behaviour), the other four pad 2 frames left.
* ``hift_decode.onnx``: ``mel (B, 80, T)``, ``source (B, 1, T*480) -> wave (B, T*480)``: ``CausalHiFT.decode``
  with ``finalize=True`` (``conv_pre`` zero-pads 4 frames right), the v2 STFT/iSTFT convolutions, nearest-repeat
  + causal-conv upsampling (``Resize`` + ``Conv``). No random table is in any graph: the v3 source (uniform
  noise, phase held per frame) runs in NumPy (:func:`cosyvoice_cpu.vocoder.source.source_v3`).

Non-final streaming calls need no second graph. Everything but the F0 predictor's first conv and ``conv_pre`` is
causal, so a finalize run over a mel equals the upstream ``finalize=False`` run on every frame whose look-ahead
was real: the runtime runs the finalize graphs and cuts (``Vocoder(..., finalize=False)``: F0/source ``T - 3``
frames, wave ``T - 8`` frames, as upstream). The attrs say so: ``causal``, ``f0_look_right`` 3,
``conv_pre_look_right`` 4, ``stream_context_frames`` (:func:`receptive_field_frames`, the decode graph's left
receptive field) and ``stream_hold_frames`` 5 (mel frames after a frame before its samples are final), used
by :class:`cosyvoice_cpu.vocoder.causal_stream.CausalVocoderStream`.

F0 precision, measured at the released sizes (random weights, classifier moved to F0 ~180 Hz, 10 s = 500 frames,
ORT 1.32, 2 threads, shared 2-core VM): the float64 graph's F0 equals the reference's (float64 computed, returned
float32) exactly, source 1.9e-7 and wave 1.4e-6 max relative error; a float32 graph (``f0_precision="fp32"``)
moves F0 by 8.5e-8, which the phase integration turns into source 7.8e-4 and wave 6.3e-4 at 10 s (0 / 1.3e-6 at
2 s). The float64 graph costs 57 ms per 10 s of audio against 22 ms (the decode graph: 2.4 s), so it is the
default. Streaming at those sizes (chunks of 20, 40, 100 x 4, 40 frames): 4.0 s in all with
:class:`~cosyvoice_cpu.vocoder.causal_stream.CausalVocoderStream` (0.6-0.95 s per 100-frame chunk, flat) against
12.8 s for upstream's re-vocoding of the growing mel (its last chunk 3.6 s) and 2.4 s for one one-shot call.

Weight-only int8 (:func:`.common.quantize_hift_weights_int8`) applies unchanged to ``hift_decode.onnx`` (the
DFT kernels stay fp32); the float64 F0 graph has no Conv and stays as it is.
"""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, rel_err
from cosyvoice_cpu.export.hift.common import decode_context, hift_attrs, window_gate, write_graphs
from cosyvoice_cpu.reference.hift.cosyvoice3 import F0_LOOK_RIGHT, CausalHiFT, CausalHiFTConfig
from cosyvoice_cpu.reference.hift.source import SourceNoise
from cosyvoice_cpu.vocoder.hift import DECODE_FILE, F0_FILE, Vocoder
from cosyvoice_cpu.vocoder.source import SourceNoise as ArrayNoise
from cosyvoice_cpu.vocoder.source import harmonic_source

logger = logging.getLogger(__name__)

# ~10x the worst max relative errors measured by verify_hift (ORT 1.32, torch 2.13, x86-64) on the tiny v3 fixture
# (as released: unvoiced, and with F0 at ~120 Hz; seeds 0-3) and the released sizes (random weights, F0 ~180 Hz,
# 10 s): f0 0 (the float64 graph rounds to the reference's float32 F0 exactly), source 1.9e-7 (sin/tanh rounding),
# decode 1.4e-6, wave 1.4e-6, stream vs the one-shot Vocoder 9e-7 (ulp-level: conv rounding of other windows).
TOLERANCE = {"f0": 2e-6, "source": 3e-6, "decode": 2e-5, "wave": 3e-5, "stream": 1e-5, "window": 1e-5}
STREAM_HOLD_FRAMES = 5  # output frame t needs mel frames up to t + 5 (conv_pre of frame t + 1 looks 4 right)


def receptive_field_frames(cfg: CausalHiFTConfig) -> int:
    """Mel frames to the left of a frame that can change its output samples in ``hift_decode`` (an upper bound).

    Counted in STFT hops (``hop_rate = prod(upsample_rates)`` per mel frame) along the longest causal path: per
    stage ``i`` (rate ``r_i``, ``s_i = hop_rate / r_i`` hops per step) the repeat + causal up conv ``k - 1 + u - 1``
    steps and the widest residual block ``sum_d (k - 1) d + (k - 1)``; the source branch's down-sampling conv and
    residual block feed the same stage; then the reflect pad, ``conv_post`` (6) and the STFT/iSTFT windows.
    """
    hop_rate = math.prod(cfg.upsample_rates)

    def resblock(kernels: list[int], dilations: list[list[int]]) -> int:
        return max(sum((k - 1) * d + (k - 1) for d in ds) for k, ds in zip(kernels, dilations))

    body = resblock(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
    rate, tail, source_path = 1, 0, 0
    stages = []
    for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)):
        rate *= u
        s = hop_rate // rate
        src = (2 * s - 1) + resblock([cfg.source_resblock_kernel_sizes[i]], [cfg.source_resblock_dilation_sizes[i]]) * s
        stages.append(((k - 1 + u - 1) * s, src, body * s))  # up conv, source branch, residual blocks
    for up, src, res in reversed(stages):  # longest path from each stage's inputs to the output
        source_path = max(source_path, src + res + tail)
        tail += up + res
    mel_path = tail
    hops = max(mel_path, source_path) + 1 + 6 + 2 * cfg.istft_n_fft // cfg.istft_hop_len
    return math.ceil(hops / hop_rate) + 1


class _F0Graph(nn.Module):
    """The causal F0 predictor as unfold + ``MatMul`` in ``dtype`` (float64: ORT has no double Conv/Elu)."""

    def __init__(self, hift: CausalHiFT, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        pred = hift.f0_predictor
        self.dtype = dtype
        self.kernels: list[int] = []
        self.pads: list[tuple[int, int]] = []
        for n, i in enumerate(range(0, len(pred.condnet), 2)):
            conv = pred.condnet[i]
            c_out, c_in, k = conv.weight.shape
            w = conv.weight.detach().to(dtype).permute(2, 1, 0).reshape(k * c_in, c_out)  # row j*C_in + c
            self.register_buffer(f"w{n}", w.contiguous())
            self.register_buffer(f"b{n}", conv.bias.detach().to(dtype))
            self.kernels.append(k)
            self.pads.append((0, conv.causal_padding) if conv.side == "right" else (conv.causal_padding, 0))
        self.register_buffer("cls_w", pred.classifier.weight.detach().to(dtype).t().contiguous())
        self.register_buffer("cls_b", pred.classifier.bias.detach().to(dtype))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.to(self.dtype).transpose(1, 2)  # (B, T, C)
        for n, (k, (left, right)) in enumerate(zip(self.kernels, self.pads)):
            x = F.pad(x, (0, 0, left, right))
            length = x.shape[1] - (k - 1)
            cols = torch.cat([x[:, j : j + length] for j in range(k)], dim=2)
            x = cols @ getattr(self, f"w{n}") + getattr(self, f"b{n}")
            x = torch.where(x > 0, x, torch.exp(torch.clamp(x, max=0.0)) - 1.0)  # ELU(alpha=1)
        return (x @ self.cls_w + self.cls_b).squeeze(-1).abs().to(torch.float32)


def hift_v3_attrs(hift: CausalHiFT, f0_precision: str = "fp64") -> dict[str, Any]:
    """The v2 attrs (:func:`.common.hift_attrs`, ``sine_type`` "v3") plus the causal facts (module docstring)."""
    cfg = hift.cfg
    return {
        **hift_attrs(hift),
        "causal": True,
        "f0_look_right": F0_LOOK_RIGHT,
        "conv_pre_look_right": cfg.conv_pre_look_right,
        "nonfinal_trim_frames": F0_LOOK_RIGHT + cfg.conv_pre_look_right + 1,
        "stream_context_frames": receptive_field_frames(cfg),
        "stream_hold_frames": STREAM_HOLD_FRAMES,
        "f0_precision": f0_precision,
    }


@torch.no_grad()
def export_hift(hift: CausalHiFT, out_dir: Path, f0_precision: str = "fp64") -> list[GraphArtifact]:
    """Write ``hift_f0.onnx`` (F0 in ``f0_precision``: "fp64" as upstream, "fp32" to measure the cost) and
    ``hift_decode.onnx`` (+ ``.data``) into ``out_dir``; see the module docstring."""
    if not isinstance(hift, CausalHiFT):
        raise ConfigError(
            f"export.hift.cosyvoice3 exports a CausalHiFT (v3), got {type(hift).__name__}; v1/v2: export.hift.cosyvoice"
        )
    if f0_precision not in ("fp64", "fp32"):
        raise ConfigError(f"f0_precision must be 'fp64' or 'fp32', got {f0_precision!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hift = hift.eval()
    cfg = hift.cfg
    write_graphs(_F0Graph(hift, torch.float64 if f0_precision == "fp64" else torch.float32), hift, out_dir)
    artifacts = [
        GraphArtifact.of(out_dir, "hift_f0", F0_FILE, {"in_channels": cfg.in_channels, "precision": f0_precision}),
        GraphArtifact.of(
            out_dir,
            "hift_decode",
            DECODE_FILE,
            {**hift_v3_attrs(hift, f0_precision), "context_frames": decode_context(hift)},
        ),
    ]
    logger.info("exported v3 hift graphs to %s (F0 %s)", out_dir, f0_precision)
    return artifacts


@torch.no_grad()
def verify_hift(
    hift: CausalHiFT,
    out_dir: Path,
    seed: int = 0,
    files: dict[str, str] | None = None,
    tolerance: dict[str, float] | None = None,
) -> list[GateResult]:
    """Check the exported graphs, the NumPy source and the stream against ``CausalHiFT`` on random mels.

    Gates (max relative error over B 1/2 cases, one upstream-style noise table of batch 1 per case): ``f0``
    graph vs ``CausalHiFT.f0``; ``source`` NumPy vs ``CausalHiFT.source`` from the reference F0; ``decode`` graph
    vs ``decode`` (finalize) for the same source; ``wave`` the whole :class:`~cosyvoice_cpu.vocoder.hift.Vocoder` vs
    ``inference`` with ``finalize`` True and False; ``stream``: :class:`~cosyvoice_cpu.vocoder.causal_stream.
    CausalVocoderStream` fed uneven chunks vs the one-shot ``Vocoder`` on the same graphs (a check of the
    streaming logic, independent of the graphs' precision); ``window`` as v2's. ``files``/``tolerance`` as v2's.
    """
    from cosyvoice_cpu.vocoder.causal_stream import CausalVocoderStream

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
    voc = Vocoder(out_dir / names["hift_f0"], out_dir / names["hift_decode"], hift_v3_attrs(hift), threads=1)
    gen = torch.Generator().manual_seed(seed)
    worst: dict[str, tuple[float, str]] = {k: (0.0, "") for k in TOLERANCE}
    for batch, frames in ((1, 37), (2, 64), (1, 90)):
        mel = torch.randn(batch, cfg.in_channels, frames, generator=gen) * 2 - 5
        harmonics = hift.m_source.harmonics
        noise = SourceNoise(
            torch.rand(1, harmonics, generator=gen),
            torch.rand(1, frames * cfg.upsample + 960, harmonics, generator=gen),
        )
        arrays = ArrayNoise(noise.initial_phase.numpy(), noise.sine_noise.numpy())
        f0 = hift.f0(mel)
        source = hift.source(f0, noise)
        want, want_source = hift.inference(mel, noise)
        got, got_source = voc(mel.numpy(), noise=arrays)
        part, part_source = hift.inference(mel, noise, finalize=False)
        got_part, got_part_source = voc(mel.numpy(), noise=arrays, finalize=False)
        errors = {
            "f0": rel_err(voc.f0(mel.numpy()), f0.numpy()),
            "source": rel_err(harmonic_source(f0.numpy(), voc.source_cfg, arrays), source.numpy()),
            "decode": rel_err(voc.decode(mel.numpy(), source.numpy()), hift.decode(mel, source).numpy()),
            "wave": max(
                rel_err(got, want.numpy()),
                rel_err(got_source, want_source.numpy()),
                rel_err(got_part, part.numpy()),
                rel_err(got_part_source, part_source.numpy()),
            ),
        }
        if batch == 1:
            stream = CausalVocoderStream(voc, noise=arrays)
            bounds = [0, 3, 9, 10, 26, frames]
            pieces = [stream.push(mel.numpy()[:, :, a:b], final=b == frames) for a, b in itertools.pairwise(bounds)]
            errors["stream"] = rel_err(np.concatenate(pieces)[None], got)
        for key, value in errors.items():
            if not value <= worst[key][0]:  # also keeps NaN
                worst[key] = (value, f"B={batch} T={frames}")
    worst["window"] = window_gate(voc, hift, gen)
    graphs = {
        "f0": "hift_f0",
        "source": "hift_source",
        "decode": "hift_decode",
        "wave": "hift",
        "stream": "hift",
        "window": "hift_decode",
    }
    results = [
        GateResult(graphs[k], f"{k} max rel err", v, tol[k], f"worst at {where}") for k, (v, where) in worst.items()
    ]
    for r in results:
        logger.info("%s", r)
    return results
