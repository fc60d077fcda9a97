"""Plain ASGI middleware in front of the routes: the API key, the Host and Origin checks, and the body limit.

Not Starlette's ``BaseHTTPMiddleware``, which re-streams responses: it ended a speech stream that failed half way
cleanly (the client could not tell truncated audio from complete audio) and hid client disconnects. Paths are
the routed ones (``scope["path"]``), never rebuilt from the Host header.

* **Host** (DNS rebinding): a page on ``evil.example`` whose name is re-pointed to 127.0.0.1 talks to the server
  as its own origin, and its requests carry ``Host: evil.example``. Only these names are served: the bind
  address, ``localhost``, the loopback addresses, ``--allow-host`` names, and any IP address when the server is
  bound to all interfaces (an address in Host cannot come from a rebound name). Anything else is a 403.
* **Origin** (cross-site writes): a browser sends ``Origin`` with every POST, even a ``no-cors`` one that a page
  on another site may send without asking. Requests other than GET/HEAD/OPTIONS whose Origin is neither the
  server's own (the request's scheme, and host and port as the Host header says) nor an ``--allow-origin`` one
  are refused (403). Clients that send no Origin (curl, SDKs) are not browsers and pass.
* **Content type**: the speech route takes JSON declared as ``application/json`` (or ``application/*+json``);
  anything else (curl's ``-d`` default ``application/x-www-form-urlencoded``, ``text/plain``, none) is a 415 that
  says so, before the body is read. Besides the clear message, this keeps cross-site pages to the CORS preflight
  that a JSON request needs.
* **Body deadline**: a request body must have arrived ``body_timeout`` seconds (``--body-timeout``) after its
  headers, or the request is answered 408 (``request_timeout``) and its connection closed: a client that sends
  half a body and stops holds nothing for longer. The headers' own deadline is in ``server.protocol``.
* **Body limit**: a JSON body is refused (413) past ``max_body`` bytes, from ``Content-Length`` before it is read
  or while it streams in; the voice upload has its own limit (``--max-upload-mb``) in its route.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from cosyvoice_cpu.server.handlers import endpoint_label, send_error
from cosyvoice_cpu.server.metrics import Metrics

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # noqa: S104 (names of the bind-all addresses, compared, not bound)
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
WS_SCHEMES = {"ws": "http", "wss": "https"}  # a WebSocket's scheme as the origin of its page says it
UPLOAD_PATH = "/v1/audio/voices"  # limited in its route (multipart, --max-upload-mb)
JSON_ROUTES = (("POST", "/v1/audio/speech"),)  # take a JSON body: other Content-Types are a 415 before the body is read


def is_json_type(content_type: str | None) -> bool:
    """Whether a Content-Type declares JSON: ``application/json`` or ``application/*+json``, any parameters."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def json_type_problem(content_type: str | None) -> str:
    """The message of a 415: the body must be JSON declared as such (what curl's ``-d`` does not declare)."""
    given = "has no Content-Type" if not content_type else f"says Content-Type: {content_type[:100]}"
    hint = (
        " (curl -d sends that: add -H 'Content-Type: application/json')"
        if content_type and ("x-www-form-urlencoded" in content_type.lower())
        else ""
    )
    return f"the body must be a JSON object sent with Content-Type: application/json; this request {given}{hint}"


def _header(scope: Scope, name: bytes) -> str | None:
    value = next((v for k, v in scope.get("headers", ()) if k == name), None)
    return None if value is None else value.decode("latin-1")


def split_host(value: str) -> tuple[str, int | None]:
    """(name, port or None) of a Host header value (``name``, ``name:port``, ``[v6]:port``), lower-case, without
    a trailing dot."""
    v = value.strip().lower()
    port: str | None = None
    if v.startswith("["):
        name, _, rest = v[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif v.count(":") == 1:
        name, port = v.split(":")
    else:
        name = v
    return name.rstrip("."), int(port) if port and port.isdigit() else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostOriginGuard:
    """Refuses requests for hosts the server does not serve and cross-site writes; caps request bodies.

    Args:
        bind: the address the server listens on; allow_hosts: more Host names (``*``: any);
        allow_origins: more origins for writes (``http://localhost:3000``; ``*``: any; ``null``: sandboxed pages);
        max_body: the largest request body (bytes) outside the voice upload.
    """

    def __init__(
        self,
        app: ASGIApp,
        bind: str,
        allow_hosts: Iterable[str],
        allow_origins: Iterable[str],
        max_body: int,
        metrics: Metrics,
        body_timeout: float = 60.0,
    ) -> None:
        self.app, self.metrics, self.max_body, self.body_timeout = app, metrics, max_body, body_timeout
        self.any_ip = bind.strip("[]") in WILDCARD_HOSTS
        hosts = {split_host(h)[0] for h in allow_hosts}
        self.any_host = "*" in hosts
        self.hosts = hosts | {split_host(bind)[0], *LOOPBACK_NAMES}
        self.origins = {o.strip().lower().rstrip("/") for o in allow_origins}

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request with this Host header is served (no header: an HTTP/1.0 client, not a browser)."""
        if host is None or self.any_host:
            return True
        name, _ = split_host(host)
        return name in self.hosts or (self.any_ip and _is_ip(name))

    def origin_allowed(self, origin: str, host: str | None, scheme: str = "http") -> bool:
        """Whether a write from a page of ``origin`` is taken: the server's own origin (``scheme``, the request's:
        ``https`` behind a TLS proxy that says so in ``X-Forwarded-Proto``; host and port as in ``host``), or an
        allowed one."""
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.origins or origin in self.origins:
            return True
        try:
            o = urlsplit(origin)
            o_port = o.port
        except ValueError:
            return False
        if o.scheme != scheme or scheme not in ("http", "https") or not o.hostname or host is None:
            return False  # a page of https://HOST:PORT is another origin than this http://HOST:PORT server
        default = 443 if o.scheme == "https" else 80
        name, port = split_host(host)
        return o.hostname.rstrip(".") == name and (o_port or default) == (port or default)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == "websocket"
        label = endpoint_label(scope.get("path", ""))
        host = _header(scope, b"host")
        if not self.host_allowed(host):
            self.metrics.count(label, "bad_request")
            logger.warning("refused a request for Host %r (not served: --allow-host)", host)
            await send_error(
                send,
                403,
                f"this server does not serve the host name {split_host(host or '')[0]!r}; "
                "start it with --allow-host NAME to serve it (a guard against DNS rebinding)",
                "permission_error",
                "host_not_allowed",
                scope=scope,
            )
            return
        origin = _header(scope, b"origin")
        scheme = WS_SCHEMES.get(scope.get("scheme", "http"), scope.get("scheme", "http"))
        if (
            (websocket or scope.get("method") not in SAFE_METHODS)  # a WebSocket is a GET that writes: no CORS
            and origin is not None
            and not self.origin_allowed(origin, host, scheme)
        ):
            self.metrics.count(label, "bad_request")
            logger.warning(
                "refused a %s %s from Origin %r", scope.get("method", "WebSocket"), scope.get("path"), origin
            )
            await send_error(
                send,
                403,
                f"requests from pages of {origin[:200]!r} may not change or use this server "
                "(cross-site request); start it with --allow-origin ORIGIN to allow that origin",
                "permission_error",
                "origin_not_allowed",
                scope=scope,
            )
            return
        if websocket or scope.get("method") in SAFE_METHODS:  # a WebSocket's messages have their own limits
            await self.app(scope, receive, send)
            return
        receive = self.deadline(receive)
        if scope.get("path") == UPLOAD_PATH:
            await self.app(scope, receive, send)
            return
        ctype = _header(scope, b"content-type")
        if (scope.get("method"), scope.get("path")) in JSON_ROUTES and not is_json_type(ctype):
            self.metrics.count(label, "bad_request")
            await send_error(send, 415, json_type_problem(ctype), "invalid_request_error", "unsupported_media_type")
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            self.metrics.count(label, "bad_request")
            await send_error(send, 413, self.too_large(int(declared)), "invalid_request_error", "body_too_large")
            return
        await self.app(scope, self.limited(receive), send)

    def too_large(self, size: int | None) -> str:
        what = "the request body" if size is None else f"a request body of {size} bytes"
        return (
            f"{what} is over this server's limit of {self.max_body} bytes; the text fields have their own "
            "limits in characters (docs/server.md)"
        )

    def deadline(self, receive: Receive) -> Receive:
        """``receive`` that raises a 408 (``request_timeout``, and the connection is closed) when the body has not
        fully arrived ``body_timeout`` seconds after the headers; once it has, ``receive`` as it is."""
        import asyncio

        from starlette.exceptions import HTTPException

        loop = asyncio.get_running_loop()
        until, complete = loop.time() + self.body_timeout, False

        async def wrapped() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(until - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} s of its "
                    "headers; send it at once (the server's --body-timeout)",
                    headers={"Connection": "close"},
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return wrapped

    def limited(self, receive: Receive) -> Receive:
        """``receive`` that raises a 413 once the body passes the limit (bodies sent without Content-Length)."""
        from starlette.exceptions import HTTPException

        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise HTTPException(413, self.too_large(None))
            return message

        return wrapped


def key_matches(given: bytes, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (compared in constant time)."""
    return secrets.compare_digest(given, f"Bearer {key}".encode("utf-8", "replace"))


class ApiKeyMiddleware:
    """``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <key>`` (compared in constant time). A WebSocket
    handshake without the header passes: browsers cannot send one, so the text stream route takes the key in its
    first message instead (``server.text_ws``); a wrong header is refused here."""

    def __init__(self, app: ASGIApp, key: str, metrics: Metrics) -> None:
        self.app, self.metrics, self.key = app, metrics, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (path.startswith("/v1/") or path == "/metrics"):
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            if given is None and scope["type"] == "websocket":
                await self.app(scope, receive, send)
                return
            if not key_matches(given or b"", self.key):
                self.metrics.count(endpoint_label(path), "bad_request")
                await send_error(
                    send,
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    "invalid_api_key",
                    scope=scope,
                )
                return
        await self.app(scope, receive, send)
