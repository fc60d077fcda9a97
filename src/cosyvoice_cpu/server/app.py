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
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING, Any

from cosyvoice_cpu.hardware.malloc import malloc_free_bytes
from cosyvoice_cpu.hardware.pages import status_mb
from cosyvoice_cpu.server import handlers
from cosyvoice_cpu.server.guard import ApiKeyMiddleware, HostOriginGuard
from cosyvoice_cpu.server.identity import ReplicaHeaderMiddleware, ReplicaInfo
from cosyvoice_cpu.server.speech import Admission
from cosyvoice_cpu.server.state import ServerSettings, State

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    from cosyvoice_cpu.server.engine_api import SpeechEngine

logger = logging.getLogger(__name__)


def _rss_bytes() -> int:
    """This process's resident memory in bytes, 0 where /proc is not there."""
    return round((status_mb("VmRSS") or 0.0) * 2**20)


def create_app(engine: SpeechEngine, settings: ServerSettings, replica: ReplicaInfo | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`~cosyvoice_cpu.engine.Engine`, or anything that gives
    :class:`~cosyvoice_cpu.server.engine_api.SpeechEngine`) with ``settings``; ``replica`` says
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
    m.gauges["cosyvoice_process_malloc_free_bytes"] = (
        "Memory freed into glibc's heaps, not reused yet (still counted after a heap trim returns its pages).",
        lambda: malloc_free_bytes() or 0,
    )
    m.counters["cosyvoice_heap_trims_total"] = (
        "Trims of glibc's heaps, once idle or every minute on a busy server (free pages returned to the OS).",
        lambda: state.admission.heap_trim.trims,
    )
    m.counters["cosyvoice_heap_trimmed_bytes_total"] = (
        "Resident memory the heap trims returned (RSS before less after, summed).",
        lambda: state.admission.heap_trim.freed_bytes,
    )
    m.gauges["cosyvoice_requests_active"] = ("Syntheses running.", lambda: state.admission.active)
    m.gauges["cosyvoice_requests_queued"] = ("Syntheses waiting for a worker.", lambda: state.admission.waiting)
    m.gauges["cosyvoice_voices"] = ("Saved voices served.", lambda: len(state.voices))
    m.gauges["cosyvoice_text_streams_open"] = ("Text stream WebSockets open.", lambda: state.text_streams)

    # the engine's parts are read once a scrape: --unload-after may release them between two reads
    def cache_bytes() -> float:
        caches = engine.prompt_caches
        return 0 if caches is None else caches.nbytes

    def rows_active() -> float:
        scheduler = engine.scheduler
        return 0 if scheduler is None else scheduler.active

    def held_cache_bytes() -> float:
        caches = engine.prompt_caches
        return 0 if caches is None else caches.held_nbytes

    m.gauges["cosyvoice_prompt_cache_bytes"] = (
        "Memory of the voices' streaming caches the budget keeps (bounded by --prompt-cache-mb).",
        cache_bytes,
    )
    m.gauges["cosyvoice_prompt_cache_held_bytes"] = (
        "Memory of every voice streaming cache in memory: the kept ones and those only running requests hold.",
        held_cache_bytes,
    )
    m.gauges["cosyvoice_lm_rows_active"] = (
        "LM batch rows held by requests (a text stream waiting for text holds one).",
        rows_active,
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
        state.admission.heap_trim.close()
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
            "flow_steps": state.settings.defaults.flow_steps,  # what a request that names none gets (--flow-steps)
            "rss_mb": round(_rss_bytes() / 2**20, 1),
            "active": adm.active,
            "queued": adm.waiting,
            "voices": voices,
            "engine_loaded": engine.loaded,  # False: released by --unload-after until the next use
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
