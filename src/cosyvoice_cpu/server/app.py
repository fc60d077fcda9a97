"""The ASGI app: ``create_app(engine, settings)`` -> FastAPI with the OpenAI speech API, voices, health, metrics.

Endpoints (``docs/server.md``): ``POST /v1/audio/speech``, the text stream WebSocket ``/v1/audio/speech/stream``
(``server.text_ws``), ``GET /v1/models``, ``GET/POST /v1/audio/voices``, ``DELETE /v1/audio/voices/{name}``,
``GET /health``, ``GET /metrics``, the web page at ``/`` and the API reference at ``/docs`` (no external
resources). Every error is a JSON body ``{"error": {"message", "type", "code"}}`` with a
4xx/5xx status (``server.handlers``); a failing request never takes the server down. With an API key set, ``/v1/*``
and ``/metrics`` need ``Authorization: Bearer KEY``; Host and Origin are checked in any case (``server.guard``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cosyvoice_cpu.config import SynthesisConfig, need
from cosyvoice_cpu.server import handlers
from cosyvoice_cpu.server.guard import ApiKeyMiddleware, HostOriginGuard
from cosyvoice_cpu.server.identity import ReplicaHeaderMiddleware, ReplicaInfo
from cosyvoice_cpu.server.metrics import Metrics
from cosyvoice_cpu.server.speech import Admission, AudioBound, Job
from cosyvoice_cpu.server.voices import VoiceStore
from cosyvoice_cpu.voices.voice import check_name

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.server.unload import UnloadingEngine

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
        max_input_chars, max_instructions_chars, max_prompt_chars: longest ``input``, ``instructions`` and voice
            ``prompt_text``; max_upload_mb: largest voice upload.
        host: the address the server is bound to; allow_hosts: more Host header names served (``*``: any);
            allow_origins: more browser origins that may send writes (``server.guard``).
        default_voice: the saved voice OpenAI's voice names (``alloy``, ...) speak with (None: they are refused).
        body_timeout: seconds a request body may take to arrive after its headers (408 beyond).
        max_audio_seconds, max_audio_per_char: the most audio one request may produce, and per input character
            (``server.speech.AudioBound``; 422 ``audio_too_long`` beyond).
        stream_idle_timeout: seconds a text stream's WebSocket (``/v1/audio/speech/stream``) may go without a
            message from its client while no audio is being sent, before it is closed (code 4408).
        defaults: the synthesis settings a request starts from.
    """

    voices_dir: Path
    model_id: str = ""
    api_key: str | None = None
    max_active: int = 8
    max_queue: int = 32
    timeout: float = 300.0
    max_input_chars: int = 4096
    max_instructions_chars: int = 1000
    max_prompt_chars: int = 1000
    max_upload_mb: float = 20.0
    host: str = "127.0.0.1"
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    default_voice: str | None = None
    body_timeout: float = 60.0
    max_audio_seconds: float = 1200.0
    max_audio_per_char: float = 0.6
    stream_idle_timeout: float = 30.0
    defaults: SynthesisConfig = field(default_factory=SynthesisConfig)

    @property
    def audio_bound(self) -> AudioBound:
        """The audio one request may produce (``--max-audio-per-char``, ``--max-audio-seconds``)."""
        return AudioBound(per_char_s=self.max_audio_per_char, max_s=self.max_audio_seconds)

    @property
    def max_body_bytes(self) -> int:
        """The largest JSON body taken (413 beyond): room for the text fields at 12 bytes a character (JSON
        escapes of astral characters), at least 2 MiB, so an over-long field gets the 400 that names it."""
        return max(2 << 20, 12 * (self.max_input_chars + self.max_instructions_chars) + (64 << 10))

    @property
    def max_message_bytes(self) -> int:
        """The largest WebSocket message taken (the connection is closed with 1009 beyond, before the rest of it
        is read): a text stream's start message with the longest instructions, or a text piece of the whole
        input, at 12 bytes a character, plus room for the other fields."""
        return (16 << 10) + 12 * (self.max_input_chars + self.max_instructions_chars)

    def validate(self) -> ServerSettings:
        checks = [
            (1 <= self.max_active <= 256, "max_active", "1 to 256"),
            (0 <= self.max_queue <= 10_000, "max_queue", "0 to 10000"),
            (0 < self.timeout <= 86_400, "timeout", "above 0, at most 86400 seconds"),
            (1 <= self.max_input_chars <= 1_000_000, "max_input_chars", "1 to 1000000"),
            (1 <= self.max_instructions_chars <= 100_000, "max_instructions_chars", "1 to 100000"),
            (1 <= self.max_prompt_chars <= 100_000, "max_prompt_chars", "1 to 100000"),
            (0 < self.max_upload_mb <= 1024, "max_upload_mb", "above 0, at most 1024"),
            (0 < self.body_timeout <= 86_400, "body_timeout", "above 0, at most 86400 seconds"),
            (1 <= self.max_audio_seconds <= 86_400, "max_audio_seconds", "1 to 86400 seconds"),
            (0 < self.max_audio_per_char <= 60, "max_audio_per_char", "above 0, at most 60 seconds"),
            (0 < self.stream_idle_timeout <= 86_400, "stream_idle_timeout", "above 0, at most 86400 seconds"),
        ]
        for ok, name, rule in checks:
            need(ok, f"server setting {name}", getattr(self, name), rule)
        if self.default_voice is not None:  # stored as the server stores voice names (server.checks.voice_name)
            self.default_voice = check_name(unicodedata.normalize("NFKC", self.default_voice))
        self.allow_hosts, self.allow_origins = tuple(self.allow_hosts), tuple(self.allow_origins)
        self.defaults.validate()
        return self


class Service(Protocol):
    """Another server on the app's state (the Wyoming server): started and stopped with the app."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class State:
    """What the handlers share: engine, settings, voices, metrics, admission, the worker pool."""

    def __init__(self, engine: Engine | UnloadingEngine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.model_id = settings.model_id or Path(engine.model_dir).name
        builtin = engine.builtin_voices()  # CosyVoice-300M-SFT speakers ({} for other models)
        self.voices = VoiceStore(settings.voices_dir, engine.manifest.family, engine.sample_rate, builtin)
        self.metrics = Metrics()
        self.admission: Admission | None = None  # made inside the event loop (lifespan)
        self.executor = ThreadPoolExecutor(settings.max_active, thread_name_prefix="synth")
        self.voice_lock: asyncio.Lock | None = None  # voices are made one at a time (made in the lifespan)
        self.started = time.time()
        self.jobs: set[Job] = set()  # running syntheses, cancelled at shutdown
        self.replica = ReplicaInfo()  # which replica answers (create_app sets it)
        self.services: list[Service] = []  # more servers on this state (Wyoming), started and stopped in the lifespan
        self.text_streams = 0  # open text stream WebSockets (server.text_ws)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def create_app(
    engine: Engine | UnloadingEngine, settings: ServerSettings, replica: ReplicaInfo | None = None
) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`~cosyvoice_cpu.engine.Engine`, or any object with its
    ``synthesize``/``make_voice``/``manifest``/``sample_rate``/``model_dir``) with ``settings``; ``replica`` says
    which replica this is (``X-Replica``, ``/health``; default: this host, one replica)."""
    try:
        from fastapi import FastAPI
        from fastapi.responses import HTMLResponse, PlainTextResponse
    except ImportError as e:
        from cosyvoice_cpu.errors import MissingExtraError

        raise MissingExtraError("the server needs the [server] extra: pip install 'cosyvoice-cpu[server]'") from e
    from cosyvoice_cpu.server import openapi, routes, text_ws, voice_routes

    settings.validate()
    state = State(engine, settings)
    state.replica = replica or ReplicaInfo()
    m = state.metrics
    m.gauges["cosyvoice_process_resident_memory_bytes"] = ("Resident memory of the server process.", _rss_bytes)
    m.gauges["cosyvoice_requests_active"] = ("Syntheses running.", lambda: state.admission.active)
    m.gauges["cosyvoice_requests_queued"] = ("Syntheses waiting for a worker.", lambda: state.admission.waiting)
    m.gauges["cosyvoice_voices"] = ("Saved voices served.", lambda: len(state.voices))
    m.gauges["cosyvoice_text_streams_open"] = ("Text stream WebSockets open.", lambda: state.text_streams)
    m.gauges["cosyvoice_lm_rows_active"] = (
        "LM batch rows held by requests (a text stream waiting for text holds one).",
        lambda: 0 if engine.scheduler is None else engine.scheduler.active,
    )
    if engine.scheduler is not None:  # read at each scrape: an engine released by --unload-after has none

        def batch_sizes() -> dict[int, int]:
            scheduler = engine.scheduler
            return {} if scheduler is None else dict(scheduler.stats.batch_sizes)

        def lm_counters() -> dict[str, float]:
            scheduler = engine.scheduler
            if scheduler is None:
                return {}
            s = scheduler.stats
            return {
                "tokens_total": s.tokens,
                "decode_steps_total": s.decode_steps,
                "tokens_per_second": s.tokens_per_second,
            }

        m.batch_sizes, m.lm_counters = batch_sizes, lm_counters
    if settings.default_voice is not None and settings.default_voice not in state.voices.names():
        logger.warning(
            "the default voice %r is not saved yet: OpenAI voice names get a 400 until it is added",
            settings.default_voice,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.admission = Admission(settings.max_active, settings.max_queue)
        state.voice_lock = asyncio.Lock()
        logger.info("serving %s (%d voices) with %d workers", state.model_id, len(state.voices), settings.max_active)
        for service in state.services:
            await service.start()
        yield
        state.admission.draining = True
        for service in state.services:
            await service.stop()
        for job in list(state.jobs):  # running syntheses stop at their next token instead of holding the exit
            job.cancel.set()
        state.executor.shutdown(wait=False)

    # no CDN pages (/docs is ours, /redoc is gone); no redirects to a URL built from the Host header (/metrics/)
    app = FastAPI(
        title="cosyvoice-cpu",
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,
    )
    app.state.cosyvoice = state
    handlers.install(app, m)
    # the outermost middleware is added last: guard (Host, Origin, body size), then CORS, then the API key
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, metrics=m)
    if settings.allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allow_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["X-Sample-Rate", "X-Speed-Clamped", "X-Voice", "X-Replica", "Retry-After"],
        )
    app.add_middleware(
        HostOriginGuard,
        bind=settings.host,
        allow_hosts=settings.allow_hosts,
        allow_origins=settings.allow_origins,
        max_body=settings.max_body_bytes,
        metrics=m,
        body_timeout=settings.body_timeout,
    )
    app.add_middleware(ReplicaHeaderMiddleware, info=state.replica)  # outermost: every response says who answered

    def static(name: str) -> HTMLResponse:
        return HTMLResponse(resources.files("cosyvoice_cpu.server").joinpath(f"static/{name}").read_text("utf-8"))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> Any:  # (FastAPI reads a route's annotations at run time: fastapi is not imported here)
        return static("index.html")

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> Any:
        return static("docs.html")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """The server's state: model, load, voices, RSS (open without the API key, for probes)."""
        adm = state.admission
        loop = asyncio.get_running_loop()
        replica = await loop.run_in_executor(None, state.replica.health)  # under Ray: a call to Serve (cached)
        voices = await loop.run_in_executor(None, len, state.voices)  # reads the shared voices directory
        return {
            "status": "draining" if adm.draining else "ok",
            "model": state.model_id,
            "family": engine.manifest.family,
            "sample_rate": engine.sample_rate,
            "rss_mb": round(_rss_bytes() / 2**20, 1),
            "active": adm.active,
            "queued": adm.waiting,
            "voices": voices,
            "engine_loaded": getattr(engine, "loaded", True),  # False: released by --unload-after until the next use
            "uptime_s": round(time.time() - state.started, 1),
            **replica,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Any:
        """Prometheus metrics (text format)."""
        return PlainTextResponse(m.render(), media_type="text/plain; version=0.0.4")

    routes.add_routes(app, state)
    text_ws.add_route(app, state)
    voice_routes.add_routes(app, state)
    openapi.install(app, settings)
    return app


def _version() -> str:
    from cosyvoice_cpu import __version__

    return __version__
