"""ORT thread spinning on or off (``EngineConfig.spinning``), side by side in one process.

    python bench/spinning_ab.py MODEL_DIR [--threads 2] [--runs 3] [--lm-spin-us 100,1000]
    python bench/spinning_ab.py MODEL_DIR --graphs flow_estimator_stream[,hift_decode,...] [--runs 3]
    python bench/spinning_ab.py MODEL_DIR --graph-alone [--runs 8]

Two engines on one model directory, one with spinning pool threads and one without (the default), take turns
on the same workload as ``cosyvoice-cpu bench``: a whole 10 s sentence (RTF), the LM alone (decode ms per
token), the streamed 10 s sentence (first audio and streamed RTF) and four whole sentences on four threads at
once (wall seconds). Prints every run and the medians.

``--lm-spin-us`` replaces the all-sessions spinning engine with engines whose LM session alone spins, each for at
most the given microseconds before its pool thread sleeps (ORT's ``session.intra_op.spin_duration_us``).

``--graphs`` replaces it with two engines whose named graphs' sessions alone spin (ONNX Runtime graphs, by file
stem), one of them with ORT's ``session.force_spinning_stop`` (the pool stops spinning when a run returns, so it
spins between a call's operators only). Every graph runs on ONNX Runtime in all three. Each run also streams the
8-character sentence (its first audio; 30 tokens) and four streamed 10 s sentences at once instead of four whole
ones.

``--graph-alone`` times CosyVoice2's stream estimator by itself (its session as the engine opens it), no engine,
at the chunk plan's shapes (``bench/ov_stream_forms.py``'s, 150 prompt frames) with spinning off, on, and on with
the stop, the three sessions alternated call by call with a 30 ms pause before each call (a spinning pool of the
previous session would otherwise take the cores of the next one).

Every engine here runs the stream estimator as one call per step (``split_rows=False``, as when these
measurements were made): the split form's calls run on a one-thread session, which has no pool to spin.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.benchmark.tasks import (
    SHORT_TEXT,
    TEXT,
    _config,
    alternate,
    first_audio,
    load,
    measure_e2e,
    measure_lm,
)


def four_at_once(engine: Any, voice: Any, tokens: int, stream: bool = False) -> float:
    """Wall seconds for four sentences (whole, or streamed) synthesized on four threads sharing ``engine``."""

    def one() -> None:
        for _ in engine.synthesize(TEXT, voice, _config(tokens, stream=stream)):
            pass

    threads = [threading.Thread(target=one) for _ in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def lm_spinning(engine: Any, model_dir: Path, threads: int, spin_us: int) -> None:
    """Give ``engine`` an LM session whose pool thread spins for at most ``spin_us`` (the other options as
    ``sessions.make_session``'s defaults)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    for key, value in (
        ("session.intra_op.allow_spinning", "1"),
        ("session.inter_op.allow_spinning", "0"),
        ("session.intra_op.spin_duration_us", str(spin_us)),
        ("session.use_env_allocators", "1"),
    ):
        so.add_session_config_entry(key, value)
    engine.lm.session.session = ort.InferenceSession(str(model_dir / "lm.onnx"), so, providers=["CPUExecutionProvider"])


SHORT_TOKENS = 30  # the 8-character sentence's forced length here (``cosyvoice-cpu bench`` forces 50 for CosyVoice2)


@contextlib.contextmanager
def spinning_graphs(stems: set[str], stop: bool, spun: set[str] | None = None) -> Iterator[None]:
    """While open, ONNX Runtime sessions of graphs named ``<stem>.onnx`` are made spinning (and with ``stop``,
    ``session.force_spinning_stop``); the others as the engine sets them. The stems of the sessions it made
    spinning are added to ``spun``. Sessions are assumed to open one at a time (the engine opens them so on ORT):
    the stop is set by swapping ``onnxruntime.InferenceSession`` for the duration of one open."""
    import onnxruntime as ort

    from cosyvoice_cpu.backends import onnxruntime as backend

    make, real = backend.make_session, ort.InferenceSession

    def stopping(path: str, so: ort.SessionOptions, **kw: Any) -> ort.InferenceSession:
        so.add_session_config_entry("session.force_spinning_stop", "1")
        return real(path, so, **kw)

    def patched(path: str | Path, config: SessionConfig | None = None) -> ort.InferenceSession:
        if config is None or Path(path).stem not in stems:
            return make(path, config)
        ort.InferenceSession = stopping if stop else real
        try:
            session = make(path, dataclasses.replace(config, spinning=True))
        finally:
            ort.InferenceSession = real
        if spun is not None:
            spun.add(Path(path).stem)
        return session

    backend.make_session = patched
    try:
        yield
    finally:
        backend.make_session = make


def graph_engines(model_dir: Path, threads: int, stems: set[str]) -> dict[str, tuple[Any, Any]]:
    """The default engine (ONNX Runtime for every graph) and two whose ``stems`` graphs spin (without and with the
    stop at a run's end); each synthesizes a streamed sentence while its options are patched in (the stream graph
    opens at first use). Raises SystemExit when a named graph was not opened then (a typo, or a graph this
    workload opens later, which would not spin)."""
    engines = {}
    for label, spin, stop in (("spinning off", False, False), ("graphs spin", True, False), ("spin, stop", True, True)):
        spun: set[str] = set()
        with spinning_graphs(stems if spin else set(), stop, spun):
            # the stream graph as one call per step (the split rows' session is single-threaded: nothing spins)
            engine, voice = load(model_dir, threads, backend="onnxruntime", split_rows=False)
            for _ in engine.synthesize(SHORT_TEXT, voice, _config(SHORT_TOKENS, stream=True)):
                pass
        if spin and spun != stems:
            engine.close()
            raise SystemExit(f"--graphs: {sorted(stems - spun)} not opened by loading and one streamed sentence")
        engines[label] = (engine, voice)
    return engines


def graph_alone(model_dir: Path, threads: int, runs: int) -> None:
    """CosyVoice2's stream estimator alone as the engine opens it, spinning off / on / on with the stop,
    alternated call by call."""
    from ov_stream_forms import SHAPES, alternated_ms, feeds_for, half_caches

    from cosyvoice_cpu.backends import onnxruntime as backend

    path = model_dir / "flow_estimator_stream.onnx"
    config = SessionConfig(threads=threads, priority_order=True)  # the one-call stream session's options

    def session(spin: bool, stop: bool) -> Any:
        with spinning_graphs({path.stem} if spin else set(), stop):
            return backend.make_session(path, config)

    forms = {"off": session(False, False), "on": session(True, False), "on, stop": session(True, True)}
    half = half_caches(forms["off"], path, "--graph-alone")
    rng = np.random.default_rng(0)
    for n, c in SHAPES:
        feeds = feeds_for(n, c, 150, half, rng)
        for s in forms.values():
            s.run(None, feeds)
        med = alternated_ms(forms, feeds, runs)
        print(f"{n:3d} new + {c:2d} context frames, ms per call (median of {runs}): "
              + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--lm-spin-us", default=None, help="comma list of LM-only spin durations (microseconds)")
    ap.add_argument("--graphs", default=None, help="comma list of graph file stems whose sessions alone spin")
    ap.add_argument("--graph-alone", action="store_true", help="time the stream estimator alone (CosyVoice2)")
    args = ap.parse_args()
    n = args.tokens
    if args.graph_alone:
        graph_alone(args.model_dir, args.threads, args.runs)
        return
    if args.graphs:
        engines = graph_engines(args.model_dir, args.threads, {g.strip() for g in args.graphs.split(",")})
    else:
        engines = {"spinning off": load(args.model_dir, args.threads, split_rows=False)}
    if args.lm_spin_us is None and not args.graphs:
        engines["spinning on"] = load(args.model_dir, args.threads, spinning=True, split_rows=False)
    for us in [] if args.lm_spin_us is None else [int(x) for x in args.lm_spin_us.split(",")]:
        engines[f"LM {us} us"] = load(args.model_dir, args.threads, split_rows=False)
        lm_spinning(engines[f"LM {us} us"][0], args.model_dir, args.threads, us)

    def measure(engine: Any, voice: Any) -> dict[str, float]:
        row = {"e2e_rtf": measure_e2e(engine, voice, n, 1)["rtf"], **first_audio(engine, voice, TEXT, n, 1)}
        if args.graphs:
            row["first_audio_8_chars_s"] = first_audio(engine, voice, SHORT_TEXT, SHORT_TOKENS, 1)["first_audio_s"]
        row["lm_decode_ms"] = measure_lm(engine, voice, n, 1)["lm_decode_ms"]
        row["four_at_once_s"] = four_at_once(engine, voice, n, stream=bool(args.graphs))
        return row

    for label, rows in alternate(engines, args.runs, measure).items():
        for key in rows[0]:
            values = [r[key] for r in rows]
            print(f"{label:13s} {key:15s} median {statistics.median(values):8.3f}   runs "
                  + " ".join(f"{v:.3f}" for v in values))  # fmt: skip


if __name__ == "__main__":
    main()
