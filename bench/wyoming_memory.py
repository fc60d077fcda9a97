"""The Wyoming server's costs on this machine, over loopback (docs/wyoming.md):

    python bench/wyoming_memory.py [-m MODEL_DIR] [--threads 2] [--unload-after 5] [--json OUT]

``first-audio``: seconds from a ``synthesize`` (one-shot), or from the first of the text's words sent as
``synthesize-chunk`` s and then ``synthesize-stop`` (streamed), to the first ``audio-chunk``, with the engine
loaded and warm (the median of 3, after one warm-up request per mode), over the ``wyoming`` package's
``AsyncTcpClient``.

``one process vs two``: the resident memory (VmRSS) of ``serve --wyoming`` after one HTTP and one Wyoming
synthesis, against ``serve`` + ``wyoming`` as two processes on the same model after the same requests.

``unload``: ``serve --wyoming --unload-after S``: RSS after a synthesis, RSS once the idle engine was released,
then the first audio of the next Wyoming request (the reload included) and the reload time the server logged.

Every synthesis is stopped at its first audio (the client hangs up): random-weight models do not come to an end.
The default model is the packaged tiny demo model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from cosyvoice_cpu.cli.speech import DEMO_MODEL, _tone_wav
from cosyvoice_cpu.hardware.pages import status_mb
from cosyvoice_cpu.server.process import ServerProcess, free_port

TEXT = "Good morning. The pump on line three is running hot."
VOICE = "demo"


def rss_mb(pid: int) -> float:
    """The process ``pid``'s resident memory (MB); an error once it has exited (a dead server is no measurement)."""
    rss = status_mb("VmRSS", pid)
    if rss is None:
        raise RuntimeError(f"process {pid} has no resident memory to read: it has exited")
    return rss


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


async def first_audio(port: int, streamed: bool) -> float:
    """Seconds to the first audio-chunk; the connection is closed then (the synthesis is cancelled)."""
    async with AsyncTcpClient("127.0.0.1", port, read_timeout=300) as c:
        voice = SynthesizeVoice(name=VOICE)
        t0 = time.perf_counter()
        if streamed:  # the text word by word, as a language model writes it, then the end of the stream
            await c.write_event(SynthesizeStart(voice=voice).event())
            t0 = time.perf_counter()
            for word in TEXT.split(" "):
                await c.write_event(SynthesizeChunk(text=word + " ").event())
            await c.write_event(SynthesizeStop().event())
        else:
            await c.write_event(Synthesize(text=TEXT, voice=voice).event())
        while (event := await c.read_event()) is not None:
            if event.type == "audio-chunk":
                return time.perf_counter() - t0
            if event.type == "error":
                raise RuntimeError(event.data)
        raise RuntimeError("the connection closed before any audio")


def speak_http(url: str) -> None:
    body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm"}
    with httpx.Client(base_url=url, timeout=300) as c, c.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        next(r.iter_bytes())  # the first audio, then hang up


def add_voice(url: str) -> None:
    files = {"file": ("p.wav", _tone_wav(), "audio/wav")}
    r = httpx.post(url + "/v1/audio/voices", files=files, data={"name": VOICE, "prompt_text": "Good morning everyone."})
    r.raise_for_status()


def start_wyoming(model: Path, voices: Path, port: int, threads: int, log: Path) -> subprocess.Popen:
    uri = f"tcp://127.0.0.1:{port}"
    args = ["wyoming", "-m", str(model), "--voices", str(voices), "--uri", uri, "--threads", str(threads)]
    cmd = [sys.executable, "-m", "cosyvoice_cpu", "-v", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    while "Wyoming server on" not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.2)
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--unload-after", type=float, default=5.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out: dict[str, Any] = {"model": str(args.model), "threads": args.threads, "cpu": cpu_name(),
                           "unload_after_s": args.unload_after}  # fmt: skip
    out["cores"] = os.cpu_count()
    root = Path(tempfile.mkdtemp(prefix="wyoming-bench-"))
    threads = ("--threads", str(args.threads))

    # one process: HTTP + Wyoming on one engine
    port = free_port()
    wyoming = ("--wyoming", f"tcp://127.0.0.1:{port}")
    both = ServerProcess.start(args.model, root / "v1", *threads, *wyoming, log=root / "both.log", timeout=300)
    try:
        add_voice(both.url)
        speak_http(both.url)
        for streamed in (False, True):  # warm-up, then 3 measured
            asyncio.run(first_audio(port, streamed))
            times = [asyncio.run(first_audio(port, streamed)) for _ in range(3)]
            out[f"first_audio_{'streamed' if streamed else 'one_shot'}_s"] = round(statistics.median(times), 3)
        out["rss_one_process_mb"] = round(rss_mb(both.proc.pid), 1)
    finally:
        both.stop()

    # two processes: serve, and wyoming beside it, on the same model and voices
    http = ServerProcess.start(args.model, root / "v2", *threads, log=root / "http.log", timeout=300)
    add_voice(http.url)
    port = free_port()
    wy = start_wyoming(args.model, root / "v2", port, args.threads, root / "wy.log")
    try:
        speak_http(http.url)
        asyncio.run(first_audio(port, False))
        asyncio.run(first_audio(port, True))
        out["rss_two_processes_mb"] = round(rss_mb(http.proc.pid) + rss_mb(wy.pid), 1)
    finally:
        http.stop()
        wy.terminate()
        wy.wait(30)

    # --unload-after
    port = free_port()
    flags = ("--wyoming", f"tcp://127.0.0.1:{port}", "--unload-after", str(args.unload_after))
    srv = ServerProcess.start(args.model, root / "v1", *threads, *flags, log=root / "unload.log", timeout=300)
    try:
        asyncio.run(first_audio(port, False))
        out["rss_after_synthesis_mb"] = round(rss_mb(srv.proc.pid), 1)
        deadline = time.monotonic() + args.unload_after + 60
        while httpx.get(srv.url + "/health").json()["engine_loaded"]:
            assert time.monotonic() < deadline, "not released"
            time.sleep(0.2)
        time.sleep(2)
        out["rss_idle_unloaded_mb"] = round(rss_mb(srv.proc.pid), 1)
        out["first_audio_after_unload_s"] = round(asyncio.run(first_audio(port, False)), 3)
        out["rss_reloaded_mb"] = round(rss_mb(srv.proc.pid), 1)
    finally:
        srv.stop()
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.engine import Engine

    t0 = time.perf_counter()  # what a reload costs: the engine's load, here in this process
    Engine.load(args.model, EngineConfig(threads=args.threads)).close()
    out["engine_load_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
