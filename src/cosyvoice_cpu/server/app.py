"""The ASGI app: ``create_app(engine, settings)`` -> FastAPI with the OpenAI speech API, voices, health, metrics.

Endpoints (``docs/server.md``): ``POST /v1/audio/speech``, ``GET /v1/models``, ``GET/POST /v1/audio/voices``,
``DELETE /v1/audio/voices/{name}``, ``GET /health``, ``GET /metrics``, and the web page at ``/``. Every error is a
JSON body ``{"error": {"message", "type", "code"}}`` with a 4xx/5xx status; a failing request never takes the
server down. With an API key set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from cosyvoice_cpu.config import SynthesisConfig, need
from cosyvoice_cpu.errors import CosyVoiceCpuError
from cosyvoice_cpu.server.metrics import Metrics
from cosyvoice_cpu.server.speech import Admission, Rejected, StreamAborted
from cosyvoice_cpu.server.voices import VoiceExistsError, VoiceNotFoundError, VoiceStore

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """How the server behaves (``cosyvoice-cpu serve`` flags).

    Attributes:
        voices_dir: saved voices (``NAME.npz``), shared with ``cosyvoice-cpu voice``.
        model_id: the id of the loaded model in ``/v1/models`` (default: the model directory's name).
        api_key: when set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <api_key>``.
        max_active: syntheses run at once (their LM steps are batched); max_queue: more wait, then 429.
        timeout: seconds a synthesis may run before it is stopped (504, or the stream ends).
        max_input_chars: longest ``input`` text; max_upload_mb: largest voice upload.
        defaults: the synthesis settings a request starts from.
    """

    voices_dir: Path
    model_id: str = ""
    api_key: str | None = None
    max_active: int = 8
    max_queue: int = 32
    timeout: float = 300.0
    max_input_chars: int = 4096
    max_upload_mb: float = 20.0
    defaults: SynthesisConfig = field(default_factory=SynthesisConfig)

    def validate(self) -> ServerSettings:
        checks = [
            (1 <= self.max_active <= 256, "max_active", "1 to 256"),
            (0 <= self.max_queue <= 10_000, "max_queue", "0 to 10000"),
            (0 < self.timeout <= 86_400, "timeout", "above 0, at most 86400 seconds"),
            (1 <= self.max_input_chars <= 1_000_000, "max_input_chars", "1 to 1000000"),
            (0 < self.max_upload_mb <= 1024, "max_upload_mb", "above 0, at most 1024"),
        ]
        for ok, name, rule in checks:
            need(ok, f"server setting {name}", getattr(self, name), rule)
        self.defaults.validate()
        return self


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers


class State:
    """What the handlers share: engine, settings, voices, metrics, admission, the worker pool."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.model_id = settings.model_id or Path(engine.model_dir).name
        builtin = engine.builtin_voices() if hasattr(engine, "builtin_voices") else {}  # CosyVoice-300M-SFT speakers
        self.voices = VoiceStore(settings.voices_dir, engine.manifest.family, engine.sample_rate, builtin)
        self.metrics = Metrics()
        self.admission: Admission | None = None  # made inside the event loop (lifespan)
        self.executor = ThreadPoolExecutor(settings.max_active, thread_name_prefix="synth")
        self.voice_lock: asyncio.Lock | None = None  # voices are made one at a time (made in the lifespan)
        self.started = time.time()
        self.jobs: set[Any] = set()  # running syntheses (server.speech.Job), cancelled at shutdown


class ApiKeyMiddleware:
    """Plain ASGI middleware: ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <key>``.

    Not Starlette's ``BaseHTTPMiddleware``, which re-streams responses: it ended a speech stream that failed half
    way cleanly (the client could not tell truncated audio from complete audio) and hid client disconnects. The
    path checked is the routed one (``scope["path"]``), never one rebuilt from the Host header.
    """

    def __init__(self, app: Any, key: str, metrics: Metrics, reject: Any) -> None:
        self.app, self.metrics, self.reject = app, metrics, reject
        self.want = f"Bearer {key}".encode("utf-8", "replace")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1/") or path == "/metrics"):
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.want):
                self.metrics.count(endpoint_label(path), "bad_request")
                await self.reject()(scope, receive, send)
                return
        await self.app(scope, receive, send)


ENDPOINTS = ("/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/health", "/metrics", "/")


def endpoint_label(path: str) -> str:
    """A bounded metrics label for a request path: the endpoint it is for, or ``other`` (never the raw path,
    which a client could vary without end)."""
    return next((e for e in ENDPOINTS if path == e or (e != "/" and path.startswith(e + "/"))), "other")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def create_app(engine: Any, settings: ServerSettings) -> Any:
    """The FastAPI app serving ``engine`` (an :class:`~cosyvoice_cpu.engine.Engine`, or any object with its
    ``synthesize``/``make_voice``/``manifest``/``sample_rate``/``model_dir``) with ``settings``."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
        from starlette.exceptions import HTTPException as StarletteHTTPException
    except ImportError as e:
        from cosyvoice_cpu.errors import MissingExtraError

        raise MissingExtraError("the server needs the [server] extra: pip install 'cosyvoice-cpu[server]'") from e
    from cosyvoice_cpu.server import routes

    settings.validate()
    state = State(engine, settings)
    m = state.metrics
    m.gauges["cosyvoice_process_resident_memory_bytes"] = ("Resident memory of the server process.", _rss_bytes)
    m.gauges["cosyvoice_requests_active"] = ("Syntheses running.", lambda: state.admission.active)
    m.gauges["cosyvoice_requests_queued"] = ("Syntheses waiting for a worker.", lambda: state.admission.waiting)
    m.gauges["cosyvoice_voices"] = ("Saved voices served.", lambda: len(state.voices))
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None:
        s = scheduler.stats
        m.batch_sizes = lambda: dict(s.batch_sizes)
        m.lm_counters = lambda: {"tokens_total": s.tokens, "decode_steps_total": s.decode_steps,
                                 "tokens_per_second": s.tokens_per_second}  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: Any):
        state.admission = Admission(settings.max_active, settings.max_queue)
        state.voice_lock = asyncio.Lock()
        logger.info("serving %s (%d voices) with %d workers", state.model_id, len(state.voices), settings.max_active)
        yield
        state.admission.draining = True
        for job in list(state.jobs):  # running syntheses stop at their next token instead of holding the exit
            job.cancel.set()
        state.executor.shutdown(wait=False)

    app = FastAPI(title="cosyvoice-cpu", version=_version(), lifespan=lifespan)
    app.state.cosyvoice = state

    def error_response(status: int, message: str, kind: str, code: str | None = None,
                       headers: dict[str, str] | None = None) -> Any:  # fmt: skip
        return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Any:
        return error_response(e.status, str(e), e.kind, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Any:  # unknown paths, wrong methods
        what = f"no endpoint {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(e.status_code, f"{what} (see /docs for the API)", "invalid_request_error",
                              headers=getattr(e, "headers", None))  # fmt: skip

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, e: Rejected) -> Any:
        m.count(endpoint_label(request.scope["path"]), "rejected")
        return error_response(e.status, str(e), "server_busy" if e.status == 429 else "unavailable",
                              headers={"Retry-After": str(e.retry_after)})  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Any:
        m.count(endpoint_label(request.scope["path"]), "bad_request")
        problems = []
        for err in e.errors()[:5]:
            if err.get("type") == "json_invalid":
                problems.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        return error_response(400, "invalid request: " + "; ".join(problems), "invalid_request_error")

    @app.exception_handler(CosyVoiceCpuError)
    async def _config(request: Request, e: CosyVoiceCpuError) -> Any:
        m.count(endpoint_label(request.scope["path"]), "bad_request")
        return error_response(400, str(e), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> Any:
        if isinstance(e, StreamAborted):  # a speech stream cut after its status line: counted, logged, answered
            raise e
        logger.exception("%s %s failed", request.method, request.url.path)
        m.count(endpoint_label(request.scope["path"]), "error")
        return error_response(500, f"internal error ({type(e).__name__}); the server keeps running", "server_error")

    if settings.api_key:
        message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
        reject = lambda: error_response(401, message, "authentication_error", "invalid_api_key")  # noqa: E731
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, metrics=m, reject=reject)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> Any:
        return HTMLResponse(resources.files("cosyvoice_cpu.server").joinpath("static/index.html").read_text("utf-8"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        adm = state.admission
        return {"status": "draining" if adm.draining else "ok", "model": state.model_id,
                "family": engine.manifest.family, "sample_rate": engine.sample_rate,
                "rss_mb": round(_rss_bytes() / 2**20, 1), "active": adm.active, "queued": adm.waiting,
                "voices": len(state.voices), "uptime_s": round(time.time() - state.started, 1)}  # fmt: skip

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Any:
        return PlainTextResponse(m.render(), media_type="text/plain; version=0.0.4")

    routes.add_routes(app, state, ApiError, VoiceExistsError, VoiceNotFoundError)
    return app


def _version() -> str:
    from cosyvoice_cpu import __version__

    return __version__
