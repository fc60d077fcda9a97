"""Bad input and faults on the Wyoming port (issue 39, item 4): a malformed header, a 1 GB data or payload length,
an unknown event, text over the limit, an unknown voice or language, a client that hangs up mid-synthesis, 20
clients at once, a client that sends nothing. Each gets an ``error`` event or a closed connection, its work is
cancelled, and the server goes on serving the others (every test ends with a describe that is answered)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("wyoming")
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeVoice

from .conftest import VOICE, WyomingServer

TEXT = "Good morning. The line is running."
LONG = "The pump on line three is running hot, and the cooling water is low. " * 4


async def raw(srv: WyomingServer, data: bytes, timeout: float = 10.0) -> list[Event]:
    """Send raw bytes, then read events until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(data)
    await writer.drain()
    events = []
    try:
        while (event := await asyncio.wait_for(async_read_event(reader), timeout)) is not None:
            events.append(event)
    finally:
        writer.close()
    return events


def still_serving(srv: WyomingServer) -> None:
    async def run() -> Info:
        async with AsyncTcpClient("127.0.0.1", srv.port, connect_timeout=5, read_timeout=5) as c:
            await c.write_event(Describe().event())
            return Info.from_event(await c.read_event())

    assert asyncio.run(run()).tts[0].voices


def _error(events: list[Event]) -> Error:
    assert events and events[-1].type == "error", [e.type for e in events]
    return Error.from_event(events[-1])


@pytest.mark.parametrize(
    "data",
    [
        b"this is not json\n",
        b'["a", "list"]\n',
        b'{"data": {"text": "no type"}}\n',
        b'{"type": "synthesize", "data_length": "many"}\n',
        b'{"type": "synthesize", "data_length": 1000000000}\n' + b"{" * 1000,
        b'{"type": "synthesize", "payload_length": 1000000000}\n' + b"\0" * 100_000,
        b'{"type": "synth' + b"e" * 100_000 + b'"}\n',  # a header line past the reader's 64 KiB
    ],
    ids=["not-json", "not-an-object", "no-type", "bad-length", "1GB-data", "1GB-payload", "huge-header"],
)
def test_a_malformed_event_gets_an_error_and_a_closed_connection(wyoming_server: WyomingServer, data: bytes) -> None:
    t0 = time.monotonic()
    error = _error(asyncio.run(raw(wyoming_server, data)))
    assert error.code == "bad_event", error
    assert time.monotonic() - t0 < 5  # refused at once, not after reading a gigabyte
    still_serving(wyoming_server)


def test_a_refused_event_with_input_behind_it_still_gets_its_error(wyoming_server: WyomingServer) -> None:
    """The server reads and drops what follows a refused event before it closes: a close with input unread resets
    the connection, and the client's asyncio reader then raises the reset instead of the error it was sent."""
    data = b'{"type": "synthesize", "payload_length": 1000000000}\n' + b"\0" * 1_000_000
    for _ in range(5):
        assert _error(asyncio.run(raw(wyoming_server, data))).code == "bad_event"
    still_serving(wyoming_server)


def test_an_unknown_event_gets_an_error_and_the_connection_goes_on(wyoming_server: WyomingServer) -> None:
    async def run() -> tuple[Event, Event]:
        async with AsyncTcpClient("127.0.0.1", wyoming_server.port, read_timeout=5) as c:
            await c.write_event(Event(type="transcribe", data={"language": "en"}))
            first = await c.read_event()
            await c.write_event(Describe().event())  # same connection
            return first, await c.read_event()

    first, second = asyncio.run(run())
    assert Error.from_event(first).code == "unknown_event"
    assert second.type == "info"


@pytest.mark.parametrize(
    ("voice", "text", "code"),
    [
        ({"name": VOICE}, "x" * 301, "text_too_long"),  # --max-input-chars 300
        ({"name": "nobody"}, TEXT, "voice_not_found"),
        ({"name": VOICE, "language": "sw"}, TEXT, "language_not_supported"),
        ({"name": VOICE}, "   ", "empty_text"),
        ({"name": VOICE}, "bad \x00 byte", "invalid_text"),
        ("alice", TEXT, "invalid_voice"),
    ],
)
def test_a_refused_synthesis_gets_an_error(wyoming_server: WyomingServer, voice: object, text: str, code: str) -> None:
    line = json.dumps({"type": "synthesize", "data": {"text": text, "voice": voice}}).encode() + b"\n"
    assert _error(asyncio.run(raw(wyoming_server, line))).code == code
    still_serving(wyoming_server)


def test_a_language_the_family_speaks_is_taken(wyoming_server: WyomingServer) -> None:
    async def run() -> list[str]:
        async with AsyncTcpClient("127.0.0.1", wyoming_server.port, read_timeout=60) as c:
            event = Synthesize(text=TEXT).event()
            event.data["voice"] = {"name": VOICE, "language": "en-US"}  # SynthesizeVoice drops the language
            await c.write_event(event)
            kinds = []
            while (e := await c.read_event()) is not None and e.type not in ("audio-stop", "error"):
                kinds.append(e.type)
            return [*kinds, e.type if e else "closed"]

    kinds = asyncio.run(run())
    assert kinds[0] == "audio-start" and kinds[-1] == "audio-stop", kinds


def test_streamed_text_over_the_limit_gets_an_error(wyoming_server: WyomingServer) -> None:
    async def run() -> list[Event]:
        async with AsyncTcpClient("127.0.0.1", wyoming_server.port, read_timeout=30) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name=VOICE)).event())
            for _ in range(4):
                await c.write_event(SynthesizeChunk(text="y" * 100).event())
            events = []
            while (event := await c.read_event()) is not None:
                events.append(event)
            return events

    assert _error(asyncio.run(run())).code == "input_too_long"
    still_serving(wyoming_server)


def _active(srv: WyomingServer) -> int:
    with srv.http.client() as c:
        health = c.get("/health").json()
    return health["active"] + health["queued"]


def test_a_client_that_hangs_up_mid_synthesis_frees_its_slot(wyoming_server: WyomingServer) -> None:
    async def run() -> None:
        clients = [AsyncTcpClient("127.0.0.1", wyoming_server.port, read_timeout=60) for _ in range(2)]
        for c in clients:  # both slots (--max-active 2)
            await c.connect()
            await c.write_event(Synthesize(text=LONG, voice=SynthesizeVoice(name=VOICE)).event())
        for c in clients:
            assert (await c.read_event()).type == "audio-start"
            assert (await c.read_event()).type == "audio-chunk"
        for c in clients:
            await c.disconnect()

    asyncio.run(run())
    deadline = time.monotonic() + 10  # the work stops at the next speech token, not at the end of the text
    while _active(wyoming_server):
        assert time.monotonic() < deadline, "the syntheses of the clients that left still hold their slots"
        time.sleep(0.05)
    still_serving(wyoming_server)


def test_twenty_clients_at_once(wyoming_server: WyomingServer) -> None:
    """2 run, 2 wait (--max-active 2 --max-queue 2): the rest get a ``busy`` error at once; every one is answered,
    and the server serves on."""

    async def one() -> str:
        async with AsyncTcpClient("127.0.0.1", wyoming_server.port, read_timeout=120) as c:
            await c.write_event(Synthesize(text="Good morning.", voice=SynthesizeVoice(name=VOICE)).event())
            while (event := await c.read_event()) is not None:
                if event.type == "audio-stop":
                    return "audio"
                if event.type == "error":
                    return Error.from_event(event).code or "error"
            return "closed"

    async def run() -> list[str]:
        return await asyncio.gather(*(one() for _ in range(20)))

    outcomes = asyncio.run(run())
    assert set(outcomes) <= {"audio", "busy"}, outcomes
    assert outcomes.count("audio") >= 4, outcomes
    assert _active(wyoming_server) == 0
    still_serving(wyoming_server)


def test_a_client_that_sends_nothing_is_closed(wyoming_server: WyomingServer) -> None:
    t0 = time.monotonic()
    events = asyncio.run(raw(wyoming_server, b""))  # --idle-timeout 2
    assert _error(events).code == "idle_timeout"
    assert 1.5 < time.monotonic() - t0 < 8
    still_serving(wyoming_server)
