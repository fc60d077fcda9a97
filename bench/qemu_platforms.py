"""Do the kernels of CPUs we cannot run on give the same numbers, and the same speech, as this machine's?

Three commands, each comparing this machine (native) with qemu's user-mode emulation of other CPUs
(cosyvoice_cpu.hardware.emulation):

- ``probe``: every graph of a model directory on fixed inputs (cosyvoice_cpu.probes.graphs), natively and
  under each CPU, compared with the probe's tolerances;
- ``trace``: the packaged demo sentence (seed 0) natively and under one CPU, with every sampled token, its logp
  and its uniform draw recorded; says at which token the two part and why (how far the draw was from the edge
  of the sampled token's bin, against how far the logp moved);
- ``arm-root DIR``: an arm64 Python (Debian bookworm's, unpacked with mmdebstrap's extract variant) and the
  runtime's aarch64 wheels (pip download for manylinux aarch64), so ``--arm-root DIR`` can run the others on
  emulated arm64 cores.

    python bench/qemu_platforms.py probe [-m DIR] [--cpu Denverton,IvyBridge,Haswell-v4] [--arm-root R --arm-cpu ...]
    python bench/qemu_platforms.py trace [--cpu Denverton | --arm-root R --arm-cpu cortex-a76]
    python bench/qemu_platforms.py arm-root /work/arm64

Speeds under emulation mean nothing (10-200x slower than the host); the times printed are what a CI run costs.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cosyvoice_cpu.hardware import emulation
from cosyvoice_cpu.probes.graphs import compare

DEMO = Path(__import__("cosyvoice_cpu").__file__).parent / "demo_model"
SRC = Path(__import__("cosyvoice_cpu").__file__).parents[1]


def target_argv(target: str, args: list[str], arm_root: Path | None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run ``python args`` natively (``native``), as an x86 model or as an arm64 core."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    if target == "native":
        return [sys.executable, *args], env
    if target in emulation.ARM_MODELS:
        if arm_root is None:
            raise SystemExit(f"{target} needs --arm-root (make one with: python {sys.argv[0]} arm-root DIR)")
        root = arm_root / "root"
        emulation.write_arm_cpuinfo(root, target)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(arm_root), "PYTHONPATH": f"{arm_root / 'site'}:{SRC}"}
        return emulation.arm_argv(target, root, args, emulation.arm_python(root)), env
    return emulation.x86_argv(target, sys.executable, args), env


def run(target: str, args: list[str], arm_root: Path | None) -> float:
    argv, env = target_argv(target, args, arm_root)
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{target}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def cmd_probe(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for target in ["native", *a.cpu, *a.arm_cpu]:
            out = Path(tmp) / f"{target}.npz"
            seconds = run(target, ["-m", "cosyvoice_cpu.probes.graphs", str(a.model), str(out)], a.arm_root)
            outs[target] = dict(np.load(out))
            print(f"{target}: probe ran in {seconds:.1f} s")
        for target in [*a.cpu, *a.arm_cpu]:
            what = emulation.X86_MODELS.get(target) or emulation.ARM_MODELS.get(target, ("", ""))[1]
            print(f"\n{target} ({what}) against native:")
            for d in compare(outs["native"], outs[target]):
                if "/in/" not in d.key:
                    print(f"  {d}")


def child_trace(out: Path) -> None:
    """Run the demo sentence with every sampling step recorded (in the child, under the emulated CPU)."""
    import soundfile as sf

    from cosyvoice_cpu import Engine, EngineConfig, SynthesisConfig
    from cosyvoice_cpu.lm import sampling

    steps: list[tuple[np.ndarray, int, float]] = []
    draws: list[float] = []
    inverse_cdf, ras_sample = sampling.inverse_cdf, sampling.ras_sample

    def recording_inverse_cdf(probs: np.ndarray, u: float) -> int:
        draws.append(u)
        return inverse_cdf(probs, u)

    def recording_ras_sample(scores: np.ndarray, *args: object) -> int:  # the scores after the EOS mask
        n = len(draws)
        token = ras_sample(scores, *args)
        steps.append((np.array(scores, np.float32), token, draws[n]))
        return token

    sampling.inverse_cdf, sampling.ras_sample = recording_inverse_cdf, recording_ras_sample
    t = np.arange(48000) / 16000
    tone = 0.3 * np.sin(2 * np.pi * 170 * t * (1 + 0.05 * np.sin(2 * np.pi * 3 * t)))
    tone += 0.01 * np.random.default_rng(0).standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, tone.astype(np.float32), 16000, format="WAV")
    with Engine.load(DEMO, EngineConfig(threads=1)) as engine:
        voice = engine.make_voice(buf.getvalue(), "Good morning everyone.", name="demo")
        text = "Warning: the temperature on line three is too high. Please check the cooling system now."
        wave = np.concatenate([c.samples for c in engine.synthesize(text, voice, SynthesisConfig(seed=0))])
    np.savez(
        out,
        logp=np.stack([s[0] for s in steps]),
        token=np.array([s[1] for s in steps]),
        u=np.array([s[2] for s in steps]),
        wave=wave,
    )


def explain(step: int, ref: dict[str, np.ndarray], other: dict[str, np.ndarray], top_p: float, top_k: int) -> None:
    """Why the token at ``step`` differs: where the draw fell in each run's CDF of the nucleus."""
    from cosyvoice_cpu.lm.sampling import softmax, top_k_order

    u = float(ref["u"][step])
    for name, run_ in (("native", ref), ("emulated", other)):
        probs = softmax(run_["logp"][step])
        order = top_k_order(probs, top_k)
        head = probs[order]
        before = np.concatenate([[0.0], np.cumsum(head[:-1], dtype=np.float64)]).astype(np.float32)
        keep = max(1, int(np.count_nonzero(before < np.float32(top_p))))
        cdf = np.cumsum(head[:keep], dtype=np.float64)
        x = u * cdf[-1]
        i = int(np.searchsorted(cdf, x, side="right"))
        edges = [cdf[i - 1] if i else 0.0, cdf[min(i, keep - 1)]]
        margin = min(abs(x - e) for e in edges) / cdf[-1]
        print(
            f"  {name:8s} nucleus of {keep} tokens (mass {cdf[-1]:.6f}), ids {order[: min(keep, 8)].tolist()}...; "
            f"u*mass = {x:.6f} falls in bin {i} (token {order[i]}) [{edges[0]:.6f}, {edges[1]:.6f}); "
            f"distance to the nearest edge {margin:.2e} of the mass"
        )


def cmd_trace(a: argparse.Namespace) -> None:
    import json

    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        target = a.arm_cpu[0] if a.arm_cpu else a.cpu[0]
        for t in ("native", target):
            out = (a.keep or Path(tmp)) / f"trace_{t}.npz"
            if not (a.keep and out.exists()):  # --keep: a trace already there is reused
                seconds = run(t, [__file__, "_child-trace", str(out)], a.arm_root)
                print(f"{t}: demo sentence in {seconds:.1f} s")
            runs[t] = dict(np.load(out))
    ref, other = runs["native"], runs[target]
    n = min(len(ref["token"]), len(other["token"]))
    diff = np.flatnonzero(ref["token"][:n] != other["token"][:n])
    first = int(diff[0]) if len(diff) else n
    upto = max(first, 1)
    finite = np.isfinite(ref["logp"][:upto])
    dlogp = np.abs(np.where(finite, ref["logp"][:upto], 0) - np.where(finite, other["logp"][:upto], 0))
    print(f"tokens equal for the first {first} of {n} steps ({len(diff)} of the {n} common steps differ)")
    print(
        f"logp over the shared steps: max |diff| {dlogp[finite].max():.3e} nats, median per step of the max "
        f"{np.median(np.max(np.where(finite, dlogp, 0), axis=1)):.3e}"
    )
    if len(diff):
        sampling = json.loads((DEMO / "cosyvoice_cpu.json").read_text())["sampling"]
        u = ref["u"][first]
        print(f"step {first}: native drew {ref['token'][first]}, emulated {other['token'][first]} (u = {u:.6f})")
        explain(first, ref, other, float(sampling["top_p"]), int(sampling["top_k"]))
        a, b = int(ref["token"][first]), int(other["token"][first])
        for name, r in (("native", ref), ("emulated", other)):
            la, lb = r["logp"][first][a], r["logp"][first][b]
            print(f"  {name:8s} logp[{a}] = {la:.6f}, logp[{b}] = {lb:.6f}: gap {la - lb:+.2e} nats")
        gaps = np.abs(np.diff(np.sort(ref["logp"][first])[::-1][: int(sampling["top_k"])]))
        print(
            f"  native gaps between neighbours in the top {int(sampling['top_k'])}: median {np.median(gaps):.2e}, "
            f"min {gaps.min():.2e} nats, against a logp change of {dlogp[finite].max():.2e} nats"
        )
    w0, w1 = ref["wave"], other["wave"]
    print(f"wave: {len(w0)} vs {len(w1)} samples, peak {np.abs(w1).max():.3f}, finite {bool(np.isfinite(w1).all())}")


def cmd_arm_root(a: argparse.Namespace) -> None:
    """Debian's arm64 Python in DIR/root, the runtime's aarch64 wheels in DIR/site."""
    t0 = time.perf_counter()
    root, site, python = emulation.build_arm_root(a.dir)
    print(f"arm64 {python} in {root}, wheels in {site} ({time.perf_counter() - t0:.0f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("probe", "trace"):
        s = sub.add_parser(name)
        s.add_argument("-m", "--model", type=Path, default=DEMO)
        s.add_argument("--cpu", type=lambda v: [c for c in v.split(",") if c], default=list(emulation.X86_MODELS))
        s.add_argument("--arm-cpu", type=lambda v: [c for c in v.split(",") if c], default=[])
        s.add_argument("--arm-root", type=Path, help="made by the arm-root command")
        s.add_argument("--keep", type=Path, help="trace: keep the traces in this directory (and reuse them)")
    sub.add_parser("_child-trace").add_argument("out", type=Path)
    sub.add_parser("arm-root").add_argument("dir", type=Path)
    a = p.parse_args()
    if a.cmd == "_child-trace":
        child_trace(a.out)
    else:
        {"probe": cmd_probe, "trace": cmd_trace, "arm-root": cmd_arm_root}[a.cmd](a)


if __name__ == "__main__":
    main()
