"""The LM with weight-only 8-bit blocks of 32 (recipe ``int8w``) against blocks of 128 (``int8w-b128``): next-token
agreement and KL against the PyTorch reference, file size, and prefill / decode speed side by side.

    python bench/lm_block_probe.py [--size full] [--steps 300] [--runs 5]   # needs the [export] extra

Exports the fp32 LM of the random-weight fixture (``cosyvoice-cpu fixture`` layout, written if missing) to a
temporary directory, quantizes it both ways with the recipe's own ``quantize_nbits``, scores each with
``export.lm.common.compare_lm`` (teacher-forced steps after a random prompt), then times a 100-position prefill and
50 decode steps per run, the two graphs taking turns (medians; 2 threads).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="full", choices=["tiny", "full"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from cosyvoice_cpu.export.lm.common import runtime_session
    from cosyvoice_cpu.export.lm.cosyvoice2 import GATE, compare_lm, export_lm
    from cosyvoice_cpu.export.quantize import quantize_nbits
    from cosyvoice_cpu.paths import cache_dir
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture
    from cosyvoice_cpu.workshop.parts import load_reference

    src = cache_dir() / "fixtures" / f"cosyvoice2-{args.size}-seed0"
    if not (src / "cosyvoice2.yaml").is_file():
        write_fixture(FixtureSpec("cosyvoice2", args.size, 0), src, force=True)
    lm = load_reference(src, stages=("lm",)).lm.eval()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        export_lm(lm, out, max_len=1024)
        sessions = {}
        for block in (32, 128):
            name = f"lm_b{block}.onnx"
            quantize_nbits(out / "lm.onnx", out / name, bits=8, block_size=block, accuracy_level=4)
            r = compare_lm(lm, out, name, steps=args.steps)
            mb = sum(p.stat().st_size for p in out.glob(f"{name}*")) / 1e6
            print(f"block {block:3d}: agreement {r['agreement']:.4f}, mean KL {r['mean_kl']:.3g}, "
                  f"logp max rel err {r['max_rel_err']:.3g}, {mb:.1f} MB")  # fmt: skip
            sessions[block] = runtime_session(lm, out, name, GATE)[0]
        embeds = (np.random.default_rng(0).standard_normal((100, lm.cfg.qwen.hidden_size)) * 0.02).astype(np.float32)
        times: dict[int, dict[str, list[float]]] = {b: {"prefill": [], "step": []} for b in sessions}
        for _ in range(args.runs):
            for block, sess in sessions.items():  # the two graphs take turns
                cache = sess.new_cache(1)
                t0 = time.perf_counter()
                sess.prefill(cache, 0, embeds)
                times[block]["prefill"].append(time.perf_counter() - t0)
                for i in range(60):
                    t0 = time.perf_counter()
                    sess.decode(cache, [0], [i])
                    if i >= 10:
                        times[block]["step"].append(time.perf_counter() - t0)
        for block, t in times.items():
            print(f"block {block:3d}: prefill of 100 positions {statistics.median(t['prefill']) * 1e3:.1f} ms, "
                  f"decode step {statistics.median(t['step']) * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
