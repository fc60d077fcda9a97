"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive`` seconds, but nothing bounds the time a
client takes to send a request line and headers: a connection that sends half a request line and stops was held
for as long as the client liked (70 s and more in issue #35), each holding a socket and its buffers. The protocol
made by :func:`timed_protocol` closes such a connection ``header_timeout`` seconds after it opened, or after the
first byte of a following request on a kept-alive connection; when part of a request had arrived, it answers 408
(JSON, ``request_timeout``) first. The body has its own deadline in the app (``server.guard``), which can answer
with a proper error through the routes. A WebSocket upgrade ends the deadline: the connection then belongs to the
WebSocket protocol, whose messages have their own limits (``server.text_ws``); before this, the timer closed every
WebSocket ``header_timeout`` seconds after it opened, with a stray HTTP 408 written into it.
"""

from __future__ import annotations

import asyncio
import json
import logging

logger = logging.getLogger(__name__)


def base_protocol() -> type:
    """The protocol class uvicorn's ``http="auto"`` picks: httptools when installed, else h11."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def timeout_response(header_timeout: float, extra: list[tuple[bytes, bytes]] = ()) -> bytes:
    """The raw 408 sent to a client that did not finish its headers in time (``extra``: uvicorn's default
    headers, such as ``server`` and ``date``)."""
    body = json.dumps(
        {
            "error": {
                "message": f"the request's headers did not arrive within {header_timeout:g} s; "
                "send the whole request at once (the server closes the connection)",
                "type": "invalid_request_error",
                "code": "request_timeout",
            }
        }
    ).encode()
    head = [b"HTTP/1.1 408 Request Timeout"] + [name + b": " + value for name, value in extra]
    head += [b"content-type: application/json", b"content-length: " + str(len(body)).encode(), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def timed_protocol(header_timeout: float, base: type | None = None) -> type:
    """A subclass of ``base`` (default :func:`base_protocol`) that closes a connection whose request headers are
    not complete ``header_timeout`` seconds after the connection opened, or after the first byte of a next
    request on a kept-alive connection."""
    base = base or base_protocol()

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, **kw)
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_cycle: object = None  # the request in flight (uvicorn's cycle) when the timer was armed
            self._header_bytes = False  # part of a request arrived since then

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
            self._header_bytes = True
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not None and self.cycle is not self._header_cycle:
                self._cancel_header_timer()  # the headers are in: the request runs (its body has its own deadline)

        def handle_websocket_upgrade(self, *args: object) -> None:
            self._cancel_header_timer()  # the headers are in and the connection is a WebSocket's from now on
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_cycle, self._header_bytes = self.cycle, False
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._header_bytes:  # a client that started a request hears why; a silent one is just closed
                logger.info("closing a connection whose request headers took over %g s", header_timeout)
                self.transport.write(timeout_response(header_timeout, list(self.server_state.default_headers)))
            self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
