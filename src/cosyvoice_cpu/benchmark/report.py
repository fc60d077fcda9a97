"""The ``cosyvoice-cpu bench`` report: JSON, a markdown page and PNG plots from one run's results.

Input is the dict :func:`cosyvoice_cpu.cli.bench.cmd_bench` builds (``ours``, ``concurrency``, ``thread_sweep``,
``peers``, ``machine``, ``text_stream``; ``bench --text-stream only`` has only ``machine`` and ``text_stream``).
Plots need matplotlib (the ``[bench]`` extra); without it the report says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cosyvoice_cpu.benchmark.tasks import TOKEN_RATE
from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.probes.calibrate import Calibration

logger = logging.getLogger(__name__)


def _audio_s(result: JsonObject) -> float:
    """Seconds of audio of the workload's sentence: tokens / the model's token rate (25 Hz, 50 for CosyVoice-300M;
    reports written before the rate was recorded are 25 Hz)."""
    return result["tokens"] / result.get("token_rate", TOKEN_RATE)


def _stalls(streamed: JsonObject) -> str:
    """' (N stalls, S s in all)': how often a listener who starts playing at a streamed sentence's first chunk
    ran out of audio, and for how long (``first_audio``'s medians); '' for a report written before they were."""
    if "stalls" not in streamed:
        return ""
    return f" ({streamed['stalls']:g} stalls, {streamed['stall_s']:.1f} s in all)"


def _cores_busy(streamed: JsonObject, machine: JsonObject) -> str:
    """'; C of N usable cores busy': the streamed sentence's CPU seconds per second (a figure near the usable cores
    says the machine, not the schedule, set its pace); '' for a report written before it was measured."""
    if "cores_busy" not in streamed:
        return ""
    return f"; {streamed['cores_busy']:.2f} of {machine['usable_cores']} usable cores busy"


def _f(value: object, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


# the graphs the report names on their own (manifest keys); every other graph is "the rest"
NAMED_GRAPHS = {"lm": "LM", "flow_estimator": "flow estimator"}


def ran_on(run: JsonObject) -> dict[str, str]:
    """Which backend ran each part of a run (the ``graph_backends`` its engine's plan gave): ``LM``, ``flow
    estimator`` and ``the rest`` (backends joined with "/" where the other graphs ran on several); "–" for a result
    from before the plan was recorded."""
    graphs: dict[str, str] = run.get("graph_backends") or {}
    out = {label: graphs.get(key, "–") for key, label in NAMED_GRAPHS.items()}
    rest = sorted({b for g, b in graphs.items() if g not in NAMED_GRAPHS})
    out["the rest"] = "/".join(rest) or "–"
    return out


def ran_on_line(run: JsonObject) -> str:
    """:func:`ran_on` in words: ``every graph on onnxruntime``, or ``LM on openvino, flow estimator on ..., the
    rest on onnxruntime``."""
    parts = ran_on(run)
    if "graph_backends" not in run:  # results from before the plan was recorded; before --backend, all on ORT
        return f"--backend {run['backend']}" if "backend" in run else "ONNX Runtime"
    if len(set(parts.values())) == 1:
        return f"every graph on {next(iter(parts.values()))}"
    return ", ".join(f"{label} on {backend}" for label, backend in parts.items())


def peer_rows(result: JsonObject) -> list[tuple[str, str, dict[str, float | None]]]:
    """(label, format, {official, reference, ours}) per stage metric; lower is better unless marked."""
    ours, audio = result["ours"], _audio_s(result)
    d = ours["default"]
    peers = {k: v for k, v in result.get("peers", {}).items() if "skipped" not in v}

    def peer(name: str, key: str, per_audio: bool = False) -> float | None:
        v = peers.get(name, {}).get(key)
        return None if v is None else v / audio if per_audio else v

    rows = [
        ("LM prefill + first token, s", ".3f", "lm_prefill_s", ours["lm_prefill_s"], False),
        ("LM decode, tokens/s (higher is better)", ".1f", "lm_decode_tok_s", ours["lm_decode_tok_s"], False),
        ("flow ms per Euler step (CFG batch 2)", ".0f", "flow_ms_per_step", d["flow_ms_per_step"], False),
        ("flow RTF", ".3f", "flow_s", d["flow_rtf"], True),
        ("vocoder RTF", ".3f", "hift_s", d["vocoder_rtf"], True),
        ("end-to-end RTF (LM + flow + vocoder)", ".3f", "e2e_s", d["rtf"], True),
        ("peak RSS, MB", ".0f", "peak_rss_mb", ours["peak_rss_mb"], False),
    ]
    return [
        (label, fmt, {"official": peer("official", key, per), "reference": peer("reference", key, per), "ours": mine})
        for label, fmt, key, mine, per in rows
    ]


def _ratio(label: str, v: dict[str, float | None]) -> str:
    if v["official"] is None or not v["ours"]:
        return "–"
    higher_better = "higher is better" in label
    r = v["ours"] / v["official"] if higher_better else v["official"] / v["ours"]
    return f"{r:.1f}×"


def targets(result: JsonObject) -> list[tuple[str, str, str, bool | None]]:
    """(metric, target, measured, met) for issue 5's table."""
    ours, d = result["ours"], result["ours"]["default"]
    off = result.get("peers", {}).get("official", {})
    vs = f" ({off['rtf'] / d['rtf']:.1f}× the official)" if off.get("rtf") else ""
    conc = {r["streams"]: r for r in result.get("concurrency", [])}
    gain = conc[4]["sentences_per_s"] / conc[1]["sentences_per_s"] if 1 in conc and 4 in conc else None
    fast = ours["fast"]
    batched = {r["streams"]: r["aggregate_tok_s"] for r in ours.get("lm_batched", [])}
    return [
        ("end-to-end RTF, default quality", "≤ 0.5, ≥ 9× official", f"{d['rtf']:.3f}{vs}", d["rtf"] <= 0.5),
        (
            f"end-to-end RTF, fast preset ({fast['flow_steps']} steps; mel L1 {fast['fast_mel_l1']:.3f} vs 10 steps)",
            "≤ 0.3",
            f"{fast['rtf']:.3f}",
            fast["rtf"] <= 0.3,
        ),
        (
            "first audio, streaming, 8-character sentence",
            "≤ 1.0 s (stretch 0.5)",
            f"{ours['first_audio_short']['first_audio_s']:.2f} s",
            ours["first_audio_short"]["first_audio_s"] <= 1.0,
        ),
        (
            f"first audio, streaming, {_audio_s(result):.0f} s utterance",
            "–",
            f"{ours['first_audio_long']['first_audio_s']:.2f} s",
            None,
        ),
        ("LM decode, 1 stream", "≥ 60 tokens/s", f"{ours['lm_decode_tok_s']:.1f}", ours["lm_decode_tok_s"] >= 60),
        (
            "LM decode, aggregate over 4 streams (batch API: 4 KV rows, one call per step)",
            "≥ 150 tokens/s",
            f"{batched[4]:.1f} (1 row: {batched[1]:.1f})" if batched else "not measured",
            batched[4] >= 150 if batched else None,
        ),
        ("flow, default quality", "RTF ≤ 0.35", f"{d['flow_rtf']:.3f}", d["flow_rtf"] <= 0.35),
        (
            "peak RSS of the whole engine (1 stream)",
            "≤ 1100 MB (stretch 800)",
            f"{ours['peak_rss_mb']:.0f} MB",
            ours["peak_rss_mb"] <= 1100,
        ),
        (
            "throughput, 4 concurrent vs 1",
            "≥ 2×",
            "–" if gain is None else f"{gain:.2f}×",
            None if gain is None else gain >= 2.0,
        ),
    ]


def text_stream_rows(ts: JsonObject) -> list[tuple[str, str, str]]:
    """(metric, text stream, sentence by sentence) rows of the text-stream task's section
    (:func:`cosyvoice_cpu.benchmark.text_stream.summarize`)."""
    a, b = ts["text_stream"], ts["by_sentence"]
    ratio = ts.get("first_audio_ratio")

    def both(fmt: str, key: str, unit: str = "") -> tuple[str, str]:
        return f"{a[key]:{fmt}}{unit}", f"{b[key]:{fmt}}{unit}"

    mode = "interleaved LM (bistream)" if a["mode"] == "interleaved" else "sentence mode (no interleaved LM)"
    return [
        ("how it is spoken", mode, "each sentence once complete, streamed synthesize"),
        ("first audio after the first text piece", *both(".2f", "first_audio_s", " s")),
        ("first audio, sentence by sentence / text stream", f"{_f(ratio)}×", "–"),
        (
            "stalls after the first chunk (worst run): count, seconds",
            f"{a['stalls']}, {a['stall_s']:.2f} s ({a['stalls_while_writing']} while text kept coming)",
            f"{b['stalls']}, {b['stall_s']:.2f} s ({b['stalls_while_writing']} while text kept coming)",
        ),
        ("streamed RTF (first text piece to last chunk, per s of audio)", *both(".3f", "stream_rtf")),
        ("audio, s", *both(".1f", "audio_s")),
        ("LM requests (passages / sentences)", str(a["passages"]), str(b["passages"])),
    ]


def text_stream_markdown(ts: JsonObject) -> list[str]:
    """The report's section on the text-stream task."""
    tokens = ", ".join(str(n) for n in ts["sentence_tokens"])
    lines = [
        "",
        f"### Text that is still being written ({ts['family']})",
        "",
        f"A simulated LLM writes a reply of {len(ts['sentence_tokens'])} sentences ({tokens} text tokens) at "
        f"{ts['rate']:g} text tokens/s ({ts['writing_s']:.2f} s of writing); {ts['speech_ratio']:g} speech tokens "
        f"per text token; a voice of {ts.get('voice_tokens', '?')} prompt speech tokens and "
        f"{ts.get('transcript_tokens', '?')} transcript text tokens; medians of "
        f"{len(ts['runs']['text_stream'])} runs after a warm-up.",
        "",
        "| | text stream | sentence by sentence |",
        "|---|---|---|",
    ]
    lines += [f"| {m} | {x} | {y} |" for m, x, y in text_stream_rows(ts)]
    return lines


def markdown(result: JsonObject, plots: list[str]) -> str:
    if "ours" not in result:  # bench --text-stream only
        return _text_stream_only(result)
    m = result["machine"]
    lines = [
        f"Model: {result['model']}. Workload: {result['tokens']} speech tokens ({_audio_s(result):.0f} s) "
        f"per sentence, a registered 3 s voice, medians of {result['runs']} runs after a warm-up.",
        _machine_line(result),
        *(
            [f"Calibration (cosyvoice_cpu.probes.calibrate): {Calibration.from_dict(m['calibration']).summary()}."]
            if "calibration" in m
            else []
        ),  # results from before the calibration have none
        "",
        "### Official PyTorch vs ours, stage by stage (same tokens, frames and threads)",
        "",
        f"| stage | official (PyTorch) | our PyTorch reference | ours ({ran_on_line(result['ours'])}) | "
        "ours vs official |",
        "|---|---|---|---|---|",
    ]
    for label, fmt, v in peer_rows(result):
        lines.append(
            f"| {label} | {_f(v['official'], fmt)} | {_f(v['reference'], fmt)} | {_f(v['ours'], fmt)} | "
            f"{_ratio(label, v)} |"
        )
    lines += ["", "### Targets (issue 5)", "", "| metric | target | measured | met |", "|---|---|---|---|"]
    for metric, target, measured, met in targets(result):
        lines.append(f"| {metric} | {target} | {measured} | {'–' if met is None else 'yes' if met else '**no**'} |")
    o = result["ours"]
    lines += [
        "",
        f"Streaming: first chunk after {o['first_audio_short']['first_audio_s']:.2f} s (8-character "
        f"sentence) / {o['first_audio_long']['first_audio_s']:.2f} s ({_audio_s(result):.0f} s "
        "utterance), whole streamed RTF "
        f"{o['first_audio_long']['stream_rtf']:.3f}{_stalls(o['first_audio_long'])}"
        f"{_cores_busy(o['first_audio_long'], result['machine'])}; prompt cache "
        f"{o['prompt_cache_mb']:.0f} MB.",
    ]
    if o.get("lm_prefix_positions"):  # results from before the LM prefix cache have none
        lines.append(
            f"LM prefill: {o['lm_prefill_positions']} positions, the first {o['lm_prefix_positions']} (sos "
            "and the voice's transcript) copied from the LM prefix cache."
        )
    if len(result.get("backends", {})) > 1:
        lines += [
            "",
            "### Backends (the single task per backend, one after the other)",
            "",
            "| backend | LM ran on | flow estimator ran on | the rest ran on | LM decode, tokens/s | flow RTF | "
            "end-to-end RTF | vocoder RTF | streamed RTF (stalls) | first audio (short) | peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in result["backends"].items():
            d, on = r["default"], ran_on(r)
            stream, first = r["first_audio_long"]["stream_rtf"], r["first_audio_short"]["first_audio_s"]
            stalls = _stalls(r["first_audio_long"])
            lines.append(
                f"| {name} | {on['LM']} | {on['flow estimator']} | {on['the rest']} | {r['lm_decode_tok_s']:.1f} | "
                f"{d['flow_rtf']:.3f} | {d['rtf']:.3f} | {d['vocoder_rtf']:.3f} | {stream:.3f}{stalls} | "
                f"{first:.2f} s | {r['peak_rss_mb']:.0f} |"
            )
        lines += ["", "Each backend's plan (`cosyvoice-cpu doctor -m MODEL_DIR --backend B` prints the same):", ""]
        for name, r in result["backends"].items():
            lines += [f"- {name}: {line}" for line in r.get("plan", [])]
    if result.get("concurrency"):
        lines += [
            "",
            "### Concurrent streams (threads sharing one engine)",
            "",
            "| streams | sentences/s | aggregate RTF | peak RSS MB | J per sentence |",
            "|---|---|---|---|---|",
        ]
        for r in result["concurrency"]:
            lines.append(
                f"| {r['streams']} | {r['sentences_per_s']:.3f} | {r['rtf_aggregate']:.3f} | "
                f"{r['peak_rss_mb']:.0f} | {_f(r.get('joules_per_sentence'), '.1f')} |"
            )
        energy = result.get("energy")
        lines.append(f"\nEnergy counters: {energy if isinstance(energy, str) else ', '.join(energy)}.")
    if result.get("thread_sweep"):
        lines += ["", "### Threads", "", "| threads | RTF | flow RTF | LM s |", "|---|---|---|---|"]
        for r in result["thread_sweep"]:
            lines.append(f"| {r['threads']} | {r['rtf']:.3f} | {r['flow_rtf']:.3f} | {r['lm_s']:.2f} |")
    if result.get("text_stream"):
        lines += text_stream_markdown(result["text_stream"])
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _machine_line(result: JsonObject) -> str:
    """The machine, threads and engine options a result was measured with (reports from before ``split_rows`` was
    recorded ran with the default)."""
    m = result["machine"]
    rows = "" if result.get("split_rows", True) else " (`--no-split-rows`: estimator calls not split by guidance row)"
    return (
        f"Machine: {m['cpu']} ({m['isa']}), {m['usable_cores']} usable cores, {m['memory_gb']} GB; {m['threads']} "
        f"threads{rows}; onnxruntime {m['onnxruntime']}; load average before the run {m['load_avg_before'][0]:.2f}."
    )


def _text_stream_only(result: JsonObject) -> str:
    lines = [f"Model: {result['model']}.", _machine_line(result), *text_stream_markdown(result["text_stream"])]
    return "\n".join(lines) + "\n"


def plot(result: JsonObject, out: Path) -> list[str]:
    """PNG plots (stage split, memory vs streams, RTF vs threads); file names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'cosyvoice-cpu[bench]'): no plots")
        return []
    names = []
    audio = _audio_s(result)
    d = result["ours"]["default"]
    split = {"ours": (d["lm_s"], d["flow_s"], d["vocoder_s"])}
    for name, p in result.get("peers", {}).items():
        if "skipped" not in p:
            split[name] = (p["lm_total_s"], p["flow_s"], p["hift_s"])
    fig, ax = plt.subplots(figsize=(6, 3))
    left = [0.0] * len(split)
    for i, stage in enumerate(("LM", "flow", "vocoder")):
        vals = [v[i] / audio for v in split.values()]
        ax.barh(list(split), vals, left=left, label=stage)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("seconds per second of audio (RTF)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "stage_split.png", dpi=110)
    names.append("stage_split.png")
    for key, x, y, xlabel, ylabel, fname in (
        ("concurrency", "streams", "peak_rss_mb", "concurrent streams", "peak RSS (MB)", "memory_vs_streams.png"),
        ("thread_sweep", "threads", "rtf", "intra-op threads", "end-to-end RTF", "rtf_vs_threads.png"),
    ):
        rows = result.get(key) or []
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(4.5, 3))
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        names.append(fname)
    plt.close("all")
    return names


def write_report(result: JsonObject, out: Path) -> Path:
    """Write ``bench.json``, the plots and ``bench.md`` into ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    plots = plot(result, out) if "ours" in result else []
    (out / "bench.md").write_text(markdown(result, plots))
    return out
