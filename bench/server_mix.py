"""A soak with the traffic a long-running server sees: several voices replaced as it runs, streamed and whole
speech, text streams, clients that leave mid-stream, texts of several lengths and two languages.

    python bench/server_mix.py [-m MODEL_DIR] [--requests 600] [--concurrency 3] [--every 30] [--voices 3]
                               [--wyoming] [--json OUT] [-- SERVE_ARGS...]  # e.g. -- --backend auto

``bench/server_load.py soak`` sends one sentence to one voice; a server that runs for months also meets voices
saved, replaced and deleted (each voice keeps prompt caches), sentences of many lengths (each a flow bucket on
OpenVINO), the text stream WebSocket and clients that hang up. Request ``i`` is :func:`action` ``(i)``: its kind
cycles through :data:`KINDS` (and ``wyoming``, a Home Assistant ``synthesize`` through the ``wyoming`` package's
client, with ``--wyoming``: the server then runs ``serve --wyoming``), its text through :data:`TEXTS`, its voice
through ``--voices``. After every ``--every`` requests (all of them finished) one voice is replaced by a
recording of another length, by ``overwrite`` and by delete and add in turn, and the server's RSS (``/health``),
peak RSS (``VmHWM``) and prompt cache bytes (``/metrics``) are sampled. Growth is measured from the end of the
warm-up (the first 10 %) to the end. Every outcome is counted, overall and per kind: ``ok``, ``audio_too_long``
(the audio bound: a model with random weights may not stop), ``no_speech`` (a model that ends before any speech,
as random weights sometimes do), ``dropped`` (the client's own hang-up) and ``failed`` (anything else: the run's
verdict).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.hardware.pages import status_mb
from cosyvoice_cpu.server.process import ServerProcess, free_port

KINDS = ("stream", "whole", "text_ws", "drop")
TEXTS = (
    "Pump three is hot.",
    "Warning: line three is overheating. Check the pump.",
    "三号泵温度过高，请立即检查冷却系统。",
    "The night shift starts at ten. Doors on the east side close at nine thirty; please use the main gate.",
    "Valve 12 open.",
    "今天下午三点，二号车间将停电维护，预计持续两个小时。",
)
STARTUP_S = 300


@dataclass(frozen=True)
class Action:
    """What request ``i`` of the mix does."""

    kind: str
    text: str
    voice: str
    seed: int


def action(i: int, voices: int, kinds: tuple[str, ...] = KINDS) -> Action:
    """Request ``i``: kinds in turn, texts in turn per round of kinds (so every kind meets every text), voices in
    turn."""
    return Action(kinds[i % len(kinds)], TEXTS[(i // len(kinds)) % len(TEXTS)], f"mix-{i % voices}", i)


def save_voice(url: str, name: str, version: int, how: str = "overwrite") -> None:
    """Save voice ``name`` from a tone whose length and pitch depend on ``version`` (2-5 s); ``how`` is
    ``overwrite`` (one upload with ``overwrite=true``) or ``readd`` (delete, then upload)."""
    seconds, pitch = 2.0 + (version % 4), 140.0 + 15 * (version % 5)
    with httpx.Client(base_url=url, timeout=600) as c:
        if how == "readd":
            c.delete(f"/v1/audio/voices/{name}").raise_for_status()
        r = c.post("/v1/audio/voices", files={"file": ("v.wav", _tone_wav(seconds, pitch=pitch), "audio/wav")},
                   data={"name": name, "prompt_text": "Good morning everyone.",
                         "overwrite": "true" if how == "overwrite" else "false"})  # fmt: skip
        r.raise_for_status()


def _speech(a: Action, **extra: object) -> dict[str, object]:
    return {"model": "tts-1", "input": a.text, "voice": a.voice, "seed": a.seed, **extra}


def run(url: str, a: Action, wyoming_port: int | None = None) -> str:
    """Do ``a`` against the server; its outcome (``ok``, ``audio_too_long``, ``no_speech``, ``dropped`` or
    ``failed: ...``)."""
    try:
        if a.kind == "text_ws":
            return _text_ws(url, a)
        if a.kind == "wyoming":
            assert wyoming_port is not None, "a wyoming request needs the server's Wyoming port"
            return asyncio.run(_wyoming(wyoming_port, a))
        with httpx.Client(base_url=url, timeout=600) as c:
            if a.kind == "whole":
                r = c.post("/v1/audio/speech", json=_speech(a, response_format="wav", stream=False))
                if r.status_code >= 400:
                    return _refused(r)
                return "ok" if len(r.content) > 44 else "failed: an empty file"
            if a.kind == "stream":  # server-sent events: a stream cut by the audio bound ends on an error event
                last = None
                with c.stream("POST", "/v1/audio/speech", json=_speech(a, stream_format="sse")) as r:
                    if r.status_code >= 400:
                        return _refused(r)
                    for line in r.iter_lines():  # only the last event counts: the audio deltas are not decoded
                        if line.startswith("data: ") and not line.startswith('data: {"type": "speech.audio.delta"'):
                            last = json.loads(line[6:])
                if last is not None and last["type"] == "error":
                    code = last["error"]["code"]
                    return "audio_too_long" if code == "audio_too_long" else f"failed: {last['error']}"
                return "ok" if last is not None and last["type"] == "speech.audio.done" else f"failed: ended on {last}"
            with c.stream("POST", "/v1/audio/speech", json=_speech(a, response_format="pcm")) as r:
                if r.status_code >= 400:
                    return _refused(r)
                for _ in r.iter_bytes():
                    return "dropped"  # leaving the block closes the connection mid-stream
                return "failed: no audio"
    except Exception as e:  # every failure is counted and printed, the run goes on
        return f"failed: {type(e).__name__}: {e}"


def _refused(r: httpx.Response) -> str:
    """The outcome of an error response: ``audio_too_long``, or ``failed:`` with its status and message."""
    r.read()
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"failed: {r.status_code} {r.text[:200]}"
    if error.get("code") == "audio_too_long":
        return "audio_too_long"
    if "produced no speech" in str(error.get("message")):  # the LM's end token first (random weights do this)
        return "no_speech"
    return f"failed: {r.status_code} {error}"


def _text_ws(url: str, a: Action) -> str:
    """The text in three pieces over the text stream WebSocket (sent before reading: the server keeps them)."""
    from websockets.exceptions import ConnectionClosedError
    from websockets.sync.client import connect

    cut = [0, len(a.text) // 3, 2 * len(a.text) // 3, len(a.text)]
    audio, done, closed = 0, None, None
    with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream", open_timeout=60) as ws:
        start = {k: v for k, v in _speech(a).items() if k != "input"}
        ws.send(json.dumps({"type": "start", **start}))
        for lo, hi in itertools.pairwise(cut):
            ws.send(json.dumps({"type": "text", "text": a.text[lo:hi]}))
        ws.send(json.dumps({"type": "end"}))
        try:
            for message in ws:
                if isinstance(message, bytes):
                    audio += len(message)
                elif (event := json.loads(message))["type"] == "done":
                    done = event
        except ConnectionClosedError as e:  # an error's close code (4422 for the audio bound) after its "done"
            closed = e
    if done is None:
        return f"failed: no done message ({closed})"
    if done["stop_reason"] == "error":
        error = done.get("error", {})
        if error.get("code") == "audio_too_long":
            return "audio_too_long"
        return "no_speech" if "without speech" in str(error.get("message")) else f"failed: {error}"
    return "ok" if audio else "failed: no audio"


async def _wyoming(port: int, a: Action) -> str:
    """A Home Assistant ``synthesize`` of the text with the voice, read to ``audio-stop`` or an ``error``."""
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize, SynthesizeVoice

    chunks = 0
    async with AsyncTcpClient("127.0.0.1", port, connect_timeout=30, read_timeout=600) as c:
        await c.write_event(Synthesize(text=a.text, voice=SynthesizeVoice(name=a.voice)).event())
        while (event := await c.read_event()) is not None:
            if event.type == "audio-chunk":
                chunks += 1
            elif event.type == "audio-stop":
                return "ok" if chunks else "failed: no audio"
            elif event.type == "error":
                code, text = event.data.get("code"), event.data.get("text", "")
                if code == "audio_too_long":
                    return "audio_too_long"
                return "no_speech" if "produced no speech" in text else f"failed: wyoming {code}: {text}"
    return "failed: the connection ended before audio-stop"


def sample(url: str, pid: int) -> dict[str, float]:
    """The server's RSS and peak RSS (MB), its voices' prompt cache bytes and glibc's free heap memory (MB) now,
    and its heap trims so far."""
    health = httpx.get(url + "/health", timeout=60).json()
    metrics = httpx.get(url + "/metrics", timeout=60).text
    cache = re.search(r"^cosyvoice_prompt_cache_bytes (\S+)$", metrics, re.M)
    free = re.search(r"^cosyvoice_process_malloc_free_bytes (\S+)$", metrics, re.M)
    trims = re.search(r"^cosyvoice_heap_trims_total (\S+)$", metrics, re.M)
    peak = status_mb("VmHWM", pid)
    return {"rss_mb": health["rss_mb"], "peak_mb": round(peak, 1) if peak is not None else float("nan"),
            "prompt_cache_mb": round(float(cache.group(1)) / 2**20, 1) if cache else float("nan"),
            "malloc_free_mb": round(float(free.group(1)) / 2**20, 1) if free else float("nan"),
            "heap_trims": int(float(trims.group(1))) if trims else 0}  # fmt: skip


def mix(args: argparse.Namespace) -> dict[str, object]:
    """Start the server, save the voices, run the requests in batches with a voice replaced and a sample taken
    after each; the results (outcomes overall and per kind, failures, the curve, growth)."""
    outcomes: collections.Counter[str] = collections.Counter()
    by_kind: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    curve: list[dict[str, float]] = []
    t0 = time.perf_counter()
    kinds, port, extra = KINDS, None, list(args.serve)
    if args.wyoming:
        kinds, port = (*KINDS, "wyoming"), free_port()
        extra += ["--wyoming", f"tcp://127.0.0.1:{port}"]

    def one(i: int) -> str:
        return run(server.url, action(i, args.voices, kinds), port)

    with tempfile.TemporaryDirectory() as voices:
        server = ServerProcess.start(args.model, Path(voices), "--threads", str(args.threads), "--max-active",
                                     str(args.concurrency), *extra, log=args.log, timeout=STARTUP_S)  # fmt: skip
        try:
            for v in range(args.voices):
                save_voice(server.url, f"mix-{v}", v)
            done, replaced = 0, 0
            with ThreadPoolExecutor(args.concurrency) as pool:
                while done < args.requests:
                    batch = range(done, min(done + args.every, args.requests))
                    for i, out in zip(batch, pool.map(one, batch)):
                        outcomes[out.split(":")[0]] += 1
                        by_kind[action(i, args.voices, kinds).kind][out.split(":")[0]] += 1
                        if out.startswith("failed"):
                            failures.append(f"request {i} ({action(i, args.voices, kinds)}): {out}")
                            print(failures[-1], file=sys.stderr, flush=True)
                    done = batch.stop
                    how = ("overwrite", "readd")[replaced % 2]
                    save_voice(server.url, f"mix-{replaced % args.voices}", args.voices + replaced, how)
                    replaced += 1
                    point = {"requests": done, "minutes": round((time.perf_counter() - t0) / 60, 2),
                             **sample(server.url, server.proc.pid)}  # fmt: skip
                    curve.append(point)
                    print(f"{done:6d} requests {point['minutes']:7.1f} min  RSS {point['rss_mb']:7.1f} MB  peak "
                          f"{point['peak_mb']:7.1f}  prompt caches {point['prompt_cache_mb']:6.1f} MB  malloc free "
                          f"{point['malloc_free_mb']:6.1f} MB  trims {point['heap_trims']}  "
                          f"{dict(outcomes)}", flush=True)  # fmt: skip
        finally:
            server.stop()
    warm = next(p["rss_mb"] for p in curve if p["requests"] >= args.requests // 10)
    growth = (curve[-1]["rss_mb"] - warm) / warm
    half = curve[len(curve) // 2 :]  # the voice caches vary with the voices in use: RSS less them is the trend
    rest = [p["rss_mb"] - p["prompt_cache_mb"] for p in half]
    print(f"RSS after warm-up {warm:.1f} MB, at the end {curve[-1]['rss_mb']:.1f} MB: growth {growth * 100:+.2f} %; "
          f"less the voice caches over the second half {min(rest):.0f}-{max(rest):.0f} MB (first {rest[0]:.0f}, "
          f"last {rest[-1]:.0f}); peak {curve[-1]['peak_mb']:.1f} MB; {dict(outcomes)}")  # fmt: skip
    return {"model": str(args.model), "serve_args": args.serve, "requests": args.requests,
            "concurrency": args.concurrency, "voices": args.voices, "kinds": list(kinds), "voices_replaced": len(curve),
            "outcomes": dict(outcomes), "outcomes_by_kind": {k: dict(v) for k, v in by_kind.items()},
            "failures": failures, "rss_after_warmup_mb": warm,
            "rss_end_mb": curve[-1]["rss_mb"], "growth": round(growth, 4),
            "second_half_less_caches_mb": [round(min(rest), 1), round(max(rest), 1)], "curve": curve}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Parse ``argv`` (the server's own flags after ``--``), run :func:`mix`, write ``--json``; the results."""
    argv = sys.argv[1:] if argv is None else argv
    serve = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--every", type=int, default=30, help="requests between samples (and voice replacements)")
    p.add_argument("--voices", type=int, default=3)
    p.add_argument("--wyoming", action="store_true", help="serve --wyoming too, and send Wyoming requests")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--log", type=Path, help="append the server's log here (its level: warning)")
    args = p.parse_args(argv)
    for name in ("concurrency", "requests", "every", "voices"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    args.serve = serve
    result = mix(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return result


if __name__ == "__main__":
    main()
