"""Cross-site writes and DNS rebinding (issue #28): without an API key, a page on another origin must not create,
delete or use anything, and a Host name the server does not serve is refused."""

from __future__ import annotations

import re
import socket

import pytest

from cosyvoice_cpu.cli.speech import _tone_wav

from .conftest import VOICE, Server

EVIL = "http://evil.example"


def raw_status(server: Server, request: str) -> tuple[int, str]:
    """Send one raw HTTP/1.1 request (for Host headers httpx would not send) and return (status, reply)."""
    host, port = server.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request.encode())
        reply = b""
        while part := s.recv(65536):
            reply += part
    text = reply.decode(errors="replace")
    return int(text.split(" ", 2)[1]), text


def port_of(server: Server) -> str:
    return server.url.rsplit(":", 1)[1]


def test_writes_from_another_sites_page_are_refused(server: Server) -> None:
    """What a ``fetch(url, {mode: "no-cors", method: "POST", body: form})`` on another site sends: a multipart
    POST with that site's Origin. It created a voice before the fix."""
    with server.client() as c:
        r = c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")}, data={"name": "planted"},
                   headers={"Origin": EVIL})  # fmt: skip
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        assert "--allow-origin" in r.json()["error"]["message"]
        assert not (server.voices / "planted.npz").exists()
        speech = {"model": "tts-1", "voice": VOICE, "input": "Hello.", "response_format": "pcm"}
        for origin in (
            EVIL,
            "null",
            f"http://localhost:{port_of(server)}",
            "http://127.0.0.1:1",
            f"https://127.0.0.1:{port_of(server)}",
        ):  # the last one: the right host and port, not scheme
            r = c.post("/v1/audio/speech", json=speech, headers={"Origin": origin})
            assert r.status_code == 403, (origin, r.status_code)
        r = c.delete(f"/v1/audio/voices/{VOICE}", headers={"Origin": EVIL})
        assert r.status_code == 403 and (server.voices / f"{VOICE}.npz").exists()
        # the server's own page (same scheme, host and port) and clients without Origin (curl, SDKs) are served
        assert c.post("/v1/audio/speech", json=speech, headers={"Origin": server.url}).status_code == 200
        assert c.post("/v1/audio/speech", json=speech).status_code == 200
        # behind a TLS proxy on this host that says so, the server's own origin is the https one
        proxied = {"Origin": f"https://127.0.0.1:{port_of(server)}", "X-Forwarded-Proto": "https"}
        assert c.post("/v1/audio/speech", json=speech, headers=proxied).status_code == 200
        # reads carry no CORS header, so another site's page cannot read them anyway
        r = c.get("/v1/audio/voices", headers={"Origin": EVIL})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        metrics = c.get("/metrics").text
    assert re.search(r'endpoint="/v1/audio/speech",outcome="bad_request"\} [1-9]', metrics)


NOT_SERVED = ["evil.example", "evil.example:{port}", "attacker.localhost.example", "127.0.0.1.nip.io"]


@pytest.mark.parametrize("host", NOT_SERVED)
def test_host_names_not_served_are_refused(server: Server, host: str) -> None:
    host = host.format(port=port_of(server))
    status, reply = raw_status(server, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
    assert status == 403 and "host_not_allowed" in reply and "--allow-host" in reply
    body = '{"model": "tts-1", "voice": "demo", "input": "Hi."}'
    status, _ = raw_status(server, f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                                   f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}")  # fmt: skip
    assert status == 403


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST.:{port}", "[::1]:{port}"])
def test_the_bind_address_and_loopback_names_are_served(server: Server, host: str) -> None:
    host = host.format(port=port_of(server))
    status, _ = raw_status(server, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
    assert status == 200


def test_allowed_hosts_and_origins(tuned: Server) -> None:
    """``--allow-host tts.example`` and ``--allow-origin http://app.example``: served, with CORS for that origin."""
    status, _ = raw_status(tuned, "GET /health HTTP/1.1\r\nHost: tts.example\r\nConnection: close\r\n\r\n")
    assert status == 200
    status, _ = raw_status(tuned, "GET /health HTTP/1.1\r\nHost: other.example\r\nConnection: close\r\n\r\n")
    assert status == 403
    speech = {"model": "tts-1", "voice": VOICE, "input": "Hello.", "response_format": "pcm"}
    with tuned.client() as c:
        r = c.post("/v1/audio/speech", json=speech, headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert "x-sample-rate" in r.headers["access-control-expose-headers"].lower()
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type, authorization"}  # fmt: skip
        r = c.options("/v1/audio/speech", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = c.options("/v1/audio/speech", headers={**preflight, "Origin": EVIL})
        assert "access-control-allow-origin" not in r.headers
        assert c.post("/v1/audio/speech", json=speech, headers={"Origin": EVIL}).status_code == 403


def test_a_request_without_host_is_served(server: Server) -> None:
    status, _ = raw_status(server, "GET /health HTTP/1.0\r\n\r\n")  # HTTP/1.0 clients; browsers always send Host
    assert status == 200


def test_guard_rules() -> None:
    from cosyvoice_cpu.server.guard import HostOriginGuard, split_host
    from cosyvoice_cpu.server.metrics import Metrics

    assert split_host("[::1]:8000") == ("::1", 8000) and split_host("Example.COM.") == ("example.com", None)
    wide = HostOriginGuard(None, "0.0.0.0", (), (), 1, Metrics())
    assert wide.host_allowed("192.168.1.20:8000") and wide.host_allowed("[fe80::1]:8000")
    assert not wide.host_allowed("evil.example:8000")
    local = HostOriginGuard(None, "127.0.0.1", ("tts.example",), ("https://app.example",), 1, Metrics())
    assert local.host_allowed("tts.example:443") and not local.host_allowed("192.168.1.20:8000")
    assert local.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert local.origin_allowed("https://tts.example", "tts.example", "https")  # default ports: 443 for https
    assert not local.origin_allowed("https://tts.example", "tts.example")  # an https page, this http server
    assert not local.origin_allowed("https://127.0.0.1:8000", "127.0.0.1:8000")  # the same host and port
    assert not local.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000", "https")
    assert local.origin_allowed("https://app.example/", "127.0.0.1:8000")
    assert not local.origin_allowed("http://127.0.0.1:8001", "127.0.0.1:8000")
    assert not local.origin_allowed("http://tts.example:99999", "tts.example")
    assert HostOriginGuard(None, "127.0.0.1", ("*",), ("*",), 1, Metrics()).host_allowed("any.example")


def _ws_scope(origin: str | None, extensions: bool) -> dict:
    headers = [(b"host", b"127.0.0.1:8000")] + ([(b"origin", origin.encode())] if origin else [])
    scope = {"type": "websocket", "path": "/v1/audio/speech/stream", "scheme": "ws", "headers": headers}
    if extensions:
        scope["extensions"] = {"websocket.http.response": {}}
    return scope


@pytest.mark.parametrize("extensions", [True, False])
def test_a_cross_site_websocket_is_refused_at_its_handshake(extensions: bool) -> None:
    """Browsers open WebSockets cross-site without CORS: the guard checks their Origin as a write's, answering
    403 JSON where the ASGI server can send a denial response, else closing the handshake (plain ASGI, no server)."""
    import asyncio

    from cosyvoice_cpu.server.guard import HostOriginGuard
    from cosyvoice_cpu.server.metrics import Metrics

    reached: list[dict] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        reached.append(scope)

    guard = HostOriginGuard(app, "127.0.0.1", (), (), 1 << 20, Metrics())

    def run(origin: str | None) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        asyncio.run(guard(_ws_scope(origin, extensions), None, send))
        return sent

    sent = run(EVIL)
    if extensions:
        assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 403, sent
        assert b"origin_not_allowed" in sent[1]["body"]
    else:
        assert sent == [{"type": "websocket.close", "code": 1008, "reason": "origin_not_allowed"}]
    assert not reached
    assert run("http://127.0.0.1:8000") == [] and len(reached) == 1  # the server's own page (ws -> http)
    assert run(None) == [] and len(reached) == 2  # no Origin: not a browser
