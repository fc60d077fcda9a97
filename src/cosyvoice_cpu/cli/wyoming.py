"""``cosyvoice-cpu wyoming``: the Wyoming protocol server (Home Assistant) alone, and the ``serve --wyoming`` flags
that run it beside the HTTP API on the same engine (docs/wyoming.md)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cosyvoice_cpu.cli.common import (
    add_backend_args,
    add_prompt_cache_flags,
    add_synthesis_flags,
    add_unload_flag,
    load_engine,
    seconds,
    server_engine_config,
    synthesis_defaults,
)

if TYPE_CHECKING:
    from cosyvoice_cpu.server.wyoming import WyomingOptions

logger = logging.getLogger(__name__)

DEFAULT_URI = "tcp://127.0.0.1:10200"


def add_wyoming_flags(p: argparse.ArgumentParser | Any, positive: type) -> None:
    """The flags of the Wyoming server, shared by ``wyoming`` and ``serve --wyoming``."""
    p.add_argument(
        "--samples-per-chunk",
        type=positive,
        default=1024,
        metavar="N",
        help="samples in one audio-chunk event (16-bit mono at the model's rate; default 1024)",
    )
    p.add_argument(
        "--zeroconf",
        nargs="?",
        const="cosyvoice-cpu",
        metavar="NAME",
        help="advertise the Wyoming server as NAME._wyoming._tcp.local. (default name: cosyvoice-cpu) so Home "
        "Assistant discovers it (tcp:// only)",
    )
    p.add_argument(
        "--idle-timeout",
        type=seconds,
        default=60.0,
        metavar="S",
        help="close a Wyoming connection that sends nothing for S seconds while nothing of it runs (default 60)",
    )
    p.add_argument(
        "--max-connections",
        type=positive,
        default=64,
        metavar="N",
        help="Wyoming connections open at once; more get an error event (default 64)",
    )


def wyoming_options(args: argparse.Namespace, uri: str) -> WyomingOptions:
    from cosyvoice_cpu.server.wyoming import WyomingOptions

    return WyomingOptions(
        uri=uri,
        samples_per_chunk=args.samples_per_chunk,
        zeroconf=args.zeroconf,
        idle_timeout=args.idle_timeout,
        max_connections=args.max_connections,
    )


def cmd_wyoming(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from cosyvoice_cpu.server.wyoming import need_wyoming, serve_alone

    need_wyoming()
    from cosyvoice_cpu.cli.speech import voices_dir
    from cosyvoice_cpu.server.app import ServerSettings, State

    settings = ServerSettings(
        voices_dir=voices_dir(args.voices),
        model_id=args.model_id or "",
        max_active=args.max_active,
        max_queue=args.max_queue,
        timeout=args.timeout,
        max_input_chars=args.max_input_chars,
        default_voice=args.default_voice,
        max_audio_seconds=args.max_audio_seconds,
        max_audio_per_char=args.max_audio_per_char,
        defaults=synthesis_defaults(args),
    ).validate()
    options = wyoming_options(args, args.uri).validate(settings.max_input_chars)
    engine = load_engine(args, server_engine_config(args, args.max_active))
    try:
        state = State(engine, settings)
        banner = f"Wyoming server for {engine.model_dir} on {options.uri} ({settings.max_active} at once, "
        print(banner + f"voices in {settings.voices_dir})", file=sys.stderr, flush=True)  # stdout: stdio://
        asyncio.run(serve_alone(state, options))
    finally:
        engine.close()
    return 0


def add_parser(sub: argparse._SubParsersAction, positive: type, non_negative: type) -> None:
    """Register ``wyoming``."""
    s = sub.add_parser("wyoming", help="serve the Wyoming protocol for Home Assistant (needs the [wyoming] extra)")
    s.add_argument("-m", "--model", type=Path, required=True, help="model directory made by `export`")
    s.add_argument(
        "--uri",
        default=DEFAULT_URI,
        help=f"where to listen: tcp://HOST:PORT, unix://PATH or stdio:// (default {DEFAULT_URI}; "
        "tcp://0.0.0.0:10200 for Home Assistant on another machine)",
    )
    s.add_argument("--voices", type=Path, help="saved-voices directory (shared with `cosyvoice-cpu voice`)")
    s.add_argument(
        "--default-voice",
        metavar="NAME",
        help="the saved voice spoken when a request names none, or an unknown one (without it: the first "
        "voice, and an error for unknown names)",
    )
    s.add_argument("--max-active", type=positive, default=2, help="syntheses at once (default 2)")
    s.add_argument("--max-queue", type=non_negative, default=8, help="requests waiting beyond that (then an error)")
    s.add_argument("--timeout", type=seconds, default=300.0, help="seconds one synthesis may take")
    s.add_argument("--max-input-chars", type=positive, default=4096, help="longest text of one request")
    s.add_argument("--max-audio-seconds", type=seconds, default=1200.0, metavar="S", help="most audio per request")
    s.add_argument(
        "--max-audio-per-char", type=seconds, default=0.6, metavar="S", help="most audio per input character"
    )
    s.add_argument("--threads", type=non_negative, default=0, help="ORT threads (default: usable physical cores)")
    s.add_argument("--model-id", help="the model's name in info (default: the model directory's name)")
    add_backend_args(s)
    add_prompt_cache_flags(s)
    add_synthesis_flags(s)
    add_unload_flag(s)
    add_wyoming_flags(s, positive)
    s.set_defaults(func=cmd_wyoming)
