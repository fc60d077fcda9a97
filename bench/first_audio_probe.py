"""Where the first streamed chunk's time goes, for several first-chunk sizes.

    python bench/first_audio_probe.py MODEL_DIR [--threads 2] [--sizes 15,10,8] [--runs 3] \
        [--prefix-cache on|off|both] [--lm-only] [--backend auto[,onnxruntime]]

Same workload as ``cosyvoice-cpu bench`` (registered 3 s voice, the 8-character sentence forced to 50 tokens,
prompt cache warm), the stages called directly: LM prefill + first token, the decode up to the chunk and its
3 look-ahead tokens, the stream flow on the chunk, the first vocoder push. Medians of ``runs``.

``--prefix-cache off`` keeps no LM prefix (the KV entries of the voice's transcript, :mod:`cosyvoice_cpu.lm.prefix`):
every request prefills it again, as before the cache existed; ``both`` alternates the two in each run.
``--lm-only`` times the LM prefill + first token alone (any family, CosyVoice-300M included: its prompt has the
speaker row), with the 10 s bench sentence's text too.
``--backend`` (default ``auto``, the engine's own default: the plan's OpenVINO graphs, e.g. the int4 LM of ``export
--openvino-lm int4``) loads one engine per choice; the engines stay loaded together and are alternated in every
run, so they share the machine's load, and each row names its backend.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.benchmark.tasks import SHORT_TEXT, TEXT, graph_backends, load
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream
from cosyvoice_cpu.lm.prefix import DEFAULT_BYTES, PrefixCache
from cosyvoice_cpu.vocoder.overlap_stream import VocoderStream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="15,10,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefix-cache", choices=("on", "off", "both"), default="on")
    ap.add_argument("--lm-only", action="store_true", help="time the LM prefill + first token only")
    ap.add_argument("--backend", default="auto", help="engine backends, comma-separated (default: auto)")
    args = ap.parse_args()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.prefix_cache]
    backends = args.backend.split(",")
    if len(set(backends)) < len(backends):
        ap.error(f"--backend {args.backend}: each backend once")
    runs = {b: _Run(*load(args.model_dir, args.threads, backend=b), modes) for b in backends}
    for b, run in runs.items():
        lm = graph_backends(run.engine.plan).get("lm", "?")
        print(f"--backend {b}: the LM on {lm} ({type(run.engine.lm.session.runner).__name__})", flush=True)
    if args.lm_only:
        print("| sentence | prefill positions | of them the prefix | LM prefix cache | LM prefill + first token s "
              "| backend |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for label, text in (("8 characters", SHORT_TEXT), ("10 s", TEXT)):
            times = {(b, on): [] for b in runs for on in modes}
            for _ in range(args.runs):
                for (b, on), got in times.items():  # alternated, so all see the same machine
                    req, seconds = runs[b].prefill(text, on)
                    got.append(seconds)
            prefix = req.prefix[1] if req.prefix else 0
            for (b, on), got in times.items():
                print(f"| {label} | {len(req.embeds)} | {prefix} | {'on' if on else 'off'} | "
                      f"{statistics.median(got):.3f} | {b} |", flush=True)  # fmt: skip
        return
    print("| first chunk tokens | LM prefix cache | LM prefill s | LM decode s | flow s | vocoder s | first audio s "
          "| backend |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        rows: dict[tuple[str, bool], list[tuple[float, ...]]] = {(b, on): [] for b in runs for on in modes}
        for _ in range(args.runs):
            for (b, on), got in rows.items():  # alternated, so all see the same machine
                got.append(runs[b].first_chunk(n, on))
        for (b, on), got in rows.items():
            med = [statistics.median(r[k] for r in got) for k in range(5)]
            print(f"| {n} | {'on' if on else 'off'} | " + " | ".join(f"{m:.3f}" for m in med) + f" | {b} |",
                  flush=True)  # fmt: skip


class _Run:
    """One engine with the bench's voice, its LM prompt, its prefix caches (one per ``modes`` entry) and its prompt
    cache at the default 10 steps."""

    def __init__(self, engine: Any, voice: Any, modes: list[bool]) -> None:
        self.engine, self.voice = engine, voice
        self.prompt_ids, self.prompt_speech, self.speaker = engine.lm_prompt(voice, None, False)
        self.caches = {on: PrefixCache(engine.lm.session, DEFAULT_BYTES if on else 0) for on in modes}
        self.text_ids = engine.tokenizer.encode(SHORT_TEXT)
        self.flow_cache = engine.prompt_caches.get(voice, 10, 0.7)

    def prefill(self, text: str, prefix_cache: bool) -> tuple[Any, float]:
        """(the LM request, seconds of its prefill + first token) for ``text``."""
        self.engine.lm.prefixes = self.caches[prefix_cache]
        ids = self.engine.tokenizer.encode(text)
        t0 = time.perf_counter()
        req = self.engine.lm.request(ids, self.prompt_ids, self.prompt_speech, seed=0, budget=(50, 50),
                                     speaker=self.speaker)  # fmt: skip
        next(iter(req))
        return req, time.perf_counter() - t0

    def first_chunk(self, n: int, prefix_cache: bool) -> tuple[float, ...]:
        self.engine.lm.prefixes = self.caches[prefix_cache]
        args = (self.engine, self.voice, self.text_ids, self.prompt_ids, self.prompt_speech, self.flow_cache, n)
        return _first_chunk(*args)


def _first_chunk(engine: Any, voice: Any, text_ids: list[int], prompt_ids: Any, prompt_speech: Any, cache: Any,
                 n: int) -> tuple[float, ...]:  # fmt: skip
    """Seconds of (LM prefill + first token, decode to the chunk's end, flow, vocoder, first audio)."""
    t0 = time.perf_counter()
    tokens = iter(engine.lm.request(text_ids, prompt_ids, prompt_speech, seed=0, budget=(50, 50)))
    got = [next(tokens)]
    t1 = time.perf_counter()
    while len(got) < n + 3:
        got.append(next(tokens))
    t2 = time.perf_counter()
    flow = CosyVoice2FlowStream(engine.flow, voice.speech_tokens, voice.mel, voice.embedding, 10, 0.7, 25, cache)
    mel = flow.push(got[:n], got[n : n + 3])
    t3 = time.perf_counter()
    VocoderStream(engine.vocoder, np.random.default_rng(0)).push(mel, final=False)
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0


if __name__ == "__main__":
    main()
