"""``cosyvoice-cpu serve``: load a model directory once and serve the OpenAI-compatible speech API over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from cosyvoice_cpu.errors import MissingExtraError

logger = logging.getLogger(__name__)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise MissingExtraError("serve needs the [server] extra: pip install 'cosyvoice-cpu[server]'") from e
    from cosyvoice_cpu.cli_speech import voices_dir
    from cosyvoice_cpu.config import EngineConfig
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.server.app import ServerSettings, create_app

    settings = ServerSettings(
        voices_dir=voices_dir(args.voices),
        model_id=args.model_id or "",
        api_key=args.api_key or os.environ.get("COSYVOICE_CPU_API_KEY") or None,
        max_active=args.max_active,
        max_queue=args.max_queue,
        timeout=args.timeout,
        max_upload_mb=args.max_upload_mb,
    ).validate()
    rows = args.max_active if args.lm_batch_rows is None else args.lm_batch_rows
    engine = Engine.load(args.model, EngineConfig(threads=args.threads, lm_batch_rows=rows,
                                                  prompt_cache_fp16=args.prompt_cache_fp16))  # fmt: skip
    app = create_app(engine, settings)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)", args.host)
    print(f"serving {engine.model_dir} on http://{args.host}:{args.port} ({settings.max_active} at once, "
          f"voices in {settings.voices_dir})", flush=True)  # fmt: skip
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=10)  # fmt: skip
    try:
        _draining_server(config, app).run()
    finally:
        engine.close()
    return 0


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
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics (or set "
                   "COSYVOICE_CPU_API_KEY)")  # fmt: skip
    s.add_argument("--max-active", type=positive, default=8, help="syntheses at once; their LM steps are batched")
    s.add_argument("--lm-batch-rows", type=non_negative, help="LM rows decoded together (default: --max-active; "
                   "0 = every request decodes alone, for comparisons)")  # fmt: skip
    s.add_argument("--max-queue", type=non_negative, default=32, help="requests waiting beyond that (then 429)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds one synthesis may take")
    s.add_argument("--max-upload-mb", type=float, default=20.0, help="largest voice upload")
    s.add_argument("--threads", type=non_negative, default=0, help="ORT threads (default: usable physical cores)")
    s.add_argument("--prompt-cache-fp16", action="store_true", help="fp32 models: keep each voice's streaming cache in "
                   "float16 (half the memory, mel rel. error 2.6e-3, ~5 %% slower streamed chunks); int8 models "
                   "(the default recipe) do so already")  # fmt: skip
    s.add_argument("--voices", type=Path, help="saved-voices directory (shared with `cosyvoice-cpu voice`)")
    s.add_argument("--model-id", help="model id in /v1/models (default: the model directory's name)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
