"""Quantization report: every recipe exported and measured against fp32 on one fixture, in one run.

    python bench/quant_report.py --size tiny            # about a minute
    python bench/quant_report.py --size full            # ~30 min on 2 cores (one full-size export per recipe)

For each recipe of ``cosyvoice_cpu.export.quantize.RECIPES`` it runs ``cosyvoice-cpu export`` (a subprocess:
wall time and peak RSS of the export itself), then measures, against the fp32 export of the same fixture:
LM next-token agreement and KL over teacher-forced steps (vs the PyTorch reference), estimator relative error,
end-to-end mel L1 with the same tokens and noise, waveform SNR with the same source noise, graph sizes, and
load time / peak RSS / per-stage speed of the runtime on that directory (a fresh subprocess each); and the
estimator's int8 error with and without ``reduce_range``. Exports are cached under the cache directory and reused
only when made by the same code version (git commit). Results go to ``bench/results/quant-<size>.json``, a
table between markers in ``docs/quantization.md`` and ``docs/img/quant_mel_error_<size>.png``. Random weights:
quality numbers describe the quantization error of these architectures, not a listening test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from quant_probe import probe_runtime  # bench/ is the script directory, first on sys.path

from cosyvoice_cpu.benchmark.feeds import estimator_feeds
from cosyvoice_cpu.export.quantize import RECIPES
from cosyvoice_cpu.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]

UTTERANCES = {"tiny": 4, "full": 3}
TOKENS = {"tiny": 60, "full": 125}  # 5 s of speech at 25 Hz for full size
PROMPT_TOKENS = 50
LM_STEPS = 300


def code_version() -> str:
    """``git describe --always --dirty`` of the repository (exports made by other code are not reused)."""
    out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def reduce_range_check(fp32_dir: Path, size: str, threads: int) -> dict:
    """The fp32 estimator quantized to dynamic int8 with and without reduce_range: error vs fp32 and speed."""
    import tempfile

    from cosyvoice_cpu.backends.base import SessionConfig
    from cosyvoice_cpu.backends.onnxruntime import make_session
    from cosyvoice_cpu.export.common import rel_err
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic

    feeds = estimator_feeds(650 if size == "full" else 200, np.random.default_rng(7))
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"fp32": fp32_dir / "flow_estimator.onnx"}
        for name, rr in (("on", True), ("off", False)):
            paths[name] = Path(tmp) / f"est_{name}.onnx"
            quantize_int8_dynamic(paths["fp32"], paths[name], reduce_range=rr)
        results = {}
        for name, path in paths.items():
            sess = make_session(path, SessionConfig(threads=threads))
            results[name] = sess.run(None, feeds)[0]
            t0 = time.perf_counter()
            for _ in range(3):
                sess.run(None, feeds)
            out[f"{name}_ms"] = (time.perf_counter() - t0) / 3 * 1000
        for name in ("on", "off"):
            out[f"{name}_rel_err"] = rel_err(results[name], results["fp32"])
    return out


def run_export(src: Path, dst: Path, recipe: str) -> dict:
    """``cosyvoice-cpu export`` in a subprocess; wall seconds and the child's peak RSS (wait4 rusage)."""
    cmd = [sys.executable, "-m", "cosyvoice_cpu", "export", "--from", str(src), "--to", str(dst),
           "--quant", recipe, "--force"]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.stdout.read() if p.stdout else ""
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"export {recipe} failed:\n{out}")
    return {"export_s": time.perf_counter() - t0, "export_peak_rss_mb": usage.ru_maxrss / 1024}


def dir_sizes(d: Path) -> dict:
    manifest = json.loads((d / "cosyvoice_cpu.json").read_text())
    sizes: dict[str, float] = {}
    for key, g in manifest["graphs"].items():
        stage = "lm" if key == "lm" else "hift" if key.startswith("hift") else "flow"
        sizes[stage] = sizes.get(stage, 0) + sum(f["size"] for f in [g["file"], *g["data"]]) / 1e6
    sizes["embeddings"] = sum(f["size"] for k, f in manifest["arrays"].items() if "embedding" in k) / 1e6
    sizes["total"] = sum(p.stat().st_size for p in d.iterdir() if p.is_file()) / 1e6
    return {f"size_{k}_mb": round(v, 1) for k, v in sizes.items()}


def flow_and_vocoder_quality(dirs: dict[str, Path], size: str, threads: int) -> dict[str, dict]:
    """mel L1 and wave SNR of each recipe vs fp32 on the same tokens, prompt, flow noise and source noise."""
    from cosyvoice_cpu.export.common import rel_err
    from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
    from cosyvoice_cpu.vocoder.hift import Vocoder
    from cosyvoice_cpu.vocoder.source import SourceNoise

    rng = np.random.default_rng(0)
    cases = []
    for _ in range(UTTERANCES[size]):
        cases.append((rng.integers(0, 6561, TOKENS[size]), rng.integers(0, 6561, PROMPT_TOKENS),
                      (rng.standard_normal((2 * PROMPT_TOKENS, 80)) - 5).astype(np.float32),
                      rng.standard_normal(192).astype(np.float32)))  # fmt: skip
    est_in = None
    results: dict[str, dict] = {}
    base: dict[str, list] = {}
    for recipe in dirs:  # fp32 first
        d = dirs[recipe]
        manifest = json.loads((d / "cosyvoice_cpu.json").read_text())
        flow = CosyVoice2Flow.from_dir(d, manifest["flow"], threads=threads)
        flow.split_rows = False  # one call per step: the recorded errors' form (each row's int8 scale differs)
        voc = Vocoder.from_dir(d, manifest["graphs"]["hift_decode"]["attrs"], threads=threads)
        mels, waves = [], []
        for i, (tok, ptok, pfeat, emb) in enumerate(cases):
            mel = flow.inference(tok, ptok, pfeat, emb)
            noise_rng = np.random.default_rng(100 + i)
            cfg = voc.source_cfg
            noise = SourceNoise.draw(noise_rng, 1, mel.shape[2] * cfg.upsample, cfg.harmonics)
            mels.append(mel)
            waves.append(voc(mel, noise=noise)[0])
        if est_in is None:
            est_in = estimator_feeds(650 if size == "full" else 200, rng)
        est = flow.estimator.run(["estimator_out"], est_in)[0]
        if recipe == "fp32":
            base = {"mel": mels, "wave": waves, "est": [est]}
        l1 = [float(np.mean(np.abs(m - b))) for m, b in zip(mels, base["mel"])]
        snr = []
        for w, b in zip(waves, base["wave"]):
            err = float(np.sum((w - b) ** 2))
            snr.append(float("inf") if err == 0 else 10 * np.log10(float(np.sum(b**2)) / err))
        results[recipe] = {
            "mel_l1_mean": float(np.mean(l1)),
            "mel_l1_std": float(np.std(l1)),
            "wave_snr_db": float(np.min(snr)),
            "estimator_rel_err": rel_err(est, base["est"][0]),
        }
    return results


def lm_quality(src: Path, dirs: dict[str, Path]) -> dict[str, dict]:
    from cosyvoice_cpu.export.lm.cosyvoice2 import compare_lm
    from cosyvoice_cpu.workshop.parts import load_reference

    lm = load_reference(src, ("lm",)).lm
    return {r: compare_lm(lm, d, steps=LM_STEPS, seed=0) for r, d in dirs.items()}


def plot(results: dict[str, dict], size: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.9))
    a.bar(names, [results[n]["mel_l1_mean"] for n in names], yerr=[results[n]["mel_l1_std"] for n in names],
          capsize=4, color="#4C72B0")  # fmt: skip
    a.axhline(0.02, color="#C44E52", ls="--", lw=1, label="0.02 (the guide's error bars)")
    a.set_ylabel("mel L1 vs fp32 (log-mel units)")
    a.set_title(f"flow + vocoder path, {size} random-weight CosyVoice2")
    a.legend(fontsize=8)
    a.tick_params(axis="x", rotation=30)
    b.bar(names, [1 - results[n]["lm_agreement"] for n in names], color="#55A868")
    b.set_ylabel("LM next-token disagreement vs PyTorch")
    b.set_title(f"LM, {LM_STEPS} teacher-forced steps")
    b.tick_params(axis="x", rotation=30)
    snr = [min(results[n]["wave_snr_db"], 120.0) for n in names]
    c.bar(names, snr, color="#8172B2")
    c.set_ylabel("wave SNR vs fp32, dB (120 = identical)")
    c.set_title("waveform, same source noise")
    c.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def markdown(results: dict[str, dict], size: str, meta: dict) -> str:
    cols = [("recipe", None), ("LM agree", "lm_agreement"), ("LM KL", "lm_mean_kl"),
            ("est. rel err", "estimator_rel_err"), ("mel L1 (±std)", None), ("wave SNR dB", "wave_snr_db"),
            ("LM ms/tok", "lm_decode_ms"), ("est. ms/call", "estimator_ms"), ("HiFT ms", "vocoder_ms"),
            ("load s", "load_s"), ("RSS MB", "runtime_peak_rss_mb"), ("size MB", "size_total_mb"),
            ("export s", "export_s"), ("export RSS MB", "export_peak_rss_mb")]  # fmt: skip
    rr = meta.get("estimator_reduce_range")
    note = (
        ""
        if not rr
        else (
            f" Estimator dynamic int8 vs fp32, one call: reduce_range on {rr['on_rel_err']:.3g} rel. err "
            f"({rr['on_ms']:.0f} ms), off {rr['off_rel_err']:.3g} ({rr['off_ms']:.0f} ms), fp32 {rr['fp32_ms']:.0f} ms."
        )
    )
    lines = [f"Measured {meta['date']} on {meta['machine']}, {meta['threads']} threads, onnxruntime "
             f"{meta.get('onnxruntime', '?')}, code {meta.get('code', '?')}: `{meta['command']}`.{note}", "",
             "| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    for name, r in results.items():
        row = [f"`{name}`"]
        for _, key in cols[1:]:
            if key is None:
                row.append(f"{r['mel_l1_mean']:.4f} ± {r['mel_l1_std']:.4f}")
            else:
                v = r[key]
                row.append(f"{v:.3g}" if isinstance(v, float) and abs(v) < 1 else f"{v:,.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_docs(table: str, size: str) -> None:
    doc = ROOT / "docs" / "quantization.md"
    begin, end = f"<!-- begin:{size} -->", f"<!-- end:{size} -->"
    text = doc.read_text(encoding="utf-8")
    if begin not in text:
        raise SystemExit(f"{doc} has no {begin} marker")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    doc.write_text(f"{head}{begin}\n{table}\n{end}{tail}", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reexport", action="store_true", help="export again even when a cached export exists")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/quantization.md and the plot")
    ap.add_argument("--from-json", action="store_true", help="only redraw docs and plot from bench/results")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads((ROOT / "bench" / "results" / f"quant-{args.size}.json").read_text())
        write_docs(markdown(saved["results"], args.size, saved["meta"]), args.size)
        plot(saved["results"], args.size, ROOT / "docs" / "img" / f"quant_mel_error_{args.size}.png")
        return
    recipes = ["fp32"] + [r for r in args.recipes.split(",") if r != "fp32"]
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    src = cache_dir() / "fixtures" / f"cosyvoice2-{args.size}-seed0"
    if not (src / "cosyvoice2.yaml").is_file():
        write_fixture(FixtureSpec("cosyvoice2", args.size, 0), src, force=True)
    dirs: dict[str, Path] = {}
    results: dict[str, dict] = {}
    version = code_version()
    for r in recipes:
        d = cache_dir() / "exports" / f"cosyvoice2-{args.size}-seed0-{r}"
        stats = d.with_name(d.name + ".export.json")  # beside the model directory, not in it
        cached = json.loads(stats.read_text()) if stats.is_file() else {}
        results[r] = {}
        fresh = (d / "cosyvoice_cpu.json").is_file() and cached.get("code") == version and "-dirty" not in version
        if args.reexport or not fresh:
            print(f"exporting {r} ...", flush=True)
            results[r].update(run_export(src, d, r))
            keep = {k: results[r][k] for k in ("export_s", "export_peak_rss_mb")}
            stats.write_text(json.dumps({**keep, "code": version}))
        else:
            results[r].update({k: v for k, v in cached.items() if k != "code"})
        dirs[r] = d
        results[r].update(dir_sizes(d))
        print(f"probing the runtime on {r} ...", flush=True)
        results[r].update(probe_runtime(d, args.threads, args.size))
    print("LM quality ...", flush=True)
    for r, q in lm_quality(src, dirs).items():
        results[r].update({"lm_agreement": q["agreement"], "lm_mean_kl": q["mean_kl"], "lm_max_kl": q["max_kl"]})
    print("flow + vocoder quality ...", flush=True)
    for r, q in flow_and_vocoder_quality(dirs, args.size, args.threads).items():
        results[r].update(q)
    print("estimator reduce_range on/off ...", flush=True)
    import onnxruntime

    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs",
            "threads": args.threads, "code": version, "onnxruntime": onnxruntime.__version__,
            "command": f"python bench/quant_report.py --size {args.size}",
            "estimator_reduce_range": reduce_range_check(dirs["fp32"], args.size, args.threads)}  # fmt: skip
    out = ROOT / "bench" / "results" / f"quant-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = markdown(results, args.size, meta)
    print(table)
    if not args.no_docs:
        write_docs(table, args.size)
        plot(results, args.size, ROOT / "docs" / "img" / f"quant_mel_error_{args.size}.png")


if __name__ == "__main__":
    main()
