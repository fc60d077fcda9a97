"""``cosyvoice-cpu bench``: our engine and its PyTorch peers on the same workload, in one run.

    cosyvoice-cpu bench --recipe int8w                 # full-size random CosyVoice2, exported once and cached
    cosyvoice-cpu bench -m MODEL_DIR [--peer-from OFFICIAL_DIR]
    cosyvoice-cpu bench --recipe int8w --concurrency 1,4,8 --thread-sweep --peer official,reference --out DIR
    cosyvoice-cpu bench -m MODEL_DIR --text-stream only [--text-rate 20]   # a reply written by a simulated LLM

Every measurement runs in a child process (:mod:`cosyvoice_cpu.benchmark.tasks`, ``bench/peer.py``) so each peak RSS is
its own. Writes ``bench.json``, ``bench.md`` and PNG plots into ``--out``; the report is
:mod:`cosyvoice_cpu.benchmark.report`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

from cosyvoice_cpu.backends.plan import CHOICES, may_use_openvino
from cosyvoice_cpu.benchmark.machine import energy_counters
from cosyvoice_cpu.benchmark.report import write_report
from cosyvoice_cpu.cli.common import add_split_rows_arg, need_export_extra
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import FAMILIES, facts
from cosyvoice_cpu.hardware.cpu import detect
from cosyvoice_cpu.jsontypes import JsonObject, JsonValue
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.paths import cache_dir
from cosyvoice_cpu.probes.calibrate import calibrate

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]  # a source checkout: bench/peer.py lives there


QUIET_FORKS = {"TOKENIZERS_PARALLELISM": "false"}


def quiet_forks(environ: MutableMapping[str, str] = os.environ) -> MutableMapping[str, str]:
    """Settle what the HF ``tokenizers`` library would otherwise warn about at every fork ("The current process
    just got forked, after parallelism has already been used. Disabling parallelism to avoid deadlocks..."): its
    parallelism is off in ``environ`` unless the user chose (``TOKENIZERS_PARALLELISM`` set either way). The
    bench's processes tokenize one sentence at a time, so the thread pool buys nothing; the children inherit it.
    Returns ``environ``."""
    for name, value in QUIET_FORKS.items():
        environ.setdefault(name, value)
    return environ


def _child(cmd: list[str], what: str) -> JsonObject:
    """Run a benchmark child (with :func:`quiet_forks`' environment); its last stdout line is JSON."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=quiet_forks(dict(os.environ)))
    if p.returncode:
        raise ConfigError(f"{what} failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:] or p.stdout}")
    text = p.stdout.strip()
    try:
        result = json.loads(text)  # the whole output (a pretty-printed object) ...
    except json.JSONDecodeError:
        result = json.loads(text.splitlines()[-1])  # ... or a last line of JSON after other output
    print(f"  {what}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return result


def _task(model_dir: Path, task: str, threads: int, args: argparse.Namespace, **extra: JsonValue) -> JsonObject:
    extra.setdefault("backend", args.backends[0])
    flags = [] if args.split_rows else ["--no-split-rows"]
    cmd = [
        sys.executable,
        "-m",
        "cosyvoice_cpu.benchmark",
        str(model_dir),
        "--task",
        task,
        "--threads",
        str(threads),
        "--tokens",
        str(args.tokens),
        "--runs",
        str(args.runs),
        *flags,
    ]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return _child(cmd, f"{task} {threads} threads {extra or ''}".strip())


def cached_export_is_fresh(dst: Path, recipe: str) -> bool:
    """Whether ``dst`` is a loadable export with ``recipe``'s stages, written by the current graph-building code
    (a cache from before a recipe or exporter change must be exported again, not benchmarked as current)."""
    from cosyvoice_cpu.export.quantize import parse_recipe
    from cosyvoice_cpu.workshop.exporter import export_code_digest

    try:
        cached = Manifest.load(dst)
    except Exception:
        return False
    return cached.recipe.get("stages") == parse_recipe(recipe).stages() and cached.created_by.endswith(
        f"(export code {export_code_digest()})"
    )


def resolve_model(args: argparse.Namespace) -> tuple[Path, Path | None, str]:
    """(model dir, official dir for the peers or None, description)."""
    if args.model is not None:
        return args.model, args.peer_from, str(args.model)
    need_export_extra()
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    family = args.family
    src = cache_dir() / "fixtures" / f"{family}-full-seed0"
    if not (src / f"{family}.yaml").is_file():
        print(f"writing the full-size random {family} fixture (once) ...", file=sys.stderr)
        write_fixture(FixtureSpec(family, "full", 0), src, force=True)
    ov = "int8" if may_use_openvino(args.backends) else "none"
    dst = cache_dir() / "exports" / f"{family}-full-seed0-{args.recipe}{'-ov' + ov if ov != 'none' else ''}"
    if not cached_export_is_fresh(dst, args.recipe):
        print(f"exporting the fixture with recipe {args.recipe} (once; cached in {dst}) ...", file=sys.stderr)
        export_model(src, dst, ExportOptions(recipe=args.recipe, force=True, openvino=ov))
    return dst, args.peer_from or src, f"full-size random {facts(family).title}, recipe {args.recipe}"


def run_peers(official_dir: Path | None, names: list[str], threads: int, tokens: int) -> JsonObject:
    """``bench/peer.py`` per implementation (PyTorch; needs a source checkout and the [export] extra)."""
    script = ROOT / "bench" / "peer.py"
    if not names:
        return {}
    if official_dir is None or not script.is_file():
        why = "no official-layout model directory (--peer-from)" if official_dir is None else f"{script} is missing"
        print(f"  peers skipped: {why}", file=sys.stderr)
        return {n: {"skipped": why} for n in names}
    peers: JsonObject = {}
    for n in names:
        try:
            peers[n] = _child(
                [
                    sys.executable,
                    str(script),
                    "--model-dir",
                    str(official_dir),
                    "--impl",
                    n,
                    "--threads",
                    str(threads),
                    "--tokens",
                    str(tokens),
                ],
                f"peer {n}",
            )
        except (ConfigError, ValueError) as e:  # a peer that cannot run is reported, not fatal
            print(f"  peer {n} failed: {e}", file=sys.stderr)
            peers[n] = {"skipped": f"failed: {e}"}
    return peers


def machine_facts(threads: int) -> JsonObject:
    """CPU, cores, memory, versions, the load average and the kernel calibration
    (:mod:`cosyvoice_cpu.probes.calibrate`) of this machine: what a result must carry to be compared with one
    from another day or machine."""
    from cosyvoice_cpu.backends.registry import backend_for

    hw = detect()
    cpu = hw.cpu
    memory = hw.memory_for_us
    return {
        "cpu": cpu.model if cpu else "unknown",
        "isa": cpu.isa if cpu else "unknown",
        "logical_cpus": cpu.logical if cpu else None,
        "physical_cores": cpu.physical if cpu else None,
        "usable_cores": hw.usable_cores,
        "memory_gb": round(memory / 2**30, 1) if memory else None,
        "threads": threads,
        "onnxruntime": backend_for("onnxruntime").version(),
        "python": sys.version.split()[0],
        "load_avg_before": os.getloadavg(),
        "calibration": calibrate(threads).as_dict(),
    }


def cmd_bench(args: argparse.Namespace) -> int:
    quiet_forks()  # before anything tokenizes: the export and the peers fork after using tokenizers

    threads = args.threads or detect().threads()
    args.backends = [b.strip() for b in args.backend.split(",") if b.strip()] or ["auto"]
    bad = [b for b in args.backends if b not in CHOICES]
    if bad or len(set(args.backends)) != len(args.backends):
        raise ConfigError(f"--backend wants distinct names from {', '.join(CHOICES)}, got {args.backend!r}")
    model_dir, official_dir, what = resolve_model(args)
    rate = Manifest.load(model_dir).token_frame_rate  # 25 Hz (CosyVoice2) or 50 Hz (CosyVoice-300M) tokens
    args.tokens, args.short_tokens = args.tokens or 10 * rate, args.short_tokens or 2 * rate
    if args.text_stream == "only":
        return _text_stream_only(args, model_dir, what, threads, rate)
    try:
        streams = [int(s) for s in args.concurrency.split(",") if s.strip()] if args.concurrency else []
    except ValueError:
        raise ConfigError(f"--concurrency wants stream counts like 1,4,8, got {args.concurrency!r}") from None
    if any(n < 1 for n in streams) or args.tokens < 1 or args.runs < 1:
        raise ConfigError("--concurrency counts, --tokens and --runs must be >= 1")
    print(f"benchmarking {what} with {threads} threads ...", file=sys.stderr, flush=True)
    result: JsonObject = {
        "model": what,
        "model_dir": str(model_dir),
        "tokens": args.tokens,
        "token_rate": rate,
        "runs": args.runs,
        "machine": machine_facts(threads),
        "split_rows": args.split_rows,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    partial = args.out / "bench.partial.json"  # progress survives a failure later in the run
    args.out.mkdir(parents=True, exist_ok=True)
    result["ours"] = _task(
        model_dir, "single", threads, args, short_tokens=args.short_tokens, fast_steps=args.fast_steps
    )
    partial.write_text(json.dumps(result, indent=1))
    result["backends"] = {args.backends[0]: result["ours"]}
    for backend in args.backends[1:]:  # the backend axis: the same single task per backend, one after the other
        result["backends"][backend] = _task(
            model_dir,
            "single",
            threads,
            args,
            short_tokens=args.short_tokens,
            fast_steps=args.fast_steps,
            backend=backend,
        )
        partial.write_text(json.dumps(result, indent=1))
    result["concurrency"] = []
    for n in streams:  # energy, where RAPL/powercap is readable, is read by the child around its timed work
        result["concurrency"].append(_task(model_dir, "concurrent", threads, args, streams=n))
        partial.write_text(json.dumps(result, indent=1))
    zones = energy_counters()
    result["energy"] = sorted(zones) if zones else "not available (no readable RAPL/powercap counters)"
    if args.thread_sweep:
        top = detect().usable_cores
        result["thread_sweep"] = [_task(model_dir, "threads", n, args) for n in range(1, top + 1)]
    result["peers"] = run_peers(official_dir, [p for p in args.peer.split(",") if p], threads, args.tokens)
    partial.write_text(json.dumps(result, indent=1))
    if args.text_stream == "yes":
        result["text_stream"] = _text_stream(model_dir, threads, args)
    return _finish(result, args, partial)


def _text_stream(model_dir: Path, threads: int, args: argparse.Namespace) -> JsonObject:
    """The text-stream task (:mod:`cosyvoice_cpu.benchmark.text_stream`) in a child."""
    extra: JsonObject = {"rate": args.text_rate, "speech_ratio": args.speech_ratio}
    if args.reply:
        extra["reply"] = args.reply
    return _task(model_dir, "text-stream", threads, args, **extra)


def _text_stream_only(args: argparse.Namespace, model_dir: Path, what: str, threads: int, rate: int) -> int:
    print(f"benchmarking text streams of {what} with {threads} threads ...", file=sys.stderr, flush=True)
    result: JsonObject = {
        "model": what,
        "model_dir": str(model_dir),
        "token_rate": rate,
        "runs": args.runs,
        "machine": machine_facts(threads),
        "split_rows": args.split_rows,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    result["text_stream"] = _text_stream(model_dir, threads, args)
    return _finish(result, args, None)


def _finish(result: JsonObject, args: argparse.Namespace, partial: Path | None) -> int:
    out = write_report(result, args.out)
    if partial is not None:
        partial.unlink()
    print(f"wrote {out}", file=sys.stderr)
    print((args.out / "bench.md").read_text())
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmark the engine (and its PyTorch peers) on one workload")
    src = b.add_mutually_exclusive_group()
    src.add_argument("-m", "--model", type=Path, help="an exported model directory")
    src.add_argument(
        "--recipe",
        default="int8w",
        help="else: the full-size random --family model exported with this recipe (cached; needs the [export] extra)",
    )
    b.add_argument(
        "--family",
        choices=FAMILIES,
        default="cosyvoice2",
        help="the random fixture's family (without -m): CosyVoice2-0.5B, CosyVoice-300M or "
        "Fun-CosyVoice3-0.5B (its official code is not on PyPI: use --peer reference)",
    )
    b.add_argument("--threads", type=int, default=0, help="ORT threads (default: usable physical cores)")
    b.add_argument(
        "--backend",
        default="auto",
        help="inference backends to measure, comma-separated (auto, onnxruntime, openvino): the single "
        "task runs once per backend and the report compares them; the first also runs the "
        "concurrency and thread tasks; the report says which backend ran each graph (the LM, the flow "
        "estimator, the rest). Without -m, a backend other than onnxruntime exports the fixture with "
        "--openvino int8 (the OpenVINO flow estimator and, CosyVoice2/3, the stateful LM)",
    )
    add_split_rows_arg(b)
    b.add_argument("--tokens", type=int, default=0, help="speech tokens per sentence (default 10 s: 250 at 25 Hz)")
    b.add_argument("--short-tokens", type=int, default=0, help="tokens for the 8-character sentence (default 2 s)")
    b.add_argument("--runs", type=int, default=3, help="timed repetitions after a warm-up (medians)")
    b.add_argument("--fast-steps", type=int, default=5, help="Euler steps of the fast preset")
    b.add_argument("--concurrency", default="1,4,8", help="concurrent streams to measure ('' to skip)")
    b.add_argument("--thread-sweep", action="store_true", help="also measure RTF for 1..all usable cores")
    b.add_argument("--peer", default="official,reference", help="PyTorch peers to run ('' to skip)")
    b.add_argument("--peer-from", type=Path, help="official-layout model directory for the peers (with -m)")
    b.add_argument(
        "--text-stream",
        nargs="?",
        const="yes",
        default="no",
        choices=["no", "yes", "only"],
        help="also (or with 'only': only) run the text-stream task: a reply written by a simulated LLM into "
        "a text stream, against the same reply spoken sentence by sentence (docs/benchmarks.md)",
    )
    b.add_argument("--text-rate", type=float, default=20.0, help="text-stream: text tokens/s the simulated LLM writes")
    b.add_argument("--reply", default="", help="text-stream: the reply (default: 3 sentences of ~25 text tokens)")
    b.add_argument(
        "--speech-ratio",
        type=float,
        default=3.0,
        help="text-stream: speech tokens per text token (random weights: SynthesisConfig.forced_token_ratio)",
    )
    b.add_argument("--out", type=Path, default=Path("bench-results"), help="report directory")
    b.set_defaults(func=cmd_bench)
