"""Benchmark tasks on an exported model directory (torch-free); each runs in its own process for a clean RSS.

    python -m cosyvoice_cpu.benchmark MODEL_DIR --task single|concurrent|threads|text-stream [--threads N] ...

prints one JSON object. ``cosyvoice-cpu bench`` (:mod:`cosyvoice_cpu.cli.bench`) spawns the tasks, adds the
PyTorch peers and writes the report. The workload follows ``docs/benchmarks.md``: a registered 3 s voice (made
once from a synthetic harmonic prompt, not timed), a sentence forced to ``tokens`` speech tokens
(``SynthesisConfig(min_tokens=max_tokens=N)``: random weights give fixed-length output), warm-up excluded,
medians of ``runs`` repetitions. The text-stream task (:mod:`cosyvoice_cpu.benchmark.text_stream`) has its own
workload: a reply written by a simulated LLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.backends.plan import CHOICES, GraphPlan, describe
from cosyvoice_cpu.benchmark import text_stream
from cosyvoice_cpu.benchmark.machine import energy_counters, peak_rss_mb, read_energy_j
from cosyvoice_cpu.config import DEFAULT_LM_BATCH_ROWS, EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine, Timings
from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

TEXT = (
    "Warning: the temperature on line three is above the safe limit, so the cooling pumps have started "
    "and the operators should check valve seven."
)  # fmt: skip  (~30 text tokens, one sentence)
SHORT_TEXT = "请注意三号线过热"  # the guide's 8-character sentence
PROMPT_TEXT = "This is the voice of the plant's announcement system."
TOKEN_RATE = 25  # CosyVoice2/3 speech tokens per second (reports before the rate was recorded; v1: 50)


def _prompt_wav(path: Path, seconds: float = 3.0, sr: int = 16000) -> Path:
    """A 3 s voiced-like prompt: a 140 Hz harmonic series with a slow vibrato and an amplitude envelope."""
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 10 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(np.pi * t / seconds))
    sf.write(path, (0.2 * wave).astype(np.float32), sr)
    return path


def load(
    model_dir: Path,
    threads: int,
    spinning: bool = False,
    lm_batch_rows: int | None = None,
    voice_seconds: float = 3.0,
    **config: object,
) -> tuple[Engine, Voice]:
    """The engine (``lm_batch_rows`` None: the engine's default, what users get; ``config``: other
    :class:`~cosyvoice_cpu.config.EngineConfig` fields) and a registered voice of ``voice_seconds`` (voice
    creation is setup, not timed)."""

    rows = DEFAULT_LM_BATCH_ROWS if lm_batch_rows is None else lm_batch_rows
    engine = Engine.load(model_dir, EngineConfig(threads=threads, spinning=spinning, lm_batch_rows=rows, **config))
    engine.family.wait_warm()  # the OpenVINO estimator compiling in the background: not measured
    with tempfile.TemporaryDirectory() as tmp:
        voice = engine.make_voice(_prompt_wav(Path(tmp) / "prompt.wav", voice_seconds), PROMPT_TEXT, name="bench")
    return engine, voice


def alternate(
    engines: dict[str, tuple[Engine, Voice]], runs: int, measure: Callable[[Engine, Voice], dict[str, float]]
) -> dict[str, list[dict[str, float]]]:
    """``runs`` x ``measure(engine, voice)`` for each labelled (engine, voice), the engines taking turns (an A/B
    in one process under the same load); the engines are closed afterwards. Returns label -> the results."""
    results: dict[str, list[dict[str, float]]] = {label: [] for label in engines}
    for _ in range(runs):
        for label, (engine, voice) in engines.items():
            results[label].append(measure(engine, voice))
    for engine, _ in engines.values():
        engine.close()
    return results


def _config(tokens: int, **kw: object) -> SynthesisConfig:

    return SynthesisConfig(seed=0, min_tokens=tokens, max_tokens=tokens, normalize=False, **kw)


def measure_lm(engine: Engine, voice: Voice, tokens: int, runs: int) -> dict[str, float]:
    """Prefill (+ first token) seconds and decode tokens/s (median step) of the LM alone."""
    prompt_ids, prompt_speech, speaker = engine.lm_prompt(voice, None, False)
    text_ids = engine.tokenizer.encode(TEXT)
    prefill, steps = [], []
    for _ in range(runs + 1):
        req = engine.lm.request(text_ids, prompt_ids, prompt_speech, seed=0, budget=(tokens, tokens), speaker=speaker)
        first, each = timed_request(req)
        prefill.append(first)
        steps += each
    positions = len(engine.lm.prompt_embeddings(text_ids, prompt_ids, prompt_speech, speaker))
    step = statistics.median(steps[tokens - 1 :])  # the warm-up run's steps excluded
    # the voice transcript's positions come from the LM prefix cache after the warm-up (lm_prefix)
    return {
        "lm_prefill_s": statistics.median(prefill[1:]),
        "lm_prefill_positions": positions,
        "lm_prefix_positions": req.prefix[1] if req.prefix else 0,
        "lm_decode_ms": step * 1000,
        "lm_decode_tok_s": 1.0 / step,
    }


def timed_request(request: Iterable[object]) -> tuple[float, list[float]]:
    """Run an LM request to its end: seconds to its first token (the prefill), and of each token after."""
    it = iter(request)
    t0 = time.perf_counter()
    next(it)
    t1 = time.perf_counter()
    first, steps = t1 - t0, []
    for _ in it:
        t2 = time.perf_counter()
        steps.append(t2 - t1)
        t1 = t2
    return first, steps


def measure_lm_batched(engine: Engine, voice: Voice, streams: int, steps: int = 100) -> dict[str, float]:
    """The LM's batch API: ``streams`` rows of one KV cache decoded by one call per step (what a scheduler
    does); aggregate tokens/s from the median step. Greedy tokens: sampling is not what is measured here."""
    embeds = engine.lm.prompt_embeddings(engine.tokenizer.encode(TEXT), *engine.lm_prompt(voice, None, False))
    session, vocab = engine.lm.session, engine.lm.facts.speech_token_size
    steps = min(steps, session.spec.max_len - len(embeds) - 1)  # stay inside the KV cache
    if steps < 10:
        raise ValueError(f"the KV cache (max_len {session.spec.max_len}) leaves only {steps} decode steps")
    cache = session.new_cache(streams)
    rows = list(range(streams))
    tokens = [int(np.argmax(session.prefill(cache, r, embeds)[:vocab])) for r in rows]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logp = session.decode(cache, rows, tokens)
        times.append(time.perf_counter() - t0)
        tokens = [int(i) for i in np.argmax(logp[:, :vocab], axis=1)]
    step = statistics.median(times[5:])  # the first steps warm up
    return {"streams": streams, "step_ms": step * 1000, "aggregate_tok_s": streams / step}


def medians(results: list[dict[str, float]]) -> dict[str, float]:
    """The median of each key over ``results`` (all with the keys of the first)."""
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def measure_e2e(engine: Engine, voice: Voice, tokens: int, runs: int, **kw: object) -> dict[str, float]:
    """Whole-sentence synthesis: per-stage seconds and RTF (medians)."""

    rows = []
    for i in range(runs + 1):
        t = Timings()
        t0 = time.perf_counter()
        wave = np.concatenate([c.samples for c in engine.synthesize(TEXT, voice, _config(tokens, **kw), timings=t)])
        wall = time.perf_counter() - t0
        if i:
            rows.append(
                {
                    "wall_s": wall,
                    "lm_s": t.lm,
                    "flow_s": t.flow,
                    "vocoder_s": t.vocoder,
                    "audio_s": len(wave) / engine.sample_rate,
                }
            )
    med = medians(rows)
    audio = med["audio_s"]
    steps = kw.get("flow_steps", 10)
    return {
        **med,
        "rtf": med["wall_s"] / audio,
        "flow_rtf": med["flow_s"] / audio,
        "vocoder_rtf": med["vocoder_s"] / audio,
        "flow_ms_per_step": med["flow_s"] / steps * 1000,
    }


def listen(engine: Engine, voice: Voice, text: str, config: SynthesisConfig) -> dict[str, float]:
    """One streamed synthesis (``config.stream``) heard by a :class:`~cosyvoice_cpu.benchmark.text_stream.Playback`
    listener who starts playing at the first chunk: seconds to the first chunk, the streamed RTF (call to the last
    chunk, per second of audio), ``chunks`` with audio, ``stalls`` (times the audio ran dry before the next chunk
    came), ``stall_s`` (their total) and ``cores_busy`` (the process's CPU seconds per second of the synthesis: near
    the usable cores, the machine was the limit)."""
    play, chunks = text_stream.Playback(), 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for chunk in engine.synthesize(text, voice, config):
        play.add(time.perf_counter() - t0, chunk.duration)
        chunks += chunk.duration > 0
    wall = max(time.perf_counter() - t0, 1e-9)  # a (fake) clock that did not move divides by no zero
    cores = (time.process_time() - cpu0) / wall
    s = play.summary(0.0, 0.0)
    keys = ("first_audio_s", "stream_rtf", "stalls", "stall_s")
    return {"chunks": chunks, **{k: float(s[k]) for k in keys}, "cores_busy": cores}


def first_audio(engine: Engine, voice: Voice, text: str, tokens: int, runs: int) -> dict[str, float]:
    """:func:`listen` to ``text`` forced to ``tokens`` speech tokens: medians of ``runs`` after one warm-up (the
    voice's prompt cache warm)."""
    results = [listen(engine, voice, text, _config(tokens, stream=True)) for _ in range(runs + 1)][1:]
    return {k: v for k, v in medians(results).items() if k != "chunks"}


def fast_preset_quality(engine: Engine, voice: Voice, tokens: int, steps: int) -> dict[str, float]:
    """Mel L1 of ``steps`` Euler steps against the default 10, on the same tokens (flow only)."""
    toks = np.random.default_rng(0).integers(0, engine.lm.facts.speech_token_size, tokens)

    def mel(n: int) -> np.ndarray:  # a flow that draws fresh noise (CosyVoice-300M) gets the same seed for both
        return engine.flow.inference(
            toks, voice.speech_tokens, voice.mel, voice.embedding, n_timesteps=n, rng=np.random.default_rng(0)
        )

    ref, fast = mel(10), mel(steps)
    return {"fast_mel_l1": float(np.abs(fast - ref).mean()), "mel_abs_mean": float(np.abs(ref).mean())}


def graph_backends(plan: Mapping[str, GraphPlan]) -> dict[str, str]:
    """Graph -> the backend that runs it, from an engine's plan (:attr:`Engine.plan`): what the report says ran
    each graph."""
    return {graph: p.backend for graph, p in plan.items()}


def task_single(
    model_dir: Path, threads: int, tokens: int, short_tokens: int, runs: int, fast_steps: int, **options: Any
) -> dict:
    """Every single-stream measure on one engine loaded with ``options`` (``EngineConfig`` fields: ``backend``,
    ``split_rows``)."""
    t0 = time.perf_counter()
    engine, voice = load(model_dir, threads, **options)
    out: JsonObject = {
        "load_s": time.perf_counter() - t0,
        "rss_after_load_mb": peak_rss_mb(),
        "backend": options.get("backend", "auto"),
        "split_rows": engine.config.split_rows,
        "plan": describe(engine.plan),
        "graph_backends": graph_backends(engine.plan),
    }
    out.update(measure_lm(engine, voice, tokens, runs))
    out["lm_batched"] = [measure_lm_batched(engine, voice, n) for n in (1, 4)]
    out["default"] = measure_e2e(engine, voice, tokens, runs)
    out["fast"] = {
        **measure_e2e(engine, voice, tokens, runs, flow_steps=fast_steps),
        "flow_steps": fast_steps,
        **fast_preset_quality(engine, voice, tokens, fast_steps),
    }
    out["first_audio_short"] = first_audio(engine, voice, SHORT_TEXT, short_tokens, runs)
    out["first_audio_long"] = first_audio(engine, voice, TEXT, tokens, runs)
    out["prompt_cache_mb"] = engine.prompt_caches.nbytes / 1e6 if engine.prompt_caches else 0.0
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def task_concurrent(model_dir: Path, threads: int, tokens: int, streams: int, runs: int, **options: Any) -> dict:
    """``streams`` threads share one engine, each synthesizing ``runs`` sentences; sentences per second.

    The engine runs the LM scheduler (as the server does), so the streams' LM steps are batched.
    """
    engine, voice = load(model_dir, threads, lm_batch_rows=streams, **options)
    engine.synthesize_wav(TEXT, voice, _config(tokens))  # warm-up
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(runs):
                engine.synthesize_wav(TEXT, voice, _config(tokens))
        except BaseException as e:
            errors.append(e)

    pool = [threading.Thread(target=worker) for _ in range(streams)]
    counters = energy_counters()
    e0 = read_energy_j(counters)
    t0 = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    wall = time.perf_counter() - t0
    e1 = read_energy_j(counters)
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} streams failed: {errors[0]!r}")
    done = streams * runs
    audio = done * tokens / engine.manifest.token_frame_rate
    joules = None if e0 is None or e1 is None else (e1 - e0) / done
    engine.close()
    return {
        "streams": streams,
        "sentences": done,
        "wall_s": wall,
        "sentences_per_s": done / wall,
        "lm_batched": True,
        "rtf_aggregate": wall / audio,
        "peak_rss_mb": peak_rss_mb(),
        "joules_per_sentence": joules,
        "energy_zones": sorted(counters),
    }


def task_threads(model_dir: Path, threads: int, tokens: int, runs: int, **options: Any) -> dict:
    engine, voice = load(model_dir, threads, **options)
    return {"threads": threads, **measure_e2e(engine, voice, tokens, runs), "peak_rss_mb": peak_rss_mb()}


def task_text_stream(model_dir: Path, threads: int, runs: int, args: argparse.Namespace, **options: Any) -> dict:
    """The text-stream workload (:mod:`cosyvoice_cpu.benchmark.text_stream`): ``args.reply`` or a reply of
    ``args.sentences`` x ``args.sentence_tokens`` text tokens, written at ``args.rate`` tokens/s."""
    engine, voice = load(model_dir, threads, **options)
    reply = args.reply or text_stream.reply_text(engine.tokenizer, args.sentences, args.sentence_tokens)
    out = text_stream.measure(engine, voice, reply, args.rate, runs, args.speech_ratio)
    prompt = engine.lm_prompt(voice)  # the first speech token waits for 5 * ceil(Ts / 15) text tokens, Tp included
    text = [int(i) for i in prompt.text_ids]
    eop = engine.lm.facts.endofprompt_id  # Fun-CosyVoice3: what precedes <|endofprompt|> goes in before the text
    text = text[text.index(eop) + 1 :] if eop in text else text
    out.update(reply=reply, voice_tokens=len(prompt.speech), transcript_tokens=len(text))
    out["split_rows"] = engine.config.split_rows
    out["peak_rss_mb"] = peak_rss_mb()
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # run alone too: no tokenizers fork warnings
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--task", choices=["single", "concurrent", "threads", "text-stream"], required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--short-tokens", type=int, default=50)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fast-steps", type=int, default=5)
    ap.add_argument("--backend", choices=CHOICES, default="auto")
    ap.add_argument("--no-split-rows", dest="split_rows", action="store_false", help="EngineConfig.split_rows off")
    ap.add_argument("--rate", type=float, default=text_stream.RATE, help="text-stream: text tokens/s written")
    ap.add_argument("--reply", default="", help="text-stream: the reply (default: a made one)")
    ap.add_argument("--sentences", type=int, default=text_stream.SENTENCES)
    ap.add_argument("--sentence-tokens", type=int, default=text_stream.SENTENCE_TOKENS)
    ap.add_argument("--speech-ratio", type=float, default=text_stream.SPEECH_RATIO)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    options = {"backend": args.backend, "split_rows": args.split_rows}
    if args.task == "single":
        out = task_single(
            args.model_dir, args.threads, args.tokens, args.short_tokens, args.runs, args.fast_steps, **options
        )
    elif args.task == "concurrent":
        out = task_concurrent(args.model_dir, args.threads, args.tokens, args.streams, args.runs, **options)
    elif args.task == "threads":
        out = task_threads(args.model_dir, args.threads, args.tokens, args.runs, **options)
    else:
        out = task_text_stream(args.model_dir, args.threads, args.runs, args, **options)
    json.dump({"task": args.task, "threads": args.threads, "tokens": args.tokens, **out}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
