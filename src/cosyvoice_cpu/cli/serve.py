"""``cosyvoice-cpu serve``: load a model directory once and serve the OpenAI-compatible speech API over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

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
from cosyvoice_cpu.errors import ConfigError, MissingExtraError

logger = logging.getLogger(__name__)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise MissingExtraError("serve needs the [server] extra: pip install 'cosyvoice-cpu[server]'") from e
    from cosyvoice_cpu.cli.speech import voices_dir
    from cosyvoice_cpu.server.app import ServerSettings, create_app

    settings = ServerSettings(
        voices_dir=voices_dir(args.voices),
        model_id=args.model_id or "",
        api_key=args.api_key or os.environ.get("COSYVOICE_CPU_API_KEY") or None,
        max_active=args.max_active,
        max_queue=args.max_queue,
        timeout=args.timeout,
        max_input_chars=args.max_input_chars,
        max_instructions_chars=args.max_instructions_chars,
        max_prompt_chars=args.max_prompt_chars,
        max_upload_mb=args.max_upload_mb,
        host=args.host,
        allow_hosts=tuple(args.allow_host or ()),
        allow_origins=tuple(args.allow_origin or ()),
        default_voice=args.default_voice,
        body_timeout=args.body_timeout,
        stream_idle_timeout=args.stream_idle_timeout,
        max_audio_seconds=args.max_audio_seconds,
        max_audio_per_char=args.max_audio_per_char,
        defaults=synthesis_defaults(args),
    ).validate()
    rows = args.max_active if args.lm_batch_rows is None else args.lm_batch_rows
    engine_config = server_engine_config(args, rows)
    if args.replicas != 1 or args.ray_address:
        if args.unload_after is not None:
            raise ConfigError("--unload-after is for the one serving process: not with --replicas or --ray-address")
        if args.wyoming:
            raise ConfigError("--wyoming runs in the one serving process: not with --replicas or --ray-address")
        return _serve_replicas(args, settings, engine_config)
    wyoming = None
    if args.wyoming:  # checked before the model loads
        from cosyvoice_cpu.cli.wyoming import wyoming_options
        from cosyvoice_cpu.server.wyoming import need_wyoming

        need_wyoming()
        wyoming = wyoming_options(args, args.wyoming).validate(settings.max_input_chars)
        if wyoming.scheme == "stdio":
            raise ConfigError("serve --wyoming takes tcp:// or unix:// (stdio:// is for `cosyvoice-cpu wyoming`)")
    engine = load_engine(args, engine_config)
    app = create_app(engine, settings)
    if wyoming is not None:
        from cosyvoice_cpu.server.wyoming import WyomingService

        state = app.state.cosyvoice
        state.services.append(WyomingService(state, wyoming))  # started and stopped by the app's lifespan
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)", args.host)
    print(
        f"serving {engine.model_dir} on http://{args.host}:{args.port} ({settings.max_active} at once, "
        f"voices in {settings.voices_dir})",
        flush=True,
    )
    from cosyvoice_cpu.hardware.cpu import detect
    from cosyvoice_cpu.hardware.pools import pool_lines
    from cosyvoice_cpu.server.protocol import timed_protocol

    split = engine_config.split_rows
    for line in pool_lines(engine.threads, rows, detect().usable_cores, settings.max_active, split):
        logger.info("thread pools: %s", line)  # the server's synthesis threads beside the engine's (doctor: none)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=args.keep_alive_timeout,
        http=timed_protocol(args.header_timeout),
        ws_max_size=settings.max_message_bytes,  # a bigger WebSocket message is refused (1009) before it is read
    )
    try:
        _draining_server(config, app).run()
    finally:
        engine.close()
    return 0


def _serve_replicas(args: argparse.Namespace, settings: object, engine_config: object) -> int:
    """``--replicas N|auto`` (or ``--ray-address``): the same app as replicas on Ray Serve (the [ray] extra)."""
    import dataclasses

    from cosyvoice_cpu.server.replicas import ReplicaPlan, serve_replicas

    threads = args.threads or 1  # Ray reserves CPUs but pins no affinity: each replica's threads are explicit
    if not args.threads:
        logger.info("--threads not given: 1 ORT thread per replica (Ray reserves 1 CPU for each)")
    settings = dataclasses.replace(settings, voices_dir=settings.voices_dir.resolve())  # replicas start elsewhere
    plan = ReplicaPlan(
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing=args.target_ongoing,
        threads=threads,
        ray_address=args.ray_address,
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        host=args.host,
        port=args.port,
        max_ongoing=settings.max_active + settings.max_queue,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)", args.host)
    if (args.header_timeout, args.keep_alive_timeout) != (10.0, 5.0):
        logger.warning(
            "--header-timeout and --keep-alive-timeout are not applied under --replicas: Serve's proxy "
            "reads the requests (--body-timeout is, in each replica)"
        )
    return serve_replicas(args.model.resolve(), settings, dataclasses.replace(engine_config, threads=threads), plan)


def _replicas(value: str) -> int | None:
    """``--replicas``: a count of at least 1, or ``auto`` (None: Serve's autoscaling)."""
    if value.strip().lower() == "auto":
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"takes a count of at least 1 or 'auto', not {value!r}")
    return int(value)


def _draining_server(config: object, app: object) -> object:
    """A uvicorn server that, at SIGTERM/SIGINT, makes the app answer new speech requests with 503 while the
    running ones finish (the graceful window), instead of only after that window."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            admission = app.state.cosyvoice.admission
            if admission is not None:
                admission.draining = True
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def add_parser(sub: argparse._SubParsersAction, positive: type, non_negative: type) -> None:
    """Register ``serve``."""
    s = sub.add_parser("serve", help="serve the OpenAI-compatible speech API (needs the [server] extra)")
    s.add_argument("-m", "--model", type=Path, required=True, help="model directory made by `export`")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics (or set COSYVOICE_CPU_API_KEY)"
    )
    s.add_argument("--max-active", type=positive, default=8, help="syntheses at once; their LM steps are batched")
    s.add_argument(
        "--lm-batch-rows",
        type=non_negative,
        help="LM rows decoded together (default: --max-active; 0 = every request decodes alone, for comparisons)",
    )
    s.add_argument("--max-queue", type=non_negative, default=32, help="requests waiting beyond that (then 429)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds one synthesis may take")
    s.add_argument(
        "--header-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds a client may take "
        "to send a request's line and headers (from the connection's start, or the first byte of a "
        "next request on a kept-alive one); then 408 and the connection is closed (default 10)",
    )
    s.add_argument(
        "--body-timeout",
        type=seconds,
        default=60.0,
        metavar="S",
        help="seconds a request body may "
        "take to arrive after its headers; then 408 and the connection is closed (default 60)",
    )
    s.add_argument(
        "--stream-idle-timeout",
        type=seconds,
        default=30.0,
        metavar="S",
        help="seconds a text stream WebSocket (/v1/audio/speech/stream) may send no message while no audio is "
        "sent to it; then it is closed with 4408 and its work cancelled (default 30)",
    )
    s.add_argument(
        "--keep-alive-timeout",
        type=seconds,
        default=5.0,
        metavar="S",
        help="seconds an idle kept-alive connection stays open (uvicorn's timeout_keep_alive; default 5)",
    )
    s.add_argument("--max-upload-mb", type=float, default=20.0, help="largest voice upload")
    s.add_argument("--max-input-chars", type=positive, default=4096, help="longest speech input (characters)")
    s.add_argument("--max-instructions-chars", type=positive, default=1000, help="longest speech instructions")
    s.add_argument(
        "--max-audio-seconds",
        type=seconds,
        default=1200.0,
        metavar="S",
        help="the most audio one request may produce (default 1200); beyond, it is stopped (422 audio_too_long)",
    )
    s.add_argument(
        "--max-audio-per-char",
        type=seconds,
        default=0.6,
        metavar="S",
        help="the most audio per input "
        "character, plus 10 s, divided by the speed (default 0.6: about twice slow Chinese speech); a "
        "model that does not stop is cut there",
    )
    s.add_argument("--max-prompt-chars", type=positive, default=1000, help="longest voice transcript (prompt_text)")
    s.add_argument(
        "--default-voice",
        metavar="NAME",
        help="the saved voice that OpenAI's voice names (alloy, ash, "
        "coral, ...) speak with; without it they are refused with a 400 that says so",
    )
    s.add_argument(
        "--allow-host",
        action="append",
        metavar="NAME",
        help="also serve requests whose Host header "
        "names NAME (repeatable; '*' for any): the bind address, localhost and, bound to 0.0.0.0, any IP "
        "address are served; other names are refused (DNS rebinding)",
    )
    s.add_argument(
        "--allow-origin",
        action="append",
        metavar="ORIGIN",
        help="let browser pages of ORIGIN (e.g. "
        "http://localhost:3000; repeatable; '*' for any) send POST/DELETE requests, with CORS; pages "
        "of other sites are refused (403)",
    )
    s.add_argument("--threads", type=non_negative, default=0, help="ORT threads (default: usable physical cores)")
    add_backend_args(s)
    add_prompt_cache_flags(s)
    add_synthesis_flags(s)
    s.add_argument("--voices", type=Path, help="saved-voices directory (shared with `cosyvoice-cpu voice`)")
    s.add_argument("--model-id", help="model id in /v1/models (default: the model directory's name)")
    add_unload_flag(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    w = s.add_argument_group("the Wyoming protocol beside the HTTP API (the [wyoming] extra; docs/wyoming.md)")
    w.add_argument(
        "--wyoming",
        metavar="URI",
        help="also serve the Wyoming protocol (Home Assistant) on tcp://HOST:PORT or unix://PATH, on the same "
        "engine, voices and --max-active/--max-queue",
    )
    from cosyvoice_cpu.cli.wyoming import add_wyoming_flags

    add_wyoming_flags(w, positive)
    r = s.add_argument_group("replicas on Ray Serve (the [ray] extra; docs/deploy.md)")
    r.add_argument(
        "--replicas",
        type=_replicas,
        default=1,
        metavar="N|auto",
        help="run the app as N replicas on "
        "Ray Serve, each with its own engine of --threads threads (default 1: this process, no Ray); "
        "'auto': Serve's autoscaling on ongoing requests, --min-replicas to --max-replicas",
    )
    r.add_argument("--min-replicas", type=positive, default=1, help="--replicas auto: fewest replicas")
    r.add_argument("--max-replicas", type=positive, default=4, help="--replicas auto: most replicas")
    r.add_argument(
        "--target-ongoing",
        type=float,
        default=2.0,
        help="--replicas auto: requests in flight per replica that Serve's autoscaler aims at",
    )
    r.add_argument(
        "--upscale-delay",
        type=float,
        default=30.0,
        metavar="S",
        help="--replicas auto: seconds the load must stay above the target before Serve adds a replica (default 30)",
    )
    r.add_argument(
        "--downscale-delay",
        type=float,
        default=600.0,
        metavar="S",
        help="--replicas auto: seconds "
        "the load must stay below the target before Serve removes a replica (default 600)",
    )
    r.add_argument(
        "--ray-address",
        help="join this Ray cluster (e.g. HEAD:6379 or ray://HEAD:10001) instead of "
        "starting a local instance; every node needs cosyvoice-cpu, the model at the same path, and "
        "--voices on a shared filesystem",
    )
    s.set_defaults(func=cmd_serve)
