"""Stage-by-stage benchmark of the PyTorch peers of our engine, on the engine's benchmark workload.

    python bench/peer.py --model-dir DIR --impl official|reference [--threads 2] [--tokens 250] [--seed 0]
                         [--json OUT]

Implementations (one per process, so ``ru_maxrss`` is the implementation's own):

* ``official``: the official CosyVoice2 code (package ``cosyvoice`` from ``token2wav-cosyvoice``), built from the
  model directory's yaml with HyperPyYAML and loaded strictly, exactly as the parity tests do
  (``cosyvoice_cpu.reference.official.load_official_model_dir``, which also installs the torchaudio stub).
* ``reference``: our PyTorch reference, ``cosyvoice_cpu.workshop.parts.load_reference``.

Workload (``/work/shared/reference/baseline.md``): ``torch.set_num_threads(--threads)``, fp32, eval,
``torch.inference_mode()``; all inputs are random from ``--seed``.

CosyVoice2, CosyVoice-300M and (``reference`` only: the official v3 code is not on PyPI) Fun-CosyVoice3 directories
are measured (the family is read from the yaml; v3's prompt text ends with ``<|endofprompt|>``); for v1 the prompt
is 150 speech tokens (3 s at 50 Hz) with 258 prompt mel frames (22050 / 256 Hz), the LM gets the x-vector and the
official v1 flow draws fresh noise (``MaskedDiffWithXvec.inference``, no streaming arguments).

* LM: 40 text tokens, a zero-shot prompt of 20 prompt-text and 75 prompt-speech tokens (3 s), RAS sampling with
  the model's defaults, exactly ``--tokens`` speech tokens: min/max token-text ratio ``(tokens + 0.5) / 40`` makes
  ``min_len == max_len == tokens`` in both codes, and the stop ids (>= ``speech_token_size``) are masked out of
  the scores (the official 0.1.0 loop silently skips a drawn 6562/6563 and our reference stops on it). The
  masking is one in-place slice assignment per step. Warm-up: 30 tokens, not timed. Measured: prefill + first
  token, decode (the step times between yields; tokens/s from the total and from the median step), total.
* Flow: non-streaming inference on the generated tokens plus the 75 prompt tokens, 150 random prompt mel frames
  and a random 192-d x-vector, the model defaults (10 Euler steps, CFG 0.7 as one batch-2 estimator call).
  Warm-up: one run on 25 tokens. Measured: total seconds, and each estimator call through forward hooks.
* HiFT: a synthetic log-mel (``randn * 2 - 5``) of ``2 * tokens`` frames; one warm-up call, one timed call.

Peak RSS (``VmHWM``, else ``getrusage(RUSAGE_SELF).ru_maxrss``: :func:`rss_mb`) is read after the build and after
each stage (``rss_after``; ``rss_current_after`` is VmRSS at the same points). ``loadavg_*`` flag a machine shared
with other work. End-to-end is
LM total + flow + HiFT (no frontend, no prompt feature extraction); RTF = e2e / (tokens / 25 Hz, or 50 Hz for v1).
Callers (``cosyvoice-cpu bench``) run this script in a subprocess, e.g. through :func:`run_peer`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyvoice_cpu.hardware.pages import status_mb

logger = logging.getLogger("bench.peer")

REPO = Path(__file__).resolve().parents[1]
IMPLS = ("official", "reference")
TEXT_TOKENS, PROMPT_TEXT_TOKENS, PROMPT_SECONDS = 40, 20, 3
MEL_BINS, XVEC_DIM = 80, 192
LM_WARMUP_TOKENS, FLOW_WARMUP_TOKENS = 30, 25
MAX_TEXT_ID = 151643  # Qwen2's ordinary text ids lie below <|endoftext|>


@dataclass
class Inputs:
    """The random workload inputs (identical for both implementations given the seed)."""

    text: Any  # (1, 40) long
    prompt_text: Any  # (1, 20) long
    prompt_speech: Any  # (1, 75) long (v1: 150)
    prompt_mel: Any  # (1, 150, 80) float (v1: 258 frames)
    xvec: Any  # (1, 192) float


@dataclass
class Peer:
    """One implementation's three stages behind common calls."""

    lm: Callable[[Inputs, int], Iterator[int]]  # exactly n speech tokens
    flow: Callable[[Any, Inputs], Any]  # tokens (1, n) -> mel (1, 80, frames(n))
    hift: Callable[[Any], Any]  # mel (1, 80, T) -> wave (1, upsample T)
    estimator: Any  # the flow's estimator module (timed by hooks)
    text_vocab: int
    speech_tokens: int  # speech_token_size (6561; v1 4096); ids >= it are stop ids
    v1: bool = False  # CosyVoice-300M: 50 Hz tokens, 22050 / 256 Hz mel
    endofprompt: int | None = None  # Fun-CosyVoice3: its LM requires this text id (the prompt text ends with it)

    @property
    def token_hz(self) -> int:
        return 50 if self.v1 else 25

    def frames(self, tokens: int) -> int:
        """Mel frames of ``tokens`` speech tokens (v1: the official ``int(n / 50 * 22050 / 256)``)."""
        return int(tokens / 50 * 22050 / 256) if self.v1 else 2 * tokens


def exact_ratio(tokens: int, n_text: int = TEXT_TOKENS) -> float:
    """A token-text ratio r with ``int(n_text * r) == tokens`` robustly (also in float32)."""
    return (tokens + 0.5) / n_text


def rss_mb() -> float:
    """Peak resident set size of this process image so far, in MB: ``VmHWM`` (``ru_maxrss`` survives fork + exec,
    so it would include the peak of a parent that exported a model just before), else ``ru_maxrss``."""
    peak = status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """Resident set size right now (VmRSS), in MB; NaN where /proc is unavailable."""
    rss = status_mb("VmRSS")
    return float("nan") if rss is None else rss


def machine_name() -> str:
    """The CPU model name from /proc/cpuinfo, else ``platform.processor()``."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def build_official(model_dir: Path) -> Peer:
    """The official llm/flow/hift from the model directory, as the parity tests build them."""
    import torch

    from cosyvoice_cpu.reference.official import load_official_model_dir  # installs the torchaudio stub

    c = load_official_model_dir(model_dir)
    llm, flow, hift = c["llm"], c["flow"], c["hift"]
    v1 = _is_v1(model_dir)
    stop, sampling_ids = llm.speech_token_size, llm.sampling_ids

    def masked_sampling_ids(scores: Any, decoded: list, sampling: int, ignore_eos: bool = True) -> Any:
        scores[stop:] = -float("inf")  # a fresh tensor each step: no clone needed
        return sampling_ids(scores, decoded, sampling, ignore_eos)

    llm.sampling_ids = masked_sampling_ids

    def lm(x: Inputs, n: int) -> Iterator[int]:
        r = exact_ratio(n, x.text.shape[1])
        lens = [torch.tensor([t.shape[1]]) for t in (x.text, x.prompt_text, x.prompt_speech)]  # fresh: mutated
        gen = llm.inference(x.text, lens[0], x.prompt_text, lens[1], x.prompt_speech, lens[2],
                            x.xvec if v1 else torch.zeros(0, XVEC_DIM), max_token_text_ratio=r,
                            min_token_text_ratio=r)  # fmt: skip
        return (int(t) for t in gen)

    vocab = llm.text_embedding.num_embeddings if v1 else llm.llm.model.model.embed_tokens.num_embeddings

    def vocode(mel: Any) -> Any:
        return hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0))[0]

    return Peer(lm, _flow_call(flow, v1), vocode, flow.decoder.estimator, vocab, stop, v1)


def build_reference(model_dir: Path) -> Peer:
    """Our reference modules, loaded with ``load_reference``."""
    from cosyvoice_cpu.workshop.parts import load_reference

    m = load_reference(model_dir)
    lm_mod, stop, head = m.lm, m.lm.cfg.speech_token_size, m.lm.head
    v1 = _is_v1(model_dir)

    def masked_head(hidden: Any) -> Any:
        logp = head(hidden)
        logp[..., stop:] = -float("inf")
        return logp

    lm_mod.head = masked_head

    def lm(x: Inputs, n: int) -> Iterator[int]:
        lm_mod.cfg.min_token_text_ratio = lm_mod.cfg.max_token_text_ratio = exact_ratio(n, x.text.shape[1])
        return lm_mod.inference(x.text, x.prompt_text, x.prompt_speech, *([x.xvec] if v1 else []))

    vocab = lm_mod.cfg.text_token_size if v1 else lm_mod.backbone.embed_tokens.num_embeddings
    return Peer(lm, _flow_call(m.flow, v1), lambda mel: m.hift.inference(mel)[0], m.flow.decoder.estimator,
                vocab, stop, v1, getattr(lm_mod.cfg, "endofprompt_id", None))  # fmt: skip


def _is_v1(model_dir: Path) -> bool:
    from cosyvoice_cpu.workshop.parts import detect_family

    return detect_family(model_dir) == "cosyvoice"


def _flow_call(flow: Any, v1: bool = False) -> Callable[[Any, Inputs], Any]:
    """Both flows share the official ``inference`` signature; non-streaming, final chunk (v1 has no streaming
    arguments and draws fresh noise)."""
    import torch

    def call(tokens: Any, x: Inputs) -> Any:
        lens = [torch.tensor([t.shape[1]]) for t in (tokens, x.prompt_speech, x.prompt_mel)]
        args = (tokens, lens[0], x.prompt_speech, lens[1], x.prompt_mel, lens[2], x.xvec)
        if v1:  # the official v1 signature ends with flow_cache (none: a whole utterance)
            mel, _ = flow.inference(*args, torch.zeros(1, MEL_BINS, 0, 2))
        else:
            mel, _ = flow.inference(*args, streaming=False, finalize=True)
        return mel

    return call


def make_inputs(peer: Peer, seed: int) -> Inputs:
    """The seeded random text/prompt/x-vector inputs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    text_hi = min(peer.text_vocab, MAX_TEXT_ID)
    prompt_tokens = PROMPT_SECONDS * peer.token_hz
    prompt_text = torch.randint(0, text_hi, (1, PROMPT_TEXT_TOKENS), generator=g)
    if peer.endofprompt is not None:
        prompt_text[0, -1] = peer.endofprompt
    return Inputs(
        text=torch.randint(0, text_hi, (1, TEXT_TOKENS), generator=g),
        prompt_text=prompt_text,
        prompt_speech=torch.randint(0, peer.speech_tokens, (1, prompt_tokens), generator=g),
        prompt_mel=torch.randn(1, peer.frames(prompt_tokens), MEL_BINS, generator=g),
        xvec=torch.randn(1, XVEC_DIM, generator=g),
    )


def time_lm(peer: Peer, x: Inputs, n: int) -> tuple[list[int], dict[str, float]]:
    """Generate exactly n tokens; time to the first yield (prefill + 1st token) and between yields."""
    tokens, stamps = [], []
    t0 = time.perf_counter()
    for tok in peer.lm(x, n):
        tokens.append(tok)
        stamps.append(time.perf_counter())
    total = time.perf_counter() - t0
    if len(tokens) != n:
        raise RuntimeError(f"the LM produced {len(tokens)} tokens, expected exactly {n}")
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    decode = total - (stamps[0] - t0)
    median = statistics.median(steps) if steps else float("nan")
    return tokens, {
        "lm_prefill_s": stamps[0] - t0,
        "lm_decode_s": decode,
        "lm_decode_tok_s": len(steps) / decode if steps else float("nan"),
        "lm_median_step_ms": median * 1e3,
        "lm_decode_tok_s_median": 1.0 / median if steps else float("nan"),
        "lm_total_s": total,
        "lm_tok_s": n / total,
    }


def run(model_dir: Path, impl: str, threads: int, tokens: int, seed: int) -> dict[str, Any]:
    """Build one implementation and measure build, LM, flow and HiFT; returns the result dict."""
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel work
        torch.set_num_interop_threads(threads)
    res: dict[str, Any] = {"impl": impl, "threads": threads, "tokens": tokens,
                           "seed": seed, "model_dir": str(model_dir), "torch_version": torch.__version__,
                           "python": platform.python_version(), "machine": machine_name(), "cpus": os.cpu_count(),
                           "loadavg_start": os.getloadavg()[0]}  # fmt: skip
    rss: dict[str, float] = {}
    now: dict[str, float] = {}

    def mark(stage: str) -> None:
        rss[stage], now[stage] = rss_mb(), current_rss_mb()

    t0 = time.perf_counter()
    peer = (build_official if impl == "official" else build_reference)(model_dir)
    res["build_s"] = time.perf_counter() - t0
    res["audio_s"] = tokens / peer.token_hz
    mark("build")
    logger.info("%s built in %.1f s", impl, res["build_s"])
    x = make_inputs(peer, seed)
    calls: list[float] = []
    peer.estimator.register_forward_pre_hook(lambda *_: calls.append(-time.perf_counter()))
    peer.estimator.register_forward_hook(lambda *_: calls.__setitem__(-1, calls[-1] + time.perf_counter()))

    with torch.inference_mode():
        torch.manual_seed(seed)
        time_lm(peer, x, LM_WARMUP_TOKENS)
        torch.manual_seed(seed)
        speech, lm_res = time_lm(peer, x, tokens)
        res.update(lm_res)
        mark("lm")
        logger.info("LM: %d tokens in %.2f s (%.2f tok/s decode)", tokens, res["lm_total_s"], res["lm_decode_tok_s"])

        g = torch.Generator().manual_seed(seed + 1)
        peer.flow(torch.randint(0, peer.speech_tokens, (1, FLOW_WARMUP_TOKENS), generator=g), x)
        calls.clear()
        tok = torch.tensor([speech], dtype=torch.long)
        t0 = time.perf_counter()
        mel = peer.flow(tok, x)
        res["flow_s"] = time.perf_counter() - t0
        mark("flow")
        res["flow_mel_frames"] = int(mel.shape[2])
        res["flow_estimator_calls"] = len(calls)
        res["flow_ms_per_step"] = res["flow_s"] / max(len(calls), 1) * 1e3
        res["flow_estimator_ms_per_call"] = statistics.median(calls) * 1e3 if calls else float("nan")
        res["flow_estimator_call_ms"] = [round(c * 1e3, 1) for c in calls]
        logger.info("flow: %.2f s, %d estimator calls", res["flow_s"], len(calls))

        hmel = torch.randn(1, MEL_BINS, peer.frames(tokens), generator=g) * 2 - 5
        peer.hift(hmel)
        t0 = time.perf_counter()
        wave = peer.hift(hmel)
        res["hift_s"] = time.perf_counter() - t0
        res["hift_samples"] = int(wave.shape[-1])
        mark("hift")
        logger.info("HiFT: %.3f s", res["hift_s"])

    res["e2e_s"] = res["lm_total_s"] + res["flow_s"] + res["hift_s"]
    res["rtf"] = res["e2e_s"] / res["audio_s"]
    res["peak_rss_mb"], res["rss_after"], res["rss_current_after"] = rss_mb(), rss, now
    res["loadavg_end"] = os.getloadavg()[0]
    return res


def run_peer(model_dir: str | Path, impl: str, threads: int = 2, tokens: int = 250, seed: int = 0,
             timeout: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Run this script on one implementation in a fresh subprocess and return its parsed JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model-dir", str(model_dir), "--impl", impl,
           "--threads", str(threads), "--tokens", str(tokens), "--seed", str(seed)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: measure one implementation, print the JSON (and write it to --json)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="model directory in the official layout")
    ap.add_argument("--impl", choices=IMPLS, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=250, help="speech tokens to generate (25 per second of audio)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.threads < 1:
        ap.error("--tokens and --threads must be >= 1")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
        res = run(args.model_dir, args.impl, args.threads, args.tokens, args.seed)
    text = json.dumps(res, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
