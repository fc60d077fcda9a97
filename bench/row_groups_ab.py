"""The flow estimators' CFG rows side by side (``EngineConfig.split_rows``) against one call, in one process.

    python bench/row_groups_ab.py MODEL_DIR [--threads 2] [--runs 4] [--measure first,stream,four] [--backend auto]
    python bench/row_groups_ab.py MODEL_DIR --graph-alone [--runs 8]
    python bench/row_groups_ab.py MODEL_DIR --gate OFFICIAL_DIR [--runs 3]
    python bench/row_groups_ab.py MODEL_DIR --memory [--runs 2] [--backend auto]

Two engines on one model directory (``--backend``'s plan), one with each estimator call's two CFG rows run as two
calls at once on one intra-op thread each (``split``, the default: the stream estimator, and the whole-sentence
estimator where ONNX Runtime runs it, as CosyVoice-300M's does in every mode) and one running each call on both
threads (``one-call``), take turns on the bench workload (``bench/backend_ab.py``'s measures: ``first``, the
8-character sentence streamed, its first audio; ``stream``, the 10 s sentence streamed, first audio and RTF;
``e2e``, a whole sentence) plus ``four``: four streamed 10 s sentences at once on four threads sharing the engine
(wall seconds, as a server with four requests in flight). Prints the medians with each one's ratio to ``split``'s
(> 1: faster than ``split``) and every run.

``--graph-alone`` times CosyVoice2's stream estimator by itself at the chunk plan's shapes
(``bench/ov_stream_forms.py``'s, 150 prompt frames; float16 caches for the int8 recipes) with the engine's session
options: ``one-call``, ``split`` (the backend's :class:`~cosyvoice_cpu.backends.row_groups.RowGroupSession`), and one
call on a single thread, alternated call by call; ms per call (median of ``--runs``) and the largest difference of
``split``'s velocity from ``one-call``'s (int8 graphs: the activations' quantization scale is per call, so per row
group).

``--gate`` asks what the split does to quality: the export's streamed-mel gate of CosyVoice2 (three chunks on cached
activations, unbounded context, against the PyTorch reference of ``OFFICIAL_DIR``, the checkpoint ``MODEL_DIR`` was
exported from; :func:`~cosyvoice_cpu.export.flow.cosyvoice2.verify_flow`'s) on ``MODEL_DIR``'s graphs, split and as
one call, on ``--runs`` random inputs (seeds 0, 1, ...): the largest relative mel error of each. Needs torch.

``--memory`` asks what the split costs in memory, which one process holding both engines cannot tell: each form
loads alone in a process of its own (the forms alternating, ``--runs`` processes each), streams the 10 s sentence
twice, then speaks it whole four times (twice the bench's whole-sentence measure: a warm-up and a run); the
process's peak RSS (``VmHWM``) after load, after the streams and after the whole sentences, in MB (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from backend_ab import compare, report
from spinning_ab import four_at_once

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.benchmark.machine import peak_rss_mb
from cosyvoice_cpu.benchmark.tasks import TEXT, _config, listen, load, measure_e2e
from cosyvoice_cpu.hardware.cpu import detect
from cosyvoice_cpu.manifest import Manifest

FORMS = {"split": True, "one-call": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--measure", default="first,stream,four", help="comma-separated: first, stream, e2e, four")
    ap.add_argument("--backend", default="auto", help="the engines' plan (auto, onnxruntime, openvino)")
    ap.add_argument("--graph-alone", action="store_true", help="the stream estimator alone, no engine")
    ap.add_argument("--gate", type=Path, default=None, help="the streamed-mel gate against this reference checkpoint")
    ap.add_argument("--memory", action="store_true", help="each form's peak RSS, in processes of their own")
    ap.add_argument("--memory-form", choices=FORMS, help=argparse.SUPPRESS)  # one --memory process
    args = ap.parse_args()
    if args.threads != 2:
        ap.error("--threads: the rows split only with 2 threads (SessionConfig.row_groups)")
    if args.memory_form:
        memory_form(args.model_dir, args.threads, args.backend, args.memory_form)
        return
    cpu = detect().cpu
    print(
        f"{cpu.model if cpu else 'unknown CPU'} ({cpu.isa if cpu else '?'}), {args.threads} threads, {args.model_dir}"
    )
    if args.graph_alone:
        graph_alone(args.model_dir, args.threads, args.runs)
        return
    if args.gate is not None:
        gate(args.model_dir, args.gate, args.threads, args.runs)
        return
    if args.memory:
        memory(args.model_dir, args.threads, args.runs, args.backend)
        return
    names = args.measure.split(",")
    if unknown := set(names) - {"first", "stream", "e2e", "four"}:
        ap.error(f"--measure: unknown {sorted(unknown)}")
    rate = Manifest.load(args.model_dir).token_frame_rate
    tokens, short = round(10 * rate), round(2 * rate)
    engines = {
        label: load(args.model_dir, args.threads, backend=args.backend, split_rows=split)
        for label, split in FORMS.items()
    }
    four: dict[str, list[float]] = {label: [] for label in engines}
    if "four" in names:  # first: compare() closes the engines when it is done
        for engine, voice in engines.values():
            four_at_once(engine, voice, tokens, stream=True)  # warm-up: each stream shape's first call
        for _ in range(args.runs):
            for label, (engine, voice) in engines.items():
                four[label].append(four_at_once(engine, voice, tokens, stream=True))
    if measures := [n for n in names if n != "four"]:
        report(compare(engines, measures, args.runs, tokens, short), measures, {})
    else:
        for engine, _ in engines.values():
            engine.close()
    for label, runs in four.items() if "four" in names else ():
        med, base = statistics.median(runs), statistics.median(four["split"])
        print(f"{label:14s} four streamed at once {med:.2f} s ({base / med:.2f}x); runs: "
              + ", ".join(f"{r:.2f}" for r in runs))  # fmt: skip


def graph_alone(model_dir: Path, threads: int, runs: int) -> None:
    """The stream estimator as the engine opens it, one call / split rows / one thread, alternated call by call."""
    from ov_stream_forms import SHAPES, alternated_ms, feeds_for, half_caches

    path = model_dir / "flow_estimator_stream.onnx"
    base = SessionConfig(threads=threads, priority_order=True)
    forms: dict[str, Any] = {
        "one-call": open_graph(path, base),
        "split": open_graph(path, SessionConfig(threads=threads, priority_order=True, row_groups=2)),
        "one thread": open_graph(path, SessionConfig(threads=1, priority_order=True)),
    }
    half = half_caches(forms["one-call"], path, "--graph-alone")
    rng = np.random.default_rng(0)
    for n, c in SHAPES:
        feeds = feeds_for(n, c, 150, half, rng)
        out = {k: s.run(None, feeds)[0] for k, s in forms.items()}
        diff = float(np.abs(out["split"] - out["one-call"]).max() / np.abs(out["one-call"]).max())
        med = alternated_ms(forms, feeds, runs)
        print(f"{n:3d} new + {c:2d} context frames, ms per call (median of {runs}): "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f"; one-call / split {med['one-call'] / med['split']:.2f}x; split's velocity differs by {diff:.2e} "
              "of the largest")  # fmt: skip


def memory(model_dir: Path, threads: int, runs: int, backend: str) -> None:
    """Each form's peaks in processes of their own, alternated (``--memory``)."""
    peaks: dict[str, list[dict[str, float]]] = {label: [] for label in FORMS}
    for _ in range(runs):
        for label in FORMS:
            cmd = [sys.executable, __file__, str(model_dir), "--threads", str(threads), "--backend", backend]
            done = subprocess.run([*cmd, "--memory-form", label], capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"the {label} process failed ({done.returncode}):\n{done.stderr}")
            peaks[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for label, found in peaks.items():
        print(f"{label:9s} peak RSS, MB (median of {runs}): "
              + ", ".join(f"{k} {statistics.median(p[k] for p in found):.0f}" for k in found[0])
              + "; runs: " + "; ".join(" / ".join(f"{v:.0f}" for v in p.values()) for p in found))  # fmt: skip


def memory_form(model_dir: Path, threads: int, backend: str, label: str) -> None:
    """One form's engine alone in this process: its peaks as one JSON line."""
    engine, voice = load(model_dir, threads, backend=backend, split_rows=FORMS[label])
    tokens = round(10 * Manifest.load(model_dir).token_frame_rate)
    found = {"load": peak_rss_mb()}
    for _ in range(2):
        listen(engine, voice, TEXT, _config(tokens, stream=True))
    found["streams"] = peak_rss_mb()
    for _ in range(2):
        measure_e2e(engine, voice, tokens, 1)
    found["whole"] = peak_rss_mb()
    engine.close()
    print(json.dumps(found))


def gate(model_dir: Path, official: Path, threads: int, runs: int) -> None:
    """The streamed-mel gate's error, split and as one call, for ``runs`` seeds of random inputs."""
    import torch

    from cosyvoice_cpu.export.flow.cosyvoice2 import FILES, _gate_stream, _settings
    from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
    from cosyvoice_cpu.workshop.parts import load_reference

    flow = load_reference(official, ("flow",)).flow.eval()
    cfg = flow.config
    paths = [model_dir / FILES[k] for k in ("flow_encoder", "flow_estimator", "flow_estimator_stream", "flow_noise")]
    for seed in range(runs):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, cfg.vocab_size, (20,), generator=gen).numpy()
        tokens = torch.randint(0, cfg.vocab_size, (37 + cfg.pre_lookahead_len,), generator=gen).numpy()
        feat = (torch.randn(40, 80, generator=gen) * 0.5).numpy()
        emb = torch.randn(1, 192, generator=gen).numpy()
        errors = {}
        for label, split in FORMS.items():
            stage = CosyVoice2Flow(*paths, settings=_settings(flow), threads=threads)
            stage.split_rows = split
            with torch.inference_mode():
                errors[label] = _gate_stream(flow, stage, prompt, tokens, feat, emb, 1.0).value
        print(f"seed {seed}: streamed mel rel err " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
