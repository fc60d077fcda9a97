"""``export --openvino bf16|int8``: an OpenVINO model (IR) of the whole-sentence flow estimator.

Written beside the ONNX graphs as ``flow_estimator.ov.xml`` + ``.ov.bin`` (manifest key ``flow_estimator_ov``),
for every family. What runs it is :mod:`cosyvoice_cpu.backends.openvino`, chosen per graph by
:mod:`cosyvoice_cpu.backends.plan`; whole-sentence calls are padded to shared shapes
(:mod:`cosyvoice_cpu.backends.buckets`).

- The graph is the estimator in its plain form (attention as MatMul/Softmax, not ONNX Runtime's fused
  ``com.microsoft`` ops, which OpenVINO expands into a graph that takes far more memory to compile: measured in
  docs/benchmarks-log.md, "2026-12-03: the CosyVoice2 flow estimator on OpenVINO"), exported with the official
  contract (x, mask, mu, t, spks, cond -> estimator_out) and converted by OpenVINO. Fun-CosyVoice3's DiT takes
  the step's time table (``modulation``) in t's place, so its AdaLN weights (42 % of the DiT's) stay out of the
  compiled model (``export.flow.cosyvoice3.TableEstimatorGraphV3``; the runtime computes the table once per
  schedule). Weights are stored in float16 (half the file); the CPU plugin computes in bf16 or f32 by the CPU
  (:mod:`cosyvoice_cpu.backends.openvino_precision`).
- ``int8``: NNCF post-training quantization (int8 weights and activations, the rest in float), calibrated on the flow's
  own inputs: the estimator feeds of whole flow runs on the plain form in fp32 (:func:`plain_stage`), x_t along
  the Euler path at every step, real-length masks and a voice prompt whose mel is the flow's own output
  (:func:`flow_samples`).
- The gate (:func:`gate_openvino`) runs on held-out sentences: the estimator output against the plain form in
  fp32, the whole flow's mel against the fp32 ONNX flow (mean absolute log-mel difference, the measure
  ``docs/quantization.md`` bounds by 0.02 for every shipped variant), and whether a call padded to its bucket
  equals the unpadded one (recorded as the ``pad_exact`` attr, measured in fp32 on the plain graph; False makes
  the runtime never pad). The CosyVoice-300M UNet's GroupNorm pools over padded frames in the official graph; its
  OpenVINO form takes the statistics over the real frames only (``export.flow.cosyvoice.MaskedBlock1D``: the same
  function unpadded), so it pads like the others.

NNCF and OpenVINO are imported only here, at export time (``pip install 'cosyvoice-cpu[openvino-export]'``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.base import ONNXRUNTIME, GraphSession, SessionConfig, WrappedSession
from cosyvoice_cpu.backends.buckets import BucketedSession, bucket
from cosyvoice_cpu.backends.openvino import OpenVino, import_openvino
from cosyvoice_cpu.errors import ExportError, MissingExtraError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, TensorSpec, gate, torch_export
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.flow.cosyvoice2 import FILES
from cosyvoice_cpu.flow.graphs import ESTIMATOR_PADDING, ShapedGraph

logger = logging.getLogger(__name__)

VARIANTS = ("none", "bf16", "int8")
KEY = "flow_estimator_ov"
# Gate bounds per variant. mel_l1 is the bound docs/quantization.md holds every shipped variant to. estimator:
# max rel. error of one call against fp32 ONNX, a few times what the random-weight fixtures measured
# (docs/quantization.md, "OpenVINO flow estimator").
TOLERANCE = {"bf16": {"estimator": 0.05, "mel_l1": 0.02}, "int8": {"estimator": 0.25, "mel_l1": 0.02}}
PAD_EXACT = 1e-4  # max rel. difference of a bucket-padded fp32 call from the unpadded one for pad_exact = True
PROMPT_SECONDS = 3.0  # the voice prompt of every calibration and gate sentence
# Calibration: 2, 6 and 10 s of speech (CosyVoice2 tokens) after prompts of a low voice, a high voice and the
# flow's own output; the gate: other lengths and voices
CALIBRATION_TOKENS, CALIBRATION_F0 = (50, 150, 250), (110.0, 220.0, None)
HELD_OUT_TOKENS, HELD_OUT_F0 = (90, 200), (165.0, None)

Step = Callable[[str], None]


def check_extra(variant: str) -> None:
    """``openvino`` (and ``nncf`` for int8) importable, else MissingExtraError with the pip command."""
    import importlib.util

    need = ["openvino"] + (["nncf"] if variant == "int8" else [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"export --openvino {variant} needs {', '.join(missing)}: pip install 'cosyvoice-cpu[openvino-export]'"
        )


def export_plain_estimator(estimator_graph: Any, path: Path) -> None:
    """Trace ``estimator_graph`` (a family's ``EstimatorGraph*`` around the reference estimator, outside
    ``export_forms``: plain attention) to ONNX under the official contract, batch and time dynamic. A graph whose
    ``time_input`` is not ``t`` (Fun-CosyVoice3's DiT takes its time table, ``modulation``) takes that input in
    t's place, as its ``time_feed(t)`` makes it, with no dynamic axis (the rows of a call share t)."""
    import torch

    from cosyvoice_cpu.export.flow.common import estimator_inputs

    feeds = {k: torch.from_numpy(v) for k, v in estimator_inputs(np.random.default_rng(0), [71, 60], 71).items()}
    time_input = getattr(estimator_graph, "time_input", "t")
    axes: dict[str, dict[int, str]] = {n: {0: "batch", 2: "time"} for n in ("x", "mask", "mu", "cond")}
    axes.update(spks={0: "batch"}, estimator_out={0: "batch", 2: "time"})
    if time_input == "t":
        axes["t"] = {0: "batch"}
    names = [time_input if n == "t" else n for n in feeds]
    with torch.inference_mode():
        if time_input != "t":
            feeds["t"] = estimator_graph.time_feed(feeds["t"])
        args = tuple(feeds.values())
        torch_export(estimator_graph, args, path, input_names=names, output_names=["estimator_out"], dynamic_axes=axes)


class _Recorder(WrappedSession):
    """A session wrapper that keeps a copy of every feed dict it is run with (the calibration samples)."""

    def __init__(self, session: GraphSession) -> None:
        super().__init__(session)
        self.feeds: list[dict[str, np.ndarray]] = []

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray], release_memory: bool = False
    ) -> list[np.ndarray]:
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self.wrapped.run(output_names, feeds, release_memory)


def flow_stage(
    out: Path, family: str, attrs: dict[str, Any], threads: int = 0, whole: ShapedGraph | None = None
) -> Any:
    """The family's runtime flow stage on the graphs in ``out``, whole sentences on ``flow_estimator.onnx``
    (or ``whole``), no stream graph."""
    from cosyvoice_cpu.families.registry import CLASSES

    stage_cls = CLASSES[family].flow_stage
    return stage_cls.from_dir(out, attrs, threads=SessionConfig(threads=threads), streaming=False, whole=whole)


def plain_stage(out: Path, family: str, attrs: dict[str, Any], plain: Path) -> Any:
    """The family's runtime flow stage with whole sentences on ``plain`` (the fp32 ONNX form of the function the
    OpenVINO model is converted from) on ONNX Runtime, unpadded: its estimator is fed exactly what the OpenVINO
    model will be (Fun-CosyVoice3's takes the time table where the official graph takes t)."""
    return flow_stage(out, family, attrs, whole=ShapedGraph(plain, ONNXRUNTIME, pad=False))


def voiced_prompt(sample_rate: int, f0: float, seconds: float = PROMPT_SECONDS, seed: int = 0) -> np.ndarray:
    """A voiced-like prompt recording at ``sample_rate``: digital silence, then a harmonic series on ``f0`` with
    vibrato, syllable-rate amplitude and a little breath noise, then silence again. Its log-mel spans what real
    prompts put in the estimator's cond rows: the floor of silence (log 1e-5 = -11.5) up to loud voiced bins.
    Random normal values or a random-weight model's own output span neither, and a static int8 model calibrated
    on them clips a real prompt's cond (measured: docs/quantization.md, "OpenVINO flow estimator")."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = f0 * (1 + 0.06 * np.sin(2 * np.pi * 4.5 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.abs(np.sin(np.pi * 2.5 * t))
    wave = 0.15 * voiced * envelope + 0.01 * rng.standard_normal(t.shape)
    wave[(t < 0.3) | (t > seconds - 0.3)] = 0.0
    return wave.astype(np.float32)


def _prompt(
    stage: Any, f: Any, mel_cfg: dict[str, Any] | None, f0: float | None, emb: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, prompt mel (1, frames, 80)) of a 3 s voice: the log-mel of :func:`voiced_prompt` at
    ``f0``, or (``f0`` None, or no mel parameters) the flow's own output for the prompt's tokens."""
    from cosyvoice_cpu.audio import matcha_mel

    tokens = rng.integers(0, f.speech_vocab, round(PROMPT_SECONDS * f.token_rate))
    frames = round(PROMPT_SECONDS * f.sample_rate / f.mel_hop)
    if f0 is not None and mel_cfg:
        wave = voiced_prompt(int(mel_cfg["sampling_rate"]), f0, seed=int(rng.integers(1 << 30)))
        mel = matcha_mel(
            wave,
            n_fft=mel_cfg["n_fft"],
            num_mels=mel_cfg["num_mels"],
            sampling_rate=mel_cfg["sampling_rate"],
            hop_size=mel_cfg["hop_size"],
            win_size=mel_cfg["win_size"],
            fmin=mel_cfg["fmin"],
            fmax=mel_cfg["fmax"],
        )
        return tokens, np.ascontiguousarray(mel[None, :frames])
    none = {"prompt_tokens": np.zeros(0, np.int64), "prompt_feat": np.zeros((1, 0, 80), np.float32)}
    mel = stage.inference(tokens, embedding=emb, rng=np.random.default_rng(0), **none)[:, :, :frames]
    return tokens, np.ascontiguousarray(mel.transpose(0, 2, 1))


def _sentences(
    stage: Any,
    family: str,
    lengths: tuple[int, ...],
    seed: int,
    mel_cfg: dict[str, Any] | None,
    f0s: tuple[float | None, ...],
) -> list[dict[str, Any]]:
    """Inference arguments for sentences of ``lengths`` tokens (random speech tokens), sentence ``i`` after a 3 s
    voice prompt made by :func:`_prompt` with ``f0s[i % len(f0s)]`` and its own x-vector."""
    f = facts(family)
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        emb = rng.standard_normal(192).astype(np.float32)
        prompt, feat = _prompt(stage, f, mel_cfg, f0s[i % len(f0s)], emb, rng)
        out.append(
            {
                "tokens": rng.integers(0, f.speech_vocab, n),
                "prompt_tokens": prompt,
                "prompt_feat": feat,
                "embedding": emb,
            }
        )
    return out


def flow_samples(
    stage: Any,
    family: str,
    mel_cfg: dict[str, Any] | None,
    lengths: tuple[int, ...] = CALIBRATION_TOKENS,
    f0s: tuple[float | None, ...] = CALIBRATION_F0,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """The estimator feeds of whole flow runs (every Euler step, guidance rows included) of sentences of
    ``lengths`` tokens on ``stage`` (prompts as :func:`_sentences`): the calibration set of the int8 model."""
    sentences = _sentences(stage, family, lengths, seed, mel_cfg, f0s)
    recorder = _Recorder(stage.estimator)
    stage._sessions["whole"] = recorder
    try:
        for i, args in enumerate(sentences):
            stage.inference(**args, rng=np.random.default_rng(seed + i))
    finally:
        stage._sessions["whole"] = recorder.wrapped
    return recorder.feeds


def input_layers(model: Any, inputs: tuple[str, ...] = ("x", "mu", "cond")) -> list[str]:
    """Names of the first Convolution/MatMul nodes reached from these inputs of an OpenVINO model: the layers
    that see the prompt mel (cond) as it is, whose int8 activation scale a prompt outside the calibrated range
    would clip. Only data paths count: a ``ShapeOf`` ends the walk (the Fun-CosyVoice3 DiT reshapes every
    attention output to a shape read from ``x``, and following that reached all 22 ``to_out`` layers)."""
    found, seen = set(), set()
    frontier = [p for p in model.get_parameters() if p.get_friendly_name() in inputs]
    while frontier:
        node = frontier.pop()
        for out in node.outputs():
            for target in out.get_target_inputs():
                nxt = target.get_node()
                if nxt.get_friendly_name() in seen:
                    continue
                seen.add(nxt.get_friendly_name())
                if nxt.get_type_name() in ("Convolution", "MatMul"):
                    found.add(nxt.get_friendly_name())
                elif nxt.get_type_name() != "ShapeOf":
                    frontier.append(nxt)
    return sorted(found)


def quantize_int8(model: Any, samples: list[dict[str, np.ndarray]]) -> Any:
    """NNCF post-training int8 quantization of an OpenVINO model, calibrated on ``samples`` (estimator feeds).

    Of the options measured on the tiny CosyVoice2 model (the transformer and mixed presets, SmoothQuant alpha,
    ignored layers; docs/quantization.md, "OpenVINO flow estimator"), the transformer preset with the input
    layers (:func:`input_layers`) left in bf16 gave the lowest mel error: that is the one used.
    """
    import nncf

    return nncf.quantize(
        model,
        nncf.Dataset(samples),
        subset_size=len(samples),
        model_type=nncf.ModelType.TRANSFORMER,
        ignored_scope=nncf.IgnoredScope(names=input_layers(model), validate=False),
    )


def gate_openvino(
    out: Path, family: str, attrs: dict[str, Any], variant: str, seed: int, plain: Path
) -> tuple[list[GateResult], bool]:
    """Check the OpenVINO model in ``out`` on held-out sentences (the module docstring); returns the gate results
    and ``pad_exact``. ``plain``: the fp32 ONNX form of the function the OpenVINO model was converted from."""

    tol = TOLERANCE[variant]
    ref = flow_stage(out, family, attrs)
    mel_cfg = attrs.get("mel")
    steps = len(ref.schedule(ref.settings.n_timesteps))
    on_plain = plain_stage(out, family, attrs, plain)
    feeds = flow_samples(on_plain, family, mel_cfg, HELD_OUT_TOKENS[:1], HELD_OUT_F0[:1], seed + 200)[steps // 2]
    # pad_exact is the model's property (how it treats masked frames), so it is measured in fp32 (ONNX Runtime)
    # on the plain form, not in bf16, where a padded shape's other blocking alone moves the output by more than
    # PAD_EXACT
    fp32 = on_plain.estimator
    short = feeds  # a length that pads (not a bucket's own size)
    if bucket(int(feeds["x"].shape[2])) == feeds["x"].shape[2]:
        short = {k: (v[:, :, :-8] if v.ndim == 3 else v) for k, v in feeds.items()}
    alone = fp32.run(None, short)[0]
    padded = BucketedSession(fp32, ESTIMATOR_PADDING).run(None, short)[0]
    worst_pad = float(np.abs(padded - alone).max() / max(np.abs(alone).max(), 1e-12))
    pad_exact = worst_pad <= PAD_EXACT
    logger.info(
        "%s: a call padded to its bucket differs from the unpadded one by %.2e (pad_exact %s)",
        KEY,
        worst_pad,
        pad_exact,
    )
    # the OpenVINO flow as the runtime will run it: padded to its buckets where pad_exact
    ov_stage = flow_stage(out, family, attrs, whole=ShapedGraph(out / FILES[KEY], "openvino", pad=pad_exact))
    results = []
    for i, args in enumerate(_sentences(ref, family, HELD_OUT_TOKENS, seed + 100, mel_cfg, HELD_OUT_F0)):
        mel_ref = ref.inference(**args, rng=np.random.default_rng(seed + i))
        mel_ov = ov_stage.inference(**args, rng=np.random.default_rng(seed + i))
        l1 = float(np.abs(mel_ov - mel_ref).mean())
        voice = "the flow's own mel" if HELD_OUT_F0[i % len(HELD_OUT_F0)] is None else "a voiced prompt"
        results.append(GateResult(KEY, f"mel_l1 ({len(args['tokens'])} tokens after {voice})", l1, tol["mel_l1"]))
    want = fp32.run(None, feeds)[0]
    got = ov_stage.estimator.run(None, feeds)[0]
    results.append(gate(KEY, "estimator (one call, mid-path)", got, want, tol["estimator"]))
    for r in results:
        r.phase = f"openvino {variant}" + (", padded to buckets" if pad_exact else "")
        logger.info("%s", r)
    return results, pad_exact


def export_openvino(
    estimator_graph: Any,
    out: Path,
    work: Path,
    family: str,
    settings: dict[str, Any],
    attrs: dict[str, Any],
    variant: str,
    seed: int,
    step: Step,
    verify: bool = True,
) -> tuple[GraphArtifact, list[GateResult]]:
    """Write ``flow_estimator.ov.xml/.bin`` of ``variant`` into ``out`` (``out`` already holds the family's fp32
    ONNX flow graphs; ``settings`` are the flow stage's facts, ``attrs`` the ONNX estimator's); return its
    artifact and gate results (none when ``verify`` is False: then ``pad_exact`` is False, so the runtime never
    pads an unchecked graph)."""
    check_extra(variant)
    ov = import_openvino()  # before NNCF imports it: no import-time telemetry fork (import_openvino)
    t0 = time.perf_counter()
    plain = work / "flow_estimator_plain.onnx"
    step(f"flow: OpenVINO {variant} model (plain-attention estimator)")
    export_plain_estimator(estimator_graph, plain)
    model = ov.convert_model(str(plain))
    if variant == "int8":
        step("flow: calibrating the OpenVINO int8 model on the flow's own inputs")
        samples = flow_samples(plain_stage(out, family, settings, plain), family, settings.get("mel"), seed=seed)
        model = quantize_int8(model, samples)
    ov.save_model(model, str(out / FILES[KEY]), compress_to_fp16=True)
    del model
    gates, pad_exact = [], False
    if verify:
        step(f"flow: numerics gate (OpenVINO {variant} vs the fp32 ONNX flow)")
        gates, pad_exact = gate_openvino(out, family, settings, variant, seed, plain)
        failed = [g for g in gates if not g.passed]
        if failed:
            raise ExportError(
                f"the OpenVINO {variant} estimator failed its gate: {'; '.join(map(str, failed))}; "
                "export without --openvino or try --openvino bf16"
            )
    for p in work.glob("flow_estimator_plain.onnx*"):
        p.unlink()
    logger.info("OpenVINO %s estimator written in %.1f s", variant, time.perf_counter() - t0)
    xml = FILES[KEY]
    bin_name = xml[: -len(".xml")] + ".bin"
    inputs, outputs = io_specs_ov(out / xml)
    art = GraphArtifact(
        KEY,
        xml,
        [bin_name],
        variant,
        inputs,
        outputs,
        {
            **attrs,
            "backend": "openvino",
            "form_of": "flow_estimator",
            "pad_exact": pad_exact,
            "weights": "float16",
            "attention": "full",
        },
    )
    return art, gates


def io_specs_ov(path: Path) -> tuple[list[Any], list[Any]]:
    """An IR's inputs and outputs as :class:`~cosyvoice_cpu.export.common.TensorSpec` (dynamic axes named), read
    the way the runtime reads them (the OpenVINO backend's session; nothing is compiled)."""
    import onnx

    session = OpenVino(cache_dir="").open(path, SessionConfig())

    def spec(node: Any) -> TensorSpec:  # "tensor(float)" -> the numpy dtype name "float32", as io_specs writes
        elem = onnx.TensorProto.DataType.Value(node.type[len("tensor(") : -1].upper())
        return TensorSpec(node.name, onnx.helper.tensor_dtype_to_np_dtype(elem).name, list(node.shape))

    return [spec(n) for n in session.get_inputs()], [spec(n) for n in session.get_outputs()]
