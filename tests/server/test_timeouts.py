"""Header and body deadlines (issue #35): a half-sent request line held its connection for 70 s and more. With
``--header-timeout 1 --body-timeout 2``, a connection whose request does not arrive in time is answered 408 and
closed within the documented time; requests that arrive in time, and responses that take longer, are untouched."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from .conftest import VOICE, Server, start_with_voice

HEADER_S, BODY_S = 1.0, 2.0


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_with_voice(tmp_path_factory.mktemp("timeouts"), "--header-timeout", str(HEADER_S), "--body-timeout",
                           str(BODY_S))  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def _connect(server: Server) -> socket.socket:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _until_closed(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    t0, reply = time.monotonic(), b""
    while part := s.recv(65536):
        reply += part
    return reply, time.monotonic() - t0


def _body(reply: bytes) -> dict:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("sent", ["POST /v1/audio/spe", "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: "])
def test_a_half_sent_request_is_answered_408_and_closed_within_the_header_timeout(timed: Server, sent: str) -> None:
    with _connect(timed) as s:
        s.sendall(sent.encode())
        reply, took = _until_closed(s)
    assert HEADER_S - 0.2 < took < HEADER_S + 2, took
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:100]
    error = _body(reply)["error"]
    assert error["code"] == "request_timeout" and "within 1 s" in error["message"]


def test_a_silent_connection_is_closed_within_the_header_timeout(timed: Server) -> None:
    with _connect(timed) as s:
        reply, took = _until_closed(s)
    assert reply == b"" and took < HEADER_S + 2, took


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/audio/voices"])
def test_a_half_sent_body_is_answered_408_and_closed_within_the_body_timeout(timed: Server, path: str) -> None:
    kind = "application/json" if path.endswith("speech") else "multipart/form-data; boundary=x"
    with _connect(timed) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {kind}\r\nContent-Length: 500\r\n\r\n"
                  '{"model": "tts-1", '.encode())  # fmt: skip
        reply, took = _until_closed(s)
    assert BODY_S - 0.2 < took < BODY_S + 2, took
    assert reply.startswith(b"HTTP/1.1 408 ") and b"connection: close" in reply.lower(), reply[:300]
    error = _body(reply)["error"]
    assert error["code"] == "request_timeout" and "did not arrive within 2 s" in error["message"], error
    with timed.client() as c:
        assert c.get("/health").json()["status"] == "ok"
        assert 'outcome="error"' not in c.get("/metrics").text  # a client's fault, counted as bad_request


def test_requests_in_time_and_long_responses_are_untouched(timed: Server) -> None:
    """A kept-alive connection serves request after request; a response that takes longer than both deadlines
    (a streamed speech of several seconds, read slowly) is not cut; a next request that stalls is closed."""
    body = json.dumps({"model": "tts-1", "voice": VOICE, "input": "Line three is overheating. " * 6,
                       "response_format": "pcm", "seed": 1}).encode()  # fmt: skip
    with timed.client() as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            time.sleep(0.6)  # idle between requests: the keep-alive timeout (5 s) applies, not the header one
        t0, got = time.monotonic(), 0
        with c.stream("POST", "/v1/audio/speech", content=body, headers={"content-type": "application/json"}) as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():
                got += len(chunk)
                time.sleep(0.05)
        assert time.monotonic() - t0 > BODY_S + HEADER_S and got > 24000 * 2 * 5  # > 5 s of audio, all of it
    with _connect(timed) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = s.recv(65536)
        while b"\r\n\r\n" not in first:
            first += s.recv(65536)
        head, rest = first.split(b"\r\n\r\n", 1)
        length = int(next(v for k, v in (h.split(b": ", 1) for h in head.split(b"\r\n")[1:]) if k.lower() ==
                          b"content-length"))  # fmt: skip
        while len(rest) < length:  # the whole first response, so that what follows is the next one
            rest += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and len(rest) == length
        time.sleep(0.5)
        s.sendall(b"GET /heal")  # the next request on the same connection stalls
        reply, took = _until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408 ") and took < HEADER_S + 2, (reply[:80], took)
