"""The text stream WebSocket ``/v1/audio/speech/stream`` (issue 37, items 5 and 6) against a real ``serve`` process,
with the ``websockets`` client library on a real socket: speech while the text is written, the key, Host and
Origin checks, admission, and every kind of bad client (silent, too fast, 10 MB, invalid UTF-8, lone surrogates,
not JSON, gone mid-sentence). Each ends with a documented close code, its work cancelled (the LM row freed), and
the server goes on serving the others."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import pytest

websockets = pytest.importorskip("websockets")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from .conftest import VOICE, Server, add_voice, start_server  # noqa: E402

KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
START = {"type": "start", "model": "tts-1", "voice": VOICE, "seed": 1}
REPLY = "The pump on line three is running hot, and the cooling water is low. Please check it now."
FLAGS = "--max-active 2 --max-queue 1 --max-input-chars 300 --stream-idle-timeout 2 --header-timeout 1 --timeout 60"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """2 streams at once, 1 waiting, 300 characters a stream, idle streams closed after 2 s, an API key, and a 1 s
    header deadline (a WebSocket must outlive it)."""
    root = tmp_path_factory.mktemp("text_ws")
    server = start_server(root / "voices", root / "server.log", *FLAGS.split(), "--api-key", KEY)
    try:
        with server.client(headers=AUTH) as c:
            assert add_voice(c).status_code == 201
        yield server
    finally:
        server.stop()


def url(srv: Server) -> str:
    return srv.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def open_ws(srv: Server, headers: dict[str, str] | None = AUTH, **kw: object):
    return connect(url(srv), additional_headers=headers, proxy=None, open_timeout=10, **kw)


def drain(ws) -> tuple[list[dict], bytes, tuple[int | None, str]]:
    """(JSON messages, PCM bytes, (close code, reason)) until the server closes."""
    messages, pcm = [], bytearray()
    try:
        while True:
            m = ws.recv(timeout=60)
            if isinstance(m, bytes):
                pcm += m
            else:
                messages.append(json.loads(m))
    except ConnectionClosed as e:
        close = (e.rcvd.code, e.rcvd.reason) if e.rcvd else (None, "")
    return messages, bytes(pcm), close


def refused(srv: Server, *sends: object, headers: dict[str, str] | None = AUTH) -> tuple[dict, int | None]:
    """Send ``sends`` (dicts as JSON, str and bytes raw) and return (the final done message, the close code)."""
    with open_ws(srv, headers) as ws:
        for s in sends:
            ws.send(json.dumps(s) if isinstance(s, dict) else s)
        messages, _, (code, _) = drain(ws)
    assert messages and messages[-1]["type"] == "done", messages
    return messages[-1], code


def handshake_status(srv: Server, host: str) -> int:
    """The status of a WebSocket handshake sent with ``Host: host`` (written by hand: clients set Host themselves)."""
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            f"GET /v1/audio/speech/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {KEY}\r\n\r\n".encode()
        )
        return int(s.recv(4096).split(b" ", 2)[1])


def metrics(srv: Server) -> dict[str, float]:
    with srv.client(headers=AUTH) as c:
        text = c.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


SETTLED = ("cosyvoice_text_streams_open", "cosyvoice_lm_rows_active", "cosyvoice_requests_active")


def settled(srv: Server, timeout: float = 10.0, names: tuple[str, ...] = SETTLED) -> None:
    """Wait until no stream is open, no synthesis holds a slot and no request holds an LM row (or: ``names``)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(srv)
        busy = [k for k in names if m.get(k, 0)]
        if not busy:
            return
        assert time.monotonic() < deadline, f"still held: {busy}"
        time.sleep(0.05)


def speak(srv: Server, pieces: list[str], pause: float = 0.0, **start: object) -> tuple[list[dict], bytes, float]:
    """A whole stream; returns (messages, PCM, seconds after the first piece that the first audio came)."""
    with open_ws(srv) as ws:
        ws.send(json.dumps({**START, **start}))
        first_audio: list[float] = []
        t0 = time.monotonic()

        def write() -> None:
            for p in pieces:
                ws.send(json.dumps({"type": "text", "text": p}))
                time.sleep(pause)
            ws.send(json.dumps({"type": "end"}))

        writer = threading.Thread(target=write)
        writer.start()
        messages, pcm = [], bytearray()
        try:
            while True:
                m = ws.recv(timeout=60)
                if isinstance(m, bytes):
                    first_audio = first_audio or [time.monotonic() - t0]
                    pcm += m
                else:
                    messages.append(json.loads(m))
        except ConnectionClosed as e:
            assert e.rcvd is not None and e.rcvd.code == 1000, e
        writer.join()
    return messages, bytes(pcm), first_audio[0] if first_audio else float("inf")


def test_speech_starts_while_the_text_is_written(srv: Server) -> None:
    words = [w + " " for w in REPLY.split()]
    pause = 0.15  # the writing takes ~2.6 s, past the 1 s header deadline the socket must outlive
    messages, pcm, first = speak(srv, words, pause)
    assert messages[0]["type"] == "started" and messages[0]["sample_rate"] == 24000, messages[0]
    done = messages[-1]
    assert done["type"] == "done" and done["stop_reason"] == "end", done
    assert len(pcm) % 2 == 0 and len(pcm) // 2 / 24000 == pytest.approx(done["timings"]["audio_s"], abs=0.01)
    assert done["timings"]["text_chars"] == len("".join(words))
    assert first < pause * len(words), f"the first audio came after all the text ({first:.2f} s)"
    m = metrics(srv)
    assert m['cosyvoice_requests_total{endpoint="/v1/audio/speech/stream",outcome="ok"}'] >= 1
    settled(srv)


def test_base64_audio_and_the_key_in_the_start_message(srv: Server) -> None:
    with open_ws(srv, headers=None) as ws:  # a browser cannot send Authorization: the key comes in start
        ws.send(json.dumps({**START, "audio": "base64", "api_key": KEY}))
        ws.send(json.dumps({"type": "text", "text": "Good morning. "}))
        ws.send(json.dumps({"type": "end"}))
        messages, pcm, (code, _) = drain(ws)
    audio = [m for m in messages if m["type"] == "audio"]
    assert code == 1000 and not pcm and audio and audio[0]["text"], messages[:2]
    assert messages[-1]["stop_reason"] == "end"


def test_the_key_host_and_origin_are_checked(srv: Server) -> None:
    for headers in ({"Authorization": "Bearer wrong"}, {**AUTH, "Origin": "http://evil.example"}):
        with pytest.raises(InvalidStatus) as e:
            open_ws(srv, headers)
        assert e.value.response.status_code in (401, 403)
        assert json.loads(e.value.response.body)["error"]["code"] in ("invalid_api_key", "origin_not_allowed")
    assert handshake_status(srv, "evil.example") == 403  # a rebound DNS name
    assert handshake_status(srv, "localhost") == 101
    done, code = refused(srv, START, headers=None)  # no header and no key in start
    assert (done["error"]["code"], code) == ("invalid_api_key", 4401)
    with open_ws(srv, {**AUTH, "Origin": srv.url}) as ws:  # the server's own page
        ws.send(json.dumps({"type": "cancel"}))
        assert drain(ws)[2][0] == 4400  # cancel before start: a bad first message


@pytest.mark.parametrize(
    ("sends", "code", "close"),
    [
        (["not json"], "invalid_json", 4400),
        (['["a list"]'], "bad_message", 4400),
        ([{"type": "text", "text": "no start"}], "bad_message", 4400),
        ([{**START, "speeed": 1.0}], "unknown_field", 4400),
        ([{**START, "speed": "fast"}], "invalid_field", 4400),
        ([{**START, "voice": "nobody"}], "voice_not_found", 4400),
        ([{**START, "model": "whisper-1"}], "model_not_found", 4400),
        ([START, b"\x00\x01binary"], "binary_message", 1003),
        ([START, '{"type": "text", "text": "bad \\ud800 surrogate"}'], "invalid_text", 4400),
        ([START, {"type": "text", "text": "nul \x00 byte"}], "invalid_text", 4400),
        ([START, {"type": "text", "text": 42}], "bad_message", 4400),
        ([START, {"type": "shout"}], "bad_message", 4400),
        ([START, {"type": "text", "text": "x" * 301}], "text_too_long", 4413),
        ([START, *[{"type": "text", "text": "y" * 50}] * 7], "text_too_long", 4413),  # faster than spoken
        ([START, {"type": "end"}, {"type": "text", "text": "late"}], "bad_message", 4400),
    ],
    ids=[
        "not-json",
        "not-object",
        "no-start",
        "unknown-field",
        "wrong-type",
        "voice",
        "model",
        "binary",
        "lone-surrogate",
        "control-char",
        "text-not-str",
        "unknown-type",
        "piece-too-long",
        "too-much-text",
        "text-after-end",
    ],
)
def test_bad_messages_are_refused(srv: Server, sends: list[object], code: str, close: int) -> None:
    t0 = time.monotonic()
    done, got = refused(srv, *sends)
    assert (done["error"]["code"], got) == (code, close), done
    assert done["stop_reason"] == "error" and done["error"]["message"]
    assert time.monotonic() - t0 < 10
    settled(srv)


def test_ten_megabytes_are_refused_before_they_are_read(srv: Server) -> None:
    label = 'cosyvoice_requests_total{endpoint="/v1/audio/speech/stream",outcome="bad_request"}'
    before = metrics(srv).get(label, 0)
    t0 = time.monotonic()
    with open_ws(srv, compression=None, max_size=None) as ws:
        ws.send(json.dumps(START))
        with pytest.raises(ConnectionClosed) as e:
            ws.send(json.dumps({"type": "text", "text": "z" * (10 << 20)}))
            ws.recv(timeout=10)
            ws.recv(timeout=10)
    # the server closes with 1009 from the frame's header; the close frame can be lost to the reset that the
    # unread rest of the 10 MB causes, so the server's own count is the proof
    assert e.value.rcvd is None or e.value.rcvd.code == 1009, e.value
    assert time.monotonic() - t0 < 10
    settled(srv)
    assert metrics(srv).get(label, 0) == before + 1


def test_invalid_utf8_is_refused(srv: Server) -> None:
    with open_ws(srv) as ws:
        ws.send(json.dumps(START))
        ws.send(b'{"type": "text", "text": "\xff\xfe"}', text=True)  # a text frame that is not UTF-8
        _, _, (code, _) = drain(ws)
    assert code == 1007
    settled(srv)


def test_a_silent_client_is_closed_after_the_idle_timeout(srv: Server) -> None:
    for sends in ([], [START, {"type": "text", "text": "The pump on line"}]):  # silent from the start; mid-sentence
        t0 = time.monotonic()
        done, code = refused(srv, *sends)
        assert (done["error"]["code"], code) == ("idle_timeout", 4408), done
        assert 1.5 < time.monotonic() - t0 < 15  # --stream-idle-timeout 2 (audio being sent keeps it open)
        settled(srv)


def test_a_client_gone_mid_sentence_frees_its_row_and_others_go_on(srv: Server) -> None:
    other: list[object] = []
    words = [w + " " for w in REPLY.split()]
    runner = threading.Thread(target=lambda: other.append(speak(srv, words, 0.1)))
    with open_ws(srv) as ws:
        ws.send(json.dumps(START))
        ws.send(json.dumps({"type": "text", "text": REPLY[:-10]}))  # stops mid-sentence: "Please check"
        assert json.loads(ws.recv(timeout=30))["type"] == "started"
        assert isinstance(ws.recv(timeout=30), bytes)  # audio: its LM row is at work
        m = metrics(srv)
        assert m["cosyvoice_lm_rows_active"] >= 1 and m["cosyvoice_text_streams_open"] == 1, m
        runner.start()  # another stream, spoken while this one goes
        ws.socket.shutdown(socket.SHUT_RDWR)  # gone without a close frame
    runner.join(120)
    messages, pcm, _ = other[0]
    assert messages[-1]["stop_reason"] == "end" and pcm  # the other stream was spoken to its end
    settled(srv)  # no stream open, no slot, no LM row held
    m = metrics(srv)
    counts = {k: v for k, v in m.items() if "requests_total" in k}
    assert m.get('cosyvoice_requests_total{endpoint="/v1/audio/speech/stream",outcome="cancelled"}', 0) >= 1, counts


def test_a_full_server_refuses_with_4429_and_a_queued_stream_keeps_its_text(srv: Server) -> None:
    with contextlib.ExitStack() as stack:  # --max-active 2 --max-queue 1: two run, one waits
        sockets = [stack.enter_context(open_ws(srv)) for _ in range(3)]
        for i, ws in enumerate(sockets):
            ws.send(json.dumps(START))
            ws.send(json.dumps({"type": "text", "text": "Hold on. "}))
            if i < 2:
                assert json.loads(ws.recv(timeout=30))["type"] == "started"
        with pytest.raises(TimeoutError):
            sockets[2].recv(timeout=1)  # queued: no slot, no started
        done, code = refused(srv, START)
        assert (done["error"]["code"], code) == ("server_busy", 4429), done
        for _ in range(6):  # 3 s: past the 2 s idle timeout, which a stream waiting in the queue is not held to
            for ws in sockets[:2]:
                ws.send(json.dumps({"type": "text", "text": ""}))  # the running ones stay active
            time.sleep(0.5)
        sockets[0].send(json.dumps({"type": "cancel"}))  # a cancel ends with 1000 and a done message
        messages, _, (close, _) = drain(sockets[0])
        assert (messages[-1]["stop_reason"], close) == ("cancel", 1000)
        assert json.loads(sockets[2].recv(timeout=30))["type"] == "started"  # the freed slot
        sockets[2].send(json.dumps({"type": "end"}))
        messages, pcm, (close, _) = drain(sockets[2])
        assert (messages[-1]["stop_reason"], close) == ("end", 1000) and pcm  # the text sent while queued
        assert messages[-1]["timings"]["queue_wait_s"] > 2
    settled(srv)


def test_a_client_that_does_not_read_can_still_cancel(srv: Server) -> None:
    """A client that reads none of its audio is still heard: its cancel frees the slot and the row at once. The
    connection itself ends once the client reads again: the server's ``done`` and close frame wait behind the audio
    the client has not taken (on loopback the kernel's buffers, up to 4 MB, may take all of it, or not)."""
    port = int(srv.url.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes stall
    sock.connect(("127.0.0.1", port))
    with connect(url(srv), sock=sock, additional_headers=AUTH, proxy=None, max_queue=1, compression=None) as ws:
        ws.send(json.dumps(START))
        ws.send(json.dumps({"type": "text", "text": REPLY + " " + REPLY}))
        ws.send(json.dumps({"type": "end"}))
        time.sleep(3)  # nothing read
        assert metrics(srv)["cosyvoice_text_streams_open"] == 1
        ws.send(json.dumps({"type": "cancel"}))
        settled(srv, names=SETTLED[1:])  # its slot and row are freed although its audio was never taken
        messages, _, (close, _) = drain(ws)
    assert (messages[-1]["stop_reason"], close) == ("cancel", 1000), messages[-1]
    settled(srv)
