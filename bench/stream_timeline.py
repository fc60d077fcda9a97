"""Where a streamed sentence's time goes: every graph call with its thread, and how much of the machine was busy.

    python bench/stream_timeline.py MODEL_DIR [--threads 2] [--backend auto] [--runs 3] [--mode stream|whole]
        [--short] [--lm-threads N] [--no-split-rows] [--json OUT]

Same workload as ``cosyvoice-cpu bench`` (the registered 3 s voice, the bench's sentence forced to ``--tokens`` speech
tokens: 250 = 10 s at 25 Hz; the voice's prompt cache warm after a warm-up run). Every call of every graph (ONNX Runtime
sessions and IO bindings, OpenVINO compiled models and stateful requests) is recorded with the Python thread that made
it: the caller (the flow and the vocoder of ``engine.synthesize``), ``lm-scheduler`` (the LM decoding ahead) and
``cosyvoice-rows`` (the second guidance row of a split flow-estimator call). Per run it prints the wall time, when each
chunk came, the process's CPU time (every thread; divided by the wall time: the cores kept busy, at most the usable
cores) and per graph and thread the seconds inside calls. "caller outside graphs" is the caller's wall time in no graph
call (its own, or a guidance-row thread's, which it waits for): waiting for the LM's tokens, plus NumPy glue.

Streamed, each run also says where its **first audio** went: per graph and thread the seconds of the calls before the
first chunk came, and the LM's calls one by one (its prefill pieces, then a step per token). ``--short`` speaks the
bench's 8-character sentence (2 s, 50 tokens: the bench's "first audio, 8 characters") instead of the 10 s one.

``--lm-threads N`` compiles the stateful OpenVINO LM with N threads instead of the engine's ``--threads`` (a probe of
the LM's share of a saturated machine; no engine option does this; an LM on ONNX Runtime is left as it is). ``--mode
whole`` synthesizes the sentence in one piece instead (each stage alone on the machine). Timing is what the bench's wall
clocks measure; the recording adds two clock reads per call.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from cosyvoice_cpu.backends import onnxruntime as ort_backend
from cosyvoice_cpu.backends import openvino as ov_backend
from cosyvoice_cpu.benchmark.tasks import SHORT_TEXT, TEXT, _config, load
from cosyvoice_cpu.cli.common import add_split_rows_arg

Call = tuple[str, str, float, float]  # graph, thread role, start, end (seconds from the synthesis call)


class Recorder:
    """Wraps the backends' run methods (class attributes) so every graph call lands in :attr:`calls`."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.t0 = time.perf_counter()
        self._originals: list[tuple[Any, str, Any]] = []

    def start(self) -> None:
        self.calls, self.t0 = [], time.perf_counter()

    def restore(self) -> None:
        """Put every wrapped attribute back."""
        for owner, attr, original in reversed(self._originals):
            setattr(owner, attr, original)
        self._originals.clear()

    def replace(self, owner: Any, attr: str, value: Any) -> None:
        self._originals.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def wrap(self, cls: type, method: str, name: Any) -> None:
        original = getattr(cls, method)

        def timed(obj: object, *args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                end = time.perf_counter()
                self.calls.append((name(obj), role(threading.current_thread().name), start - self.t0, end - self.t0))

        self.replace(cls, method, timed)


def role(thread: str) -> str:
    """The thread's part: the caller, the LM scheduler, a guidance-row thread, or its own name."""
    if thread == "MainThread":
        return "caller"
    return next((r for r in ("lm-scheduler", "cosyvoice-rows") if thread.startswith(r)), thread)


def instrument(lm_threads: int = 0) -> Recorder:
    """Every backend's graph calls recorded (and the stateful OpenVINO LM on ``lm_threads``, 0: as configured) until
    the recorder's :meth:`Recorder.restore`."""
    rec = Recorder()
    rec.wrap(ort_backend.OrtSession, "run", lambda s: s.name)
    rec.wrap(ort_backend.OrtBoundRun, "run", lambda s: s.name)
    rec.wrap(ov_backend.OpenVinoSession, "run", lambda s: s.name)
    rec.wrap(ov_backend.OpenVinoState, "run", lambda s: s.name)
    if lm_threads:
        properties = ov_backend.stateful_lm_properties
        rec.replace(
            ov_backend, "stateful_lm_properties", lambda m: {**properties(m), "INFERENCE_NUM_THREADS": lm_threads}
        )
    return rec


def outside(calls: list[Call], threads: set[str], wall: float) -> float:
    """Wall seconds in which none of ``threads`` was in a graph call."""
    inside, last = 0.0, 0.0
    for _, _, a, b in sorted((c for c in calls if c[1] in threads), key=lambda c: c[2]):
        inside += max(0.0, b - max(a, last))
        last = max(last, b)
    return wall - inside


def before(calls: list[Call], until: float) -> tuple[dict[str, dict[str, float]], list[float]]:
    """The calls that started before ``until`` (the first chunk's arrival): seconds (clipped at ``until``) and calls
    per graph and thread, in order of their first call; and the LM scheduler's calls in ms, one by one."""
    spent: dict[str, dict[str, float]] = {}
    lm: list[float] = []
    for graph, thread, a, b in sorted(calls, key=lambda c: c[2]):
        if a >= until:
            break
        entry = spent.setdefault(f"{graph} @ {thread}", {"s": 0.0, "calls": 0})
        entry["s"] += min(b, until) - a
        entry["calls"] += 1
        if thread == "lm-scheduler":
            lm.append(round((b - a) * 1000, 1))
    return spent, lm


def one_run(engine: Any, voice: Any, rec: Recorder, stream: bool, tokens: int, text: str = TEXT) -> dict[str, Any]:
    """One synthesis of ``text`` forced to ``tokens`` (streamed or whole): wall and CPU seconds, the chunks' arrival,
    seconds and calls per graph and thread, the caller's time outside graphs, where the first chunk's time went."""
    rec.start()
    cpu0 = time.process_time()
    chunks, first = [], None
    for chunk in engine.synthesize(text, voice, _config(tokens, stream=stream)):
        now = time.perf_counter() - rec.t0
        chunks.append((round(now, 3), round(chunk.duration, 3)))
        first = now if first is None and chunk.duration > 0 else first
    wall, cpu = time.perf_counter() - rec.t0, time.process_time() - cpu0
    busy: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for graph, thread, a, b in rec.calls:
        busy[f"{graph} @ {thread}"] += b - a
        count[f"{graph} @ {thread}"] += 1
    first = wall if first is None else first
    spent, lm_ms = before(rec.calls, first)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "cores_busy": cpu / wall,
        "audio_s": sum(d for _, d in chunks),
        "chunks": chunks,
        "graphs": {k: {"s": busy[k], "calls": count[k]} for k in sorted(busy, key=lambda k: -busy[k])},
        # a guidance-row thread lives inside one of the caller's calls, which waits for it
        "caller_outside_graphs_s": outside(rec.calls, {"caller", "cosyvoice-rows"}, wall),
        "first_audio_s": first,
        "before_first_audio": spent,
        "lm_calls_before_first_audio_ms": lm_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=0, help="speech tokens (default 250, --short 50)")
    ap.add_argument("--mode", choices=["stream", "whole"], default="stream")
    ap.add_argument("--short", action="store_true", help="the 8-character sentence (50 tokens unless --tokens)")
    ap.add_argument("--lm-threads", type=int, default=0, help="the stateful OpenVINO LM's threads (0: --threads)")
    add_split_rows_arg(ap)
    ap.add_argument("--json", type=Path, help="also write every run as JSON here")
    args = ap.parse_args()
    text, tokens = (SHORT_TEXT, args.tokens or 50) if args.short else (TEXT, args.tokens or 250)
    rec = instrument(args.lm_threads)
    try:
        engine, voice = load(args.model_dir, args.threads, backend=args.backend, split_rows=args.split_rows)
        stream = args.mode == "stream"
        one_run(engine, voice, rec, stream, tokens, text)  # warm-up: the voice's prompt cache, first-call costs
        runs = [one_run(engine, voice, rec, stream, tokens, text) for _ in range(args.runs)]
        engine.close()
    finally:
        rec.restore()
    lm = f", a stateful OpenVINO LM on {args.lm_threads} threads" if args.lm_threads else ""
    said = f"{text!r}, {tokens} tokens"
    print(f"{args.model_dir.name}: {said}, {args.mode}, {args.threads} threads, --backend {args.backend}{lm}")
    for i, r in enumerate(runs):
        print(
            f"run {i}: wall {r['wall_s']:.2f} s for {r['audio_s']:.2f} s of audio "
            f"(RTF {r['wall_s'] / r['audio_s']:.3f}), CPU {r['cpu_s']:.2f} s = {r['cores_busy']:.2f} cores busy; "
            "caller outside graphs "
            f"{r['caller_outside_graphs_s']:.2f} s; chunks at (s, audio s): {r['chunks']}"
        )
        for key, g in r["graphs"].items():
            print(f"    {key:45s} {g['s']:7.2f} s {g['calls']:5d} calls")
        if stream:
            print(f"  first audio at {r['first_audio_s']:.3f} s; the calls before it:")
            for key, g in r["before_first_audio"].items():
                print(f"    {key:45s} {g['s']:7.3f} s {g['calls']:5d} calls")
            print(f"    the LM's calls, ms: {r['lm_calls_before_first_audio_ms']}")
    walls = [r["wall_s"] / r["audio_s"] for r in runs]
    cores = [r["cores_busy"] for r in runs]
    first = f", median first audio {statistics.median(r['first_audio_s'] for r in runs):.3f} s" if stream else ""
    print(f"median RTF {statistics.median(walls):.3f}, median cores busy {statistics.median(cores):.2f}{first}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
