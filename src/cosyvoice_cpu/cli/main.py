"""``cosyvoice-cpu`` command line: thin sub-commands that parse arguments, build a config, call the library.

Errors the user can fix (a bad path, a bad value, a missing extra) print one line and exit with status 2;
``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cosyvoice_cpu import __version__
from cosyvoice_cpu.cli.common import add_backend_args, need_export_extra
from cosyvoice_cpu.errors import CosyVoiceCpuError
from cosyvoice_cpu.facts import FAMILIES
from cosyvoice_cpu.paths import cache_dir

logger = logging.getLogger("cosyvoice_cpu")

DEMO_TEXT = "Warning: the temperature on line three is too high. Please check the cooling system now."


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class IntermixedParser(argparse.ArgumentParser):
    """A sub-command parser that accepts options before, between and after its positionals.

    Plain ``parse_args`` binds positionals greedily at their first chunk: in ``voice add -m DIR alice`` the
    optional ``name`` is bound (empty) together with ``add``, before ``-m``, and ``alice`` is then "unrecognized".
    :meth:`argparse.ArgumentParser.parse_known_intermixed_args` reads every option first and the positionals
    after. It calls :meth:`parse_known_args` itself, hence the re-entry guard. Parsers without positionals
    parse as usual.
    """

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing or not self._get_positional_actions():
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def cmd_fixture(args: argparse.Namespace) -> int:
    need_export_extra()
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    t0 = time.perf_counter()
    out = write_fixture(FixtureSpec(args.family, args.size, args.seed, args.variant), args.out, force=args.force)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        f"wrote {args.size} {args.family} fixture (seed {args.seed}) to {out}: {size / 1e6:.1f} MB "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Synthesize a sentence with a small random-weight model and print per-stage timings."""
    if not args.reference:
        from cosyvoice_cpu.cli.speech import demo_runtime

        return demo_runtime(args)
    need_export_extra()
    import numpy as np
    import torch

    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture
    from cosyvoice_cpu.workshop.reference_pipeline import Prompt, ReferencePipeline, write_wav

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else cache_dir() / "fixtures" / "cosyvoice2-tiny-seed0"
    if not args.model and not (model_dir / "cosyvoice2.yaml").is_file():
        print(f"generating the tiny CosyVoice2 fixture in {model_dir} ...")
        write_fixture(FixtureSpec("cosyvoice2", "tiny", 0), model_dir, force=True)
    t0 = time.perf_counter()
    pipe = ReferencePipeline.load(model_dir)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)  # a synthetic 2 s voice: the front-end arrives with the runtime
    prompt = Prompt(
        text="Good morning everyone.",
        speech_tokens=rng.integers(0, 6561, 50),
        mel=(rng.standard_normal((100, 80)) - 5.0).astype(np.float32),
        embedding=rng.standard_normal(192).astype(np.float32),
    )
    result = pipe.synthesize(args.text, prompt, seed=args.seed, n_timesteps=args.flow_steps)
    write_wav(args.out, result.wave, result.sample_rate)
    total = sum(result.timings.values())
    print(f"model   {model_dir} ({pipe.model.config.family}, PyTorch reference, {torch.get_num_threads()} threads)")
    print(f"load    {load_s * 1000:8.1f} ms")
    for stage, seconds in result.timings.items():
        extra = ""
        if stage == "lm":
            extra = f"  {len(result.speech_tokens)} tokens, {len(result.speech_tokens) / seconds:.1f} tokens/s"
        print(f"{stage:7s} {seconds * 1000:8.1f} ms{extra}")
    print(f"total   {total * 1000:8.1f} ms  for {result.duration:.2f} s of audio (RTF {total / result.duration:.3f})")
    print(f"wrote   {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Official CosyVoice directory -> deployable model directory (graphs, manifest, tokenizer)."""
    if args.list_recipes:
        from cosyvoice_cpu.export.quantize import DEFAULT_RECIPE, RECIPES

        for name, r in RECIPES.items():
            stages = ", ".join(f"{k}={v}" for k, v in r.stages().items())
            print(f"{name:14s} {stages}{'  (default)' if name == DEFAULT_RECIPE else ''}")
        return 0
    if args.src is None or args.dst is None:
        raise CosyVoiceCpuError("export needs --from OFFICIAL_DIR and --to MODEL_DIR")
    need_export_extra()
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model

    if args.openvino_lm is not None and args.openvino == "none":
        raise CosyVoiceCpuError("--openvino-lm goes with --openvino int8|bf16 (the weights of the LM it also writes)")
    options = ExportOptions(force=args.force, verify=not args.no_verify, max_len=args.max_len, openvino=args.openvino)
    if args.openvino_lm is not None:
        options.openvino_lm = args.openvino_lm
    if args.quant:
        options.recipe = args.quant
    manifest = export_model(args.src, args.dst, options, progress=print)
    if args.verbose:
        for check in manifest.verification:
            print(f"  {check['graph']}: {check['check']} = {check['value']:.3g} (<= {check['tolerance']:.3g})")
    return 0


def _print_speed(threads: int) -> None:
    """``doctor --speed``: this machine's kernel calibration next to the machines the docs were measured on."""
    from cosyvoice_cpu.probes.calibrate import REFERENCE_MACHINES, calibrate, speed_notes

    cal = calibrate(threads)
    print(f"speed        {cal.summary()}")
    for name, ref in REFERENCE_MACHINES.items():
        print(f"  compare    {ref.summary()}: {name}")
    for note in speed_notes(cal):
        print(f"note         {note}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Report what this machine can run; exit 1 when something needs attention."""
    from cosyvoice_cpu.hardware.cpu import detect
    from cosyvoice_cpu.hardware.features import kernel_level, numpy_cpu_features, speed_expectation
    from cosyvoice_cpu.probes.calibrate import probe_kernels

    hw = detect()
    problems: list[str] = []
    cpu = hw.cpu
    if cpu:
        yes = {True: "yes", False: "no"}
        if cpu.arch == "aarch64":
            print(
                f"cpu          {cpu.model} (aarch64): NEON {yes['asimd' in cpu.flags]}, dot product (asimddp) "
                f"{yes['asimddp' in cpu.flags]}, i8mm {yes['i8mm' in cpu.flags]}, bf16 {yes['bf16' in cpu.flags]}, "
                f"SVE {yes['sve' in cpu.flags]}"
            )
        else:
            print(
                f"cpu          {cpu.model}: AVX {yes['avx' in cpu.flags]}, AVX2 {yes[cpu.avx2]}, AVX-512 "
                f"{yes[cpu.avx512]}, VNNI {yes[cpu.vnni]}, BF16 {yes[cpu.bf16]}, AMX {yes[cpu.amx]} (int8 kernels: "
                f"{cpu.isa})"
            )
        print(
            f"kernels      {kernel_level(cpu.arch, cpu.flags)} (features from {hw.features_from}): "
            f"{speed_expectation(cpu.arch, cpu.flags)}"
        )
        print(
            f"cores        {cpu.logical} logical, {cpu.physical} physical; usable {hw.usable_cores} "
            f"(affinity {hw.affinity}, quota {'none' if hw.quota is None else f'{hw.quota:g}'})"
        )
    else:
        print(f"cpu          /proc/cpuinfo not readable; {os.cpu_count()} logical CPUs")
    try:
        hw.check_cpu()
    except CosyVoiceCpuError as e:
        problems.append(str(e))
    if not problems:  # a wheel built for a newer CPU dies of SIGILL: in a child process, explained
        problem, note = probe_kernels(cpuid=numpy_cpu_features()[0] if hw.features_from.startswith("cpuid") else None)
        problems += [problem] if problem else []
        hw.notes += [note] if note else []
    gib = 2**30
    mem = ", ".join(
        f"{name} {v / gib:.1f} GiB"
        for name, v in (("total", hw.mem_total), ("available", hw.mem_available), ("container limit", hw.mem_limit))
        if v is not None
    )
    print(f"memory       {mem or 'unknown'}")
    print(f"threads      {hw.thread_plan()}")
    from cosyvoice_cpu.config import DEFAULT_LM_BATCH_ROWS
    from cosyvoice_cpu.hardware.pools import pool_lines

    for line in pool_lines(hw.threads(), DEFAULT_LM_BATCH_ROWS, hw.usable_cores, split_rows=args.split_rows):
        print(f"pools        {line}")
    for note in hw.notes:
        print(f"note         {note}")
    if not problems:  # import onnxruntime only once the CPU is known to run it
        from cosyvoice_cpu.backends.registry import BACKENDS

        for backend in BACKENDS.values():
            print(f"{backend.name:<12} {backend.version() or 'not installed'}")
        if args.speed:
            _print_speed(hw.threads())
    if args.model:
        from cosyvoice_cpu.manifest import Manifest

        try:
            m = Manifest.load(args.model, check_hashes=not args.quick)
            size = sum(f.size for f in m.all_files())
            print(
                f"model        {args.model}: {m.family}, recipe {m.recipe['name']}, {size / 1e9:.2f} GB, files ok"
                f"{'' if args.quick else ' (sha256 checked)'}"
            )
            problems += hw.model_warnings(m)
            from cosyvoice_cpu.backends.plan import describe, plan_backends

            for line in describe(plan_backends(m.graphs, args.backend, family=m.family)):
                print(f"backend      {line}")
        except CosyVoiceCpuError as e:
            problems.append(str(e))
    for p in problems:
        print(f"PROBLEM      {p}")
    if not problems:
        print("ok")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-cpu", description="CosyVoice text-to-speech on CPUs alone.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    # every sub-command (also those added by cli/speech.py, bench.py, serve.py) takes options anywhere
    sub = p.add_subparsers(dest="command", required=True, parser_class=IntermixedParser)

    f = sub.add_parser("fixture", help="write a random-weight model directory in the official layout")
    f.add_argument(
        "--family",
        default="cosyvoice2",
        choices=FAMILIES,
        help="cosyvoice = CosyVoice-300M (v1), cosyvoice3 = Fun-CosyVoice3-0.5B",
    )
    f.add_argument("--size", default="tiny", choices=["tiny", "full"])
    f.add_argument(
        "--variant",
        default="sft",
        choices=["base", "sft", "instruct"],
        help="CosyVoice-300M download to mimic: base has no built-in speakers (spk2info.pt)",
    )
    f.add_argument("--seed", type=_non_negative, default=0)
    f.add_argument("--out", required=True, type=Path, help="directory to create")
    f.add_argument("--force", action="store_true", help="replace an existing directory")
    f.set_defaults(func=cmd_fixture)

    e = sub.add_parser("export", help="export an official CosyVoice directory to a deployable ONNX model directory")
    e.add_argument("--from", dest="src", type=Path, help="official model directory (e.g. CosyVoice2-0.5B)")
    e.add_argument("--to", dest="dst", type=Path, help="model directory to create")
    e.add_argument("--quant", help="quant recipe name or spec (default: the recommended one; see --list-recipes)")
    e.add_argument("--force", action="store_true", help="replace an existing model directory")
    e.add_argument("--no-verify", action="store_true", help="skip the numerics gate (ORT vs PyTorch reference)")
    e.add_argument("--max-len", type=_positive, default=2048, help="LM KV-cache positions (default 2048)")
    e.add_argument("--list-recipes", action="store_true", help="print the quantization recipes and exit")
    e.add_argument(
        "--openvino",
        default="none",
        choices=["none", "bf16", "int8"],
        help="also write an OpenVINO model of the whole-sentence flow estimator: int8 (NNCF, calibrated "
        "on the flow's own inputs) or bf16 weights-as-float16, and (CosyVoice2, Fun-CosyVoice3) the LM as a "
        "stateful OpenVINO model (--openvino-lm); run by --backend auto on CPUs with AVX-512 VNNI (needs the "
        "[openvino-export] extra)",
    )
    e.add_argument(
        "--openvino-lm",
        default=None,
        choices=["int8", "int4", "none"],
        help="with --openvino: the weights of the stateful OpenVINO LM (lm.ov.xml): int8 (the default), int4 "
        "(faster, lower token agreement: docs/quantization.md), or none to write no OpenVINO LM",
    )
    e.set_defaults(func=cmd_export)

    from cosyvoice_cpu.cli.speech import add_commands

    add_commands(sub, _positive, _non_negative)
    from cosyvoice_cpu.cli.bench import add_parser as add_bench

    add_bench(sub)
    from cosyvoice_cpu.cli.serve import add_parser as add_serve

    add_serve(sub, _positive, _non_negative)
    from cosyvoice_cpu.cli.wyoming import add_parser as add_wyoming

    add_wyoming(sub, _positive, _non_negative)

    h = sub.add_parser("doctor", help="check this machine (CPU features, cores, memory) and optionally a model")
    h.add_argument("-m", "--model", type=Path, help="also check an exported model directory")
    h.add_argument("--quick", action="store_true", help="check the model's file sizes only, not their sha256")
    add_backend_args(h)
    h.add_argument(
        "--speed",
        action="store_true",
        help="also time the kernels the engine spends its time on (~3 s) and compare with the "
        "machines docs/benchmarks.md was measured on",
    )
    h.set_defaults(func=cmd_doctor)

    d = sub.add_parser("demo", help="synthesize a sentence with a small model and print stage timings")
    d.add_argument("--text", default=DEMO_TEXT)
    d.add_argument(
        "-m",
        "--model",
        help="exported model directory (default: the packaged demo model); with "
        "--reference, an official directory (default: a generated tiny fixture)",
    )
    d.add_argument("--reference", action="store_true", help="run the PyTorch reference instead (needs [export])")
    d.add_argument("-o", "--out", default="demo.wav", type=Path)
    d.add_argument("--seed", type=_non_negative, default=0)
    d.add_argument("--flow-steps", type=_positive, default=10)
    d.add_argument("--threads", type=_non_negative, default=0, help="intra-op threads (default: torch's choice)")
    add_backend_args(d)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (CosyVoiceCpuError, OSError) as e:
        if args.debug:
            raise
        print(f"cosyvoice-cpu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # ``python -m cosyvoice_cpu.cli`` as well as ``python -m cosyvoice_cpu``
    raise SystemExit(main())
