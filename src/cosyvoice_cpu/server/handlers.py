"""The server's error answers: every error is ``{"error": {"message", "type", "code"}}`` with a 4xx/5xx status,
a message that says what to do, and a code for programs (never null); each one is counted in
``cosyvoice_requests_total`` under its endpoint.

Also the ``Allow`` header: ``OPTIONS`` on a path answers 204 with every method its routes take, and a 405 lists
the same (Starlette's own 405 named only the first route's methods: ``GET`` for ``/v1/audio/voices``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from cosyvoice_cpu.errors import CosyVoiceCpuError
from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.server.checks import RequestProblem
from cosyvoice_cpu.server.metrics import Metrics

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.applications import Starlette
    from starlette.types import Scope, Send

logger = logging.getLogger(__name__)

ENDPOINTS = (
    "/v1/audio/speech/stream",
    "/v1/audio/speech",
    "/v1/audio/voices",
    "/v1/models",
    "/health",
    "/metrics",
    "/",
)
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")  # e.g. libsndfile's "<_io.BytesIO object at 0x..>"


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``; ``counted``: already in the metrics."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str = "invalid_request",
        headers: dict[str, str] | None = None,
        counted: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.headers, self.counted = status, kind, code, headers, counted


def endpoint_label(path: str) -> str:
    """A bounded metrics label for a request path: the endpoint it is for, or ``other`` (never the raw path,
    which a client could vary without end)."""
    return next((e for e in ENDPOINTS if path == e or (e != "/" and path.startswith(e + "/"))), "other")


def outcome_of(status: int) -> str:
    """The metrics outcome of an error status."""
    return {429: "rejected", 503: "rejected", 504: "timeout", 499: "cancelled"}.get(
        status, "error" if status >= 500 else "bad_request"
    )


def error_body(message: str, kind: str, code: str) -> JsonObject:
    """The JSON body of an error."""
    return {"error": {"message": _OBJECT_REPR.sub("the uploaded data", message), "type": kind, "code": code}}


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    code: str,
    headers: dict[str, str] | None = None,
    scope: Scope | None = None,
) -> None:
    """Answer an error from plain ASGI middleware (before any route ran). A WebSocket handshake (``scope`` of type
    ``websocket``) is refused with the same HTTP status and JSON body where the server can send one (the ASGI
    ``websocket.http.response`` extension, which uvicorn has), else closed before it opens (HTTP 403)."""
    prefix = ""
    if scope is not None and scope.get("type") == "websocket":
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008, "reason": code})
            return
        prefix = "websocket."
    body = json.dumps(error_body(message, kind, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": prefix + "http.response.start", "status": status, "headers": raw})
    await send({"type": prefix + "http.response.body", "body": body})


def validation_problem(errors: Sequence[Mapping[str, object]]) -> tuple[str, str]:
    """(message, code) of a request pydantic refused: its first five problems, each naming its field."""
    problems, code = [], "invalid_field"
    for err in errors[:5]:
        if err.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
            code = "invalid_json"
            continue
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
        code = "unknown_field" if err.get("type") == "extra_forbidden" else code
    return "invalid request: " + "; ".join(problems), code


HTTP_CODES = {400: "invalid_json", 408: "request_timeout", 413: "body_too_large"}  # of HTTPExceptions outside routes


def body_problem(cause: BaseException) -> str:
    """What is wrong with a JSON body the parser raised ``cause`` on (FastAPI answers only "There was an error
    parsing the body" for anything but a JSON syntax error)."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start : cause.start + 1].hex() if isinstance(cause.object, bytes) else "?"
        return (
            f"the body is not valid {cause.encoding.upper()} text: byte 0x{byte} at offset {cause.start} "
            f"({cause.reason}); send the JSON encoded as UTF-8"
        )
    if isinstance(cause, RecursionError):
        return (
            "the body's JSON is nested too deeply to parse (arrays or objects hundreds of levels deep); a speech "
            "request is one flat JSON object of strings, numbers and booleans"
        )
    return (
        f"the body could not be read as JSON ({type(cause).__name__}); send one JSON object encoded as UTF-8 "
        "with Content-Type: application/json"
    )


def allowed_methods(app: Starlette, scope: Scope) -> list[str]:
    """Every method the routes matching ``scope``'s path take, plus OPTIONS (sorted)."""
    from starlette.routing import Match

    methods = {"OPTIONS"}
    for route in app.router.routes:
        match, _ = route.matches(scope)  # PARTIAL: the path matches, the method does not
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def install(app: FastAPI, metrics: Metrics) -> None:
    """The exception handlers of ``app``: every error answered as JSON with a code, and counted."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from cosyvoice_cpu.server.speech import Rejected, StreamAborted

    def answer(
        request: Request,
        status: int,
        message: str,
        kind: str,
        code: str,
        headers: dict[str, str] | None = None,
        counted: bool = False,
    ) -> Response:
        if not counted:
            metrics.count(endpoint_label(request.scope["path"]), outcome_of(status))
        return JSONResponse(error_body(message, kind, code), status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return answer(request, e.status, str(e), e.kind, e.code, e.headers, e.counted)

    @app.exception_handler(RequestProblem)
    async def _problem(request: Request, e: RequestProblem) -> Response:
        return answer(request, e.status, str(e), "invalid_request_error", e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:  # unknown paths, wrong methods
        if e.status_code == 405:
            allow = ", ".join(allowed_methods(app, request.scope))
            if request.method == "OPTIONS":
                return Response(status_code=204, headers={"Allow": allow})
            return answer(
                request,
                405,
                f"{request.method} is not allowed on {request.url.path}; it takes {allow} (see /docs)",
                "invalid_request_error",
                "method_not_allowed",
                {"Allow": allow},
            )
        if e.status_code == 404:
            return answer(
                request,
                404,
                f"no endpoint {request.method} {request.url.path} (see /docs for the API)",
                "invalid_request_error",
                "not_found",
            )
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI's "There was an error parsing the body"
            return answer(request, 400, body_problem(e.__cause__), "invalid_request_error", "invalid_json")
        code = HTTP_CODES.get(e.status_code, "internal_error" if e.status_code >= 500 else "invalid_request")
        return answer(request, e.status_code, str(e.detail), "invalid_request_error", code, getattr(e, "headers", None))

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, e: Rejected) -> Response:
        kind, code = ("server_busy", "server_busy") if e.status == 429 else ("unavailable", "shutting_down")
        return answer(request, e.status, str(e), kind, code, {"Retry-After": str(e.retry_after)})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        message, code = validation_problem(list(e.errors()))
        return answer(request, 400, message, "invalid_request_error", code)

    @app.exception_handler(CosyVoiceCpuError)
    async def _config(request: Request, e: CosyVoiceCpuError) -> Response:
        return answer(request, 400, str(e), "invalid_request_error", "invalid_request")

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> Response:
        if isinstance(e, StreamAborted):  # a speech stream cut after its status line: counted, logged, answered
            raise e
        logger.exception("%s %s failed", request.method, request.url.path)
        return answer(
            request,
            500,
            f"internal error ({type(e).__name__}); the server keeps running",
            "server_error",
            "internal_error",
        )
