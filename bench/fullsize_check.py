"""Full-size check: a `full` CosyVoice2 fixture loads strictly into our reference (and optionally into the
official classes) with the released parameter counts; report load time and peak RSS.

    python bench/fullsize_check.py [--dir DIR] [--official] [--json out.json]

Writes the fixture to DIR (default: the cache, reused if present). Each load runs in a fresh subprocess so its
peak RSS (``ru_maxrss``) is its own. Parameter counts are unique tensors (the tied ``lm_head`` counted once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# Released CosyVoice2-0.5B, in millions of unique parameters (shared/reference/cosyvoice_official.md §3.1).
RELEASED_M = {"lm": 505.8, "flow": 112.5, "flow.estimator": 71.3, "hift": 20.8}

_COUNT = """
def count(mod):  # unique parameters (the tied lm_head and embed_tokens share storage: counted once)
    seen, n = set(), 0
    for p in mod.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr()); n += p.numel()
    return n / 1e6
def report(lm, flow, hift, load_s):
    import json, resource
    print(json.dumps({"load_s": load_s, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "lm": count(lm), "flow": count(flow), "flow.estimator": count(flow.decoder.estimator),
                      "hift": count(hift)}))
"""

_OURS = (
    _COUNT
    + """
import sys, time
t0 = time.perf_counter()
from cosyvoice_cpu.workshop.parts import load_reference
m = load_reference(sys.argv[1])
report(m.lm, m.flow, m.hift, time.perf_counter() - t0)
"""
)

# HiFT's weight norm is a parametrization upstream: its g tensors add ~0.01 M to the official HiFT count.
_OFFICIAL = (
    _COUNT
    + """
import sys, time
from cosyvoice_cpu.reference.official import load_official_model_dir
t0 = time.perf_counter()
c = load_official_model_dir(sys.argv[1])
report(c["llm"], c["flow"], c["hift"], time.perf_counter() - t0)
"""
)


def _run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    from cosyvoice_cpu.paths import cache_dir
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=cache_dir() / "fixtures" / "cosyvoice2-full-seed0")
    p.add_argument("--official", action="store_true", help="also load into the official classes")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    report: dict = {"fixture_dir": str(args.dir)}
    if not (args.dir / "cosyvoice2.yaml").is_file():
        t0 = time.perf_counter()
        write_fixture(FixtureSpec("cosyvoice2", "full", 0), args.dir, force=True)
        report["fixture_write_s"] = time.perf_counter() - t0
    report["ours"] = _run(_OURS, str(args.dir))
    if args.official:
        report["official"] = _run(_OFFICIAL, str(args.dir))
    report["released_m"] = RELEASED_M
    for who in ("ours", "official"):
        if who in report:
            r = report[who]
            counts = ", ".join(f"{k} {r[k]:.1f} M" for k in RELEASED_M)
            print(f"{who:8s} load {r['load_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB; {counts}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
