"""Every graph of a model directory run once on fixed inputs, so that two CPUs can compare their kernels' numerics.

ONNX Runtime (MLAS) and NumPy pick their kernels from the CPU they run on: SSE, AVX, AVX2, AVX-512, VNNI on x86,
NEON with or without dot product on arm64. The same graph on the same inputs therefore gives slightly different
numbers on different CPUs. :func:`probe_model` runs each graph of a model directory on inputs drawn from a fixed
seed (the same on every machine) and returns its outputs; :func:`compare` holds two such results to the tolerances
of :data:`TOLERANCE`. Run as ``python -m cosyvoice_cpu.probes.graphs MODEL_DIR OUT.npz`` (on another machine,
or under ``qemu-x86_64 -cpu Denverton``) and compare the files with :func:`compare`; ``tests/platform`` does this
under qemu, and ``bench/qemu_platforms.py`` also traces the sampled tokens.

The LM runs through :class:`~cosyvoice_cpu.lm.session.LMSession` (its KV cache is bound in place): a prefill of
``LM_PREFILL`` text-embedding rows, then ``LM_DECODE`` one-token decode steps on fixed speech tokens, so both the
many-row and the one-row kernels are covered. The other graphs run through
:func:`~cosyvoice_cpu.backends.registry.open_graph` on random inputs shaped from the graph's own declared inputs.
Random inputs exercise the same kernels as speech does (the kernels do not look at the values); what they do not
reproduce is how close a real sentence's sampling comes to a tie (see docs/deploy.md, "Platforms").
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import NodeInfo, SessionConfig
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.hardware.features import numpy_cpu_features
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.manifest import Manifest

logger = logging.getLogger(__name__)

SEED = 20260
LM_PREFILL = 12  # positions of the prefill (rows 0..11 of the text table)
LM_DECODE = 6  # one-token decode steps after it
# sizes given to the graphs' dynamic axes (a name not listed gets DEFAULT_DIM)
DIMS = {"batch": 2, "B": 1, "tokens": 12, "context": 3, "time": 48, "frames": 24, "T": 96, "prompt_frames": 8}
DEFAULT_DIM = 16
# names of inputs given fixed contents rather than normal draws
_ZEROS = ("conv_state",)
_ONES = ("mask",)

# Normalised max error max|a - b| / max|a| allowed per output against the same graph on another CPU, 4-12x the
# largest measured (docs/deploy.md, "Platforms: numerics across CPUs", has the table). Keys are "graph/output".
# fp32 kernels differ only in the order of their sums and their exp/erf/sigmoid approximations: <= 8.2e-7
# measured. Int8 graphs differ by design:
# - MatMulNBits at accuracy level 4 (the LM; the flow encoder of exports made after 2026-12-05) quantizes its
#   activations to int8 only where ORT has an int8 kernel for it (AVX2, AVX-512, arm64 dot product); on SSE,
#   AVX-only and NEON without dot product it computes in fp32: LM logp 1.2e-3 apart (0.014 nats), the flow
#   encoder's mu 9.7e-3 (the int8 activations' own rounding; its tolerance is 5x that);
# - the estimator's dynamic int8: the u8s8 GEMMs are bit-exact on every ISA (7-bit weights), but an fp32 difference
#   of 1e-7 upstream moves a value across a rounding edge of DynamicQuantizeLinear, one quantization step that
#   spreads through the later layers: 2.7e-3.
INT8_TOLERANCE = 1e-2
INT8_ACTIVATION_TOLERANCE = 5e-2  # an output whose int8-activation path may run in fp32 on another CPU
FP32_TOLERANCE = 1e-5
TOLERANCE: dict[str, float] = {
    "lm/prefill_logp": INT8_TOLERANCE,
    "lm/decode_logp": INT8_TOLERANCE,
    "flow_encoder/mu": INT8_ACTIVATION_TOLERANCE,
    "flow_estimator/estimator_out": INT8_TOLERANCE,
    "flow_estimator_stream/velocity": INT8_TOLERANCE,
    "flow_estimator_stream/new_h": INT8_TOLERANCE,  # float16 (1 ulp = 1e-3 relative), after int8 layers
    "flow_estimator_stream/new_conv_state": INT8_TOLERANCE,
}


@dataclass(frozen=True)
class Diff:
    """One output of one graph on two machines: ``err`` = max|a - b| / max|a| (int outputs: the share of elements
    that differ), held to ``tolerance``."""

    key: str
    err: float
    max_abs: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.tolerance

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "OVER"
        return f"{self.key:40s} err {self.err:9.2e} (max abs {self.max_abs:9.2e}) tol {self.tolerance:7.0e} {verdict}"


def _dims(shape: list[int | str | None]) -> list[int]:
    return [d if isinstance(d, int) else DIMS.get(str(d), DEFAULT_DIM) for d in shape]


def _dtype(onnx_type: str) -> type:
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
    types["tensor(int32)"] = np.int32
    if onnx_type not in types:
        raise ConfigError(f"the graph probe cannot make an input of type {onnx_type}")
    return types[onnx_type]


def graph_feeds(
    name: str, inputs: list[NodeInfo], manifest: Manifest, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Fixed random inputs for the graph ``name`` from its declared inputs (``GraphSession.get_inputs()``).

    Float inputs are standard normal draws (a mel is shifted to log-mel values around -4, a time ``t`` drawn in
    [0, 1)), token ids are drawn below the speech vocabulary, lengths and counts follow the shapes they describe.
    """
    feeds: dict[str, np.ndarray] = {}
    for node in inputs:
        shape, dtype = _dims(node.shape), _dtype(node.type)
        n = node.name
        if name == "hift_decode" and n == "source":  # one excitation sample per output sample
            frames = feeds["mel"].shape[-1]
            hop = int(np.prod(manifest.hift["upsample_rates"])) * int(manifest.hift["istft_hop_len"])
            shape = [shape[0], 1, frames * hop]
            feeds[n] = (0.1 * rng.standard_normal(shape)).astype(dtype)
        elif n in ("token", "context"):
            feeds[n] = rng.integers(0, int(manifest.lm["speech_token_size"]), shape).astype(dtype)
        elif n in ("chunk_size", "keep_frames"):
            feeds[n] = np.array(0, dtype)
        elif n.endswith("_length"):
            feeds[n] = np.array([feeds[inputs[0].name].shape[-1]] * shape[0], dtype)
        elif n == "t":
            feeds[n] = rng.random(shape).astype(dtype)
        elif n in _ZEROS:
            feeds[n] = np.zeros(shape, dtype)
        elif n in _ONES:
            feeds[n] = np.ones(shape, dtype)
        elif n == "context_h":  # empty: the whole-sentence call of a stream estimator (keep_frames 0)
            feeds[n] = np.zeros([s if i != 2 else 0 for i, s in enumerate(shape)], dtype)
        elif np.issubdtype(dtype, np.floating):
            x = rng.standard_normal(shape)
            feeds[n] = (x - 4.0 if n in ("mel", "feats") else x).astype(dtype)
        else:
            raise ConfigError(f"the graph probe does not know what to feed {name}'s integer input {n!r}")
    return feeds


def probe_lm(model_dir: Path, manifest: Manifest, threads: int) -> dict[str, np.ndarray]:
    """LM logp (V,) after a prefill of text rows, then (LM_DECODE, V) over one-token decode steps."""
    entry = manifest.graphs["lm"]
    config = SessionConfig(threads=threads)
    session = LMSession.from_dir(
        model_dir, entry.attrs, threads=config, min_rows=2 if entry.precision == "int4" else None
    )
    cache = session.new_cache(1)
    prefill = session.prefill(cache, 0, session.embed_text(np.arange(LM_PREFILL)))
    tokens = np.random.default_rng(SEED).integers(0, int(manifest.lm["speech_token_size"]), LM_DECODE)
    steps = [session.decode(cache, [0], [int(t)])[0] for t in tokens]
    return {"lm/prefill_logp": np.asarray(prefill), "lm/decode_logp": np.stack(steps)}


def probe_model(model_dir: str | Path, threads: int = 1) -> dict[str, np.ndarray]:
    """Every graph of ``model_dir`` (the manifest's graphs, then the front-end's ``campplus`` and
    ``speech_tokenizer``) on fixed inputs: ``"graph/output"`` -> array, inputs saved as ``"graph/in/name"``, and
    the CPU features NumPy read from ``cpuid`` as ``"meta/cpu_features"``."""
    model_dir = Path(model_dir)
    manifest = Manifest.load(model_dir)
    out = probe_lm(model_dir, manifest, threads) if "lm" in manifest.graphs else {}
    paths = {k: model_dir / g.file.file for k, g in manifest.graphs.items() if k != "lm"}
    paths.update({k: model_dir / f.file for k, f in manifest.files.items() if k in ("campplus", "speech_tokenizer")})
    for name, path in paths.items():
        session = open_graph(path, SessionConfig(threads=threads))
        feeds = graph_feeds(name, session.get_inputs(), manifest, np.random.default_rng([SEED, len(name)]))
        names = [o.name for o in session.get_outputs()]
        for o, value in zip(names, session.run(names, feeds)):
            out[f"{name}/{o}"] = np.asarray(value)
        out.update({f"{name}/in/{k}": v for k, v in feeds.items()})
    features, _ = numpy_cpu_features()  # what the kernels' dispatch saw (under qemu: the emulated CPU)
    out["meta/cpu_features"] = np.array(sorted(k for k, on in (features or {}).items() if on))
    return out


def compare(ref: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> list[Diff]:
    """The outputs of ``other`` against ``ref`` (both from :func:`probe_model`); inputs must be identical (an
    input that differs means the two runs did not draw the same inputs, and its err is reported as infinite)."""
    diffs = []
    for key in sorted(k for k in ref if not k.startswith("meta/")):
        a, b = ref[key], other.get(key)
        if b is None or a.shape != b.shape:
            diffs.append(Diff(key, math.inf, math.inf, 0.0))
            continue
        if "/in/" in key:
            same = np.array_equal(a, b)
            diffs.append(Diff(key, 0.0 if same else math.inf, 0.0, 0.0))
        elif not np.issubdtype(a.dtype, np.floating):
            diffs.append(Diff(key, float(np.mean(a != b)), float(np.max(np.abs(a - b), initial=0)), 0.0))
        else:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            finite = np.isfinite(a64)
            if not np.array_equal(finite, np.isfinite(b64)):
                diffs.append(Diff(key, math.inf, math.inf, TOLERANCE.get(key, FP32_TOLERANCE)))
                continue
            delta = float(np.max(np.abs(a64[finite] - b64[finite]), initial=0.0))
            scale = float(np.max(np.abs(a64[finite]), initial=0.0)) or 1.0
            diffs.append(Diff(key, delta / scale, delta, TOLERANCE.get(key, FP32_TOLERANCE)))
    return diffs


def main(argv: list[str] | None = None) -> int:
    """``python -m cosyvoice_cpu.probes.graphs MODEL_DIR OUT.npz [--against REF.npz]``."""
    p = argparse.ArgumentParser(prog="python -m cosyvoice_cpu.probes.graphs", description=__doc__.split("\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path, help="where to write the outputs (.npz)")
    p.add_argument("--against", type=Path, help="a probe of the same model on another CPU to compare with")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    result = probe_model(args.model_dir, args.threads)
    np.savez(args.out, **result)
    if args.against is None:
        return 0
    with np.load(args.against) as ref:
        diffs = compare(dict(ref), result)
    for d in diffs:
        print(d)
    return 0 if all(d.ok for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main())
