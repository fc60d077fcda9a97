"""The runtime sub-commands of ``cosyvoice-cpu``: ``say`` and ``voice add|list|rm`` (no torch needed).

Saved voices live in ``--voices DIR`` (default ``$COSYVOICE_CPU_VOICES`` or ``~/.cache/cosyvoice-cpu/voices``) as
``NAME.npz``, written atomically.
"""

from __future__ import annotations

import argparse
import codecs
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cosyvoice_cpu.backends.plan import describe
from cosyvoice_cpu.cli.common import add_backend_args, backend_options
from cosyvoice_cpu.errors import ConfigError

if TYPE_CHECKING:
    from cosyvoice_cpu.config import SynthesisConfig
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)


def voices_dir(arg: Path | None) -> Path:
    if arg is not None:
        return arg
    env = os.environ.get("COSYVOICE_CPU_VOICES")
    return Path(env) if env else Path.home() / ".cache" / "cosyvoice-cpu" / "voices"


def _voice_path(directory: Path, name: str) -> Path:
    from cosyvoice_cpu.voices.voice import check_name

    return directory / f"{check_name(name)}.npz"


def _engine(args: argparse.Namespace, compile_ahead: bool = True) -> Engine:
    """The engine a command asked for; use it as a context manager (closed on every way out of the command)."""
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.engine import Engine

    # the chunk-causal estimator (~100 MB at full size, int8) only when streaming
    stream = getattr(args, "stream", False)
    return Engine.load(
        args.model,
        EngineConfig(
            threads=args.threads,
            streaming_estimator=stream,
            compile_ahead=compile_ahead,
            **backend_options(args),
        ),
    )


def cmd_voice(args: argparse.Namespace) -> int:
    from cosyvoice_cpu.voices.voice import Voice, VoiceError

    directory = voices_dir(args.voices)
    if args.action == "list" and args.name:
        raise ConfigError(f"voice list takes no NAME (got {args.name!r}); use `voice add NAME` or `voice rm NAME`")
    if args.action != "list" and not args.name:
        raise ConfigError(f"voice {args.action} needs a NAME: cosyvoice-cpu voice {args.action} NAME [options]")
    if args.action == "list":
        for path in sorted(directory.glob("*.npz")) if directory.is_dir() else []:
            try:
                v = Voice.load(path)
                print(f"{v.name}\t{v.family}\t{v.duration:.1f} s\t{v.prompt_text or '(cross-lingual)'}")
            except VoiceError as e:
                print(f"{path.stem}\tUNREADABLE\t{e}")
        return 0
    path = _voice_path(directory, args.name)
    if args.action == "rm":
        if not path.is_file():
            raise VoiceError(f"no voice named {args.name!r} in {directory}")
        path.unlink()
        print(f"removed voice {args.name!r}")
        return 0
    if args.model is None or args.prompt_wav is None:
        raise ConfigError("voice add needs -m MODEL_DIR and --prompt-wav FILE (and --prompt-text TRANSCRIPT)")
    if path.exists() and not args.force:
        raise VoiceError(f"voice {args.name!r} already exists in {directory}; pass --force to replace it")
    with _engine(args, compile_ahead=False) as engine:  # makes a voice only: no flow estimator compile
        voice = engine.make_voice(args.prompt_wav, args.prompt_text or "", name=args.name)
    voice.save(path)
    print(f"saved voice {args.name!r} ({voice.duration:.1f} s prompt) to {path}")
    return 0


def _stdin_pieces() -> Iterator[str]:
    """Standard input as it arrives (no waiting for a line or EOF), decoded as UTF-8 across read boundaries."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    fd = sys.stdin.fileno()
    try:
        while data := os.read(fd, 4096):
            if text := decoder.decode(data):
                yield text
        if tail := decoder.decode(b"", final=True):
            yield tail
    except UnicodeDecodeError as e:
        raise ConfigError(f"standard input is not UTF-8 text ({e.reason} at byte {e.start}); pipe UTF-8") from e


def _texts(args: argparse.Namespace) -> Iterator[str | Iterator[str]]:
    """The argument text, or standard input read lazily, one utterance per non-empty line (cmd_say has already
    refused an interactive terminal); with ``--text-stream`` standard input as one text stream."""
    if args.text_stream:
        yield iter(args.text) if args.text else _stdin_pieces()
        return
    if args.text:
        yield " ".join(args.text)
        return
    for line in sys.stdin:
        if line.strip():
            yield line.strip()


def cmd_say(args: argparse.Namespace) -> int:
    from cosyvoice_cpu.config import SynthesisConfig
    from cosyvoice_cpu.voices.voice import Voice

    config = SynthesisConfig(
        seed=args.seed,
        flow_steps=args.flow_steps,
        cfg_rate=args.cfg_rate,
        speed=args.speed,
        normalize=not args.no_normalize,
        stream=args.stream,
        first_chunk_tokens=args.first_chunk_tokens,
    ).validate()
    if not args.text and sys.stdin.isatty():
        raise ConfigError("give the text as an argument or on standard input")
    if args.voice and args.prompt_wav:
        raise ConfigError("give either --voice NAME or --prompt-wav FILE, not both")
    voice = None
    if args.voice:
        path = _voice_path(voices_dir(args.voices), args.voice)
        voice = Voice.load(path) if path.is_file() else None
    elif not args.prompt_wav:
        raise ConfigError(
            "give --voice NAME or --prompt-wav FILE [--prompt-text T]: a saved voice, a built-in "
            "speaker (CosyVoice-300M-SFT: 中文女 ...), or prompt audio to clone"
        )
    with _engine(args) as engine:
        return _say(args, engine, config, voice)


def _say(args: argparse.Namespace, engine: Engine, config: SynthesisConfig, voice: Voice | None) -> int:
    """``say`` on a loaded engine: the voice (saved, built-in or from prompt audio), then every text."""
    from cosyvoice_cpu.engine import Timings

    if args.voice and voice is None:  # not saved: a built-in speaker of the model?
        path = _voice_path(voices_dir(args.voices), args.voice)
        builtin = engine.builtin_voices()
        if args.voice not in builtin:
            extra = f"; built-in speakers of this model: {', '.join(builtin)}" if builtin else ""
            raise ConfigError(
                f"no voice named {args.voice!r} in {path.parent}; add it with `cosyvoice-cpu voice add`{extra}"
            )
        voice = builtin[args.voice]
    if args.prompt_wav:
        voice = engine.make_voice(args.prompt_wav, args.prompt_text or "", name="prompt")
    to_stdout = str(args.out) == "-"
    pieces: list[np.ndarray] = []
    t0 = time.perf_counter()
    timings = Timings()
    failed = chunks = 0
    for text in _texts(args):
        try:
            for chunk in engine.synthesize(text, voice, config, instruct=args.instruct, timings=timings):
                if to_stdout:
                    sys.stdout.buffer.write(chunk.pcm16())
                    sys.stdout.buffer.flush()
                else:
                    pieces.append(chunk.samples)
                elapsed = time.perf_counter() - t0
                chunks += 1
                if not args.stream or chunk.final or chunks == 1:  # streamed: the first and the last chunk
                    print(f"[{elapsed:6.1f}s] {chunk.duration:5.1f} s of audio: {chunk.text[:60]}", file=sys.stderr)
        except ConfigError as e:  # one bad line does not lose the others
            if args.text or args.text_stream:
                raise
            failed += 1
            print(f"skipped {str(text)[:40]!r}: {e}", file=sys.stderr)
    if not pieces and not to_stdout:
        raise ConfigError("nothing was synthesized: every input line was skipped")
    total = time.perf_counter() - t0
    if not to_stdout:
        from cosyvoice_cpu.audio import write_wav

        write_wav(args.out, np.concatenate(pieces), engine.sample_rate)
    rtf = total / timings.audio if timings.audio else float("nan")
    first = f", first audio after {timings.first_audio:.2f} s" if timings.first_audio is not None else ""
    print(
        f"{timings.audio:.1f} s of audio in {chunks} chunks in {total:.1f} s (RTF {rtf:.2f}{first}; LM "
        f"{timings.lm:.1f} s for {timings.tokens} tokens, flow {timings.flow:.1f} s, vocoder "
        f"{timings.vocoder:.1f} s){'' if to_stdout else f' -> {args.out}'}",
        file=sys.stderr,
    )
    return 1 if failed else 0


DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"


def _tone_wav(seconds: float = 3.0, sr: int = 16000, pitch: float = 170.0) -> bytes:
    """A synthetic 'voice' (a vibrato tone at ``pitch`` Hz with a little noise) as wav bytes: the demo needs no
    recording."""
    import io

    import soundfile as sf

    t = np.arange(int(sr * seconds)) / sr
    rng = np.random.default_rng(0)
    vibrato = 1 + 0.05 * np.sin(2 * np.pi * 3 * t)
    wave = 0.3 * np.sin(2 * np.pi * pitch * t * vibrato) + 0.01 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def demo_runtime(args: argparse.Namespace) -> int:
    """`demo` on the torch-free runtime: the packaged demo model (or -m DIR), a synthetic voice, stage timings."""
    from cosyvoice_cpu.audio import write_wav
    from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
    from cosyvoice_cpu.engine import Engine, Timings

    model = Path(args.model) if args.model else DEMO_MODEL
    t0 = time.perf_counter()
    with Engine.load(model, EngineConfig(threads=args.threads, **backend_options(args))) as engine:
        t1 = time.perf_counter()
        voice = engine.make_voice(_tone_wav(), "Good morning everyone.", name="demo")
        t2 = time.perf_counter()
        timings = Timings()
        config = SynthesisConfig(seed=args.seed, flow_steps=args.flow_steps)
        wave = np.concatenate([c.samples for c in engine.synthesize(args.text, voice, config, timings=timings)])
        total = time.perf_counter() - t2
        write_wav(args.out, wave, engine.sample_rate)
        m = engine.manifest
        rate = timings.tokens / timings.lm if timings.lm else float("nan")
        print(f"model   {model} ({m.family}, recipe {m.recipe['name']}, {engine.threads} threads, no torch)")
        for line in describe(engine.plan):
            print(f"backend {line}")
        print(f"load    {(t1 - t0) * 1000:8.1f} ms")
        print(f"voice   {(t2 - t1) * 1000:8.1f} ms  (x-vector, speech tokens, prompt mel of a 3 s prompt)")
        print(f"lm      {timings.lm * 1000:8.1f} ms  {timings.tokens} tokens, {rate:.1f} tokens/s")
        print(f"flow    {timings.flow * 1000:8.1f} ms  {config.flow_steps} Euler steps, CFG {config.cfg_rate}")
        print(f"hift    {timings.vocoder * 1000:8.1f} ms")
        print(f"first   {(timings.first_audio or 0) * 1000:8.1f} ms  to the first audio chunk")
        rtf = total / max(timings.audio, 1e-9)
        print(f"total   {total * 1000:8.1f} ms  for {timings.audio:.2f} s of audio (RTF {rtf:.3f})")
        print(f"wrote   {args.out}")
        return 0


def add_commands(sub: argparse._SubParsersAction, positive: type, non_negative: type) -> None:
    """Register ``say`` and ``voice`` on the main parser's sub-parsers."""
    s = sub.add_parser("say", help="speak text with an exported model (text as arguments or stdin lines)")
    s.add_argument("text", nargs="*", help="text to speak (default: standard input, one utterance per line)")
    s.add_argument("-m", "--model", type=Path, required=True, help="model directory made by `export`")
    s.add_argument("-o", "--out", type=Path, default=Path("out.wav"), help="wav file, or - for raw 16-bit PCM")
    s.add_argument("--voice", help="a saved voice name (see `voice add`)")
    s.add_argument("--prompt-wav", type=Path, help="clone this recording (1-30 s) instead of a saved voice")
    s.add_argument("--prompt-text", help="the transcript of --prompt-wav (omit for cross-lingual)")
    s.add_argument("--instruct", help="an instruction such as 'Speak slowly and happily.' (instruct mode)")
    s.add_argument("--seed", type=non_negative)
    s.add_argument("--speed", type=float, default=1.0)
    s.add_argument("--flow-steps", type=positive, default=10)
    s.add_argument("--cfg-rate", type=float, default=0.7)
    s.add_argument("--no-normalize", action="store_true", help="skip text normalization")
    s.add_argument(
        "--stream",
        action="store_true",
        help="emit audio chunk by chunk as it is decoded (with -o -, playback can start after the first chunk)",
    )
    s.add_argument(
        "--text-stream",
        action="store_true",
        help="speak standard input as it arrives, as one text stream (e.g. an LLM's reply piped in; with --stream "
        "CosyVoice2/3 start speaking after the first words)",
    )
    s.add_argument(
        "--first-chunk-tokens",
        type=positive,
        default=10,
        help="speech tokens in the first streamed chunk (25 = 1 s of audio)",
    )
    s.add_argument("--threads", type=non_negative, default=0, help="ORT threads (default: usable physical cores)")
    s.add_argument("--voices", type=Path, help="saved-voices directory")
    add_backend_args(s)
    s.set_defaults(func=cmd_say)

    v = sub.add_parser("voice", help="manage saved voices: add, list, rm")
    v.add_argument("action", choices=["add", "list", "rm"])
    v.add_argument("name", nargs="?", default="", help="voice name (add, rm)")
    v.add_argument("-m", "--model", type=Path, help="model directory (add)")
    v.add_argument("--prompt-wav", type=Path, help="the recording to clone (add)")
    v.add_argument("--prompt-text", help="its transcript (add; omit for cross-lingual)")
    v.add_argument("--force", action="store_true", help="replace an existing voice (add)")
    v.add_argument("--threads", type=non_negative, default=0)
    v.add_argument("--voices", type=Path, help="saved-voices directory")
    add_backend_args(v)
    v.set_defaults(func=cmd_voice)
