"""The web page at ``/`` in a real browser (Debian's Chromium driven by Playwright) against a real server.

Speaks with the demo voice (streamed PCM played through Web Audio, then a WAV in the ``<audio>`` element), adds a
voice through the form, and shows the server's error message for a bad request.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from tests.server.conftest import VOICE, Server, start_server

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required"]  # fmt: skip
TIMEOUT_MS = 30_000
KEY = "page-test-key"
TEXT = "Hello from the browser. This is a streaming test."


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: apt-get install chromium"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Any]:
    """A fresh page on the server's ``/`` with its console errors and page errors collected in ``page.errors``."""
    context = browser.new_context(viewport={"width": 900, "height": 1100})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("console", lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
    pg.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    pg.errors = errors
    pg.goto(server.url + "/")
    try:
        yield pg
    finally:
        context.close()


def wait_for_voice(page: Any, name: str) -> None:
    page.wait_for_function("name => [...document.querySelector('#voice').options].some(o => o.value === name)",
                           arg=name)  # fmt: skip


def player_duration(page: Any) -> float:
    """Wait until ``#player`` has a src with metadata loaded, and return its duration (seconds)."""
    return page.evaluate("""() => new Promise((resolve, reject) => {
        const a = document.querySelector('#player');
        const done = () => resolve(a.duration);
        if (a.src && a.readyState >= 1) return done();
        a.addEventListener('loadedmetadata', done, {once: true});
        a.addEventListener('error', () => reject(new Error('audio error ' + (a.error && a.error.code))), {once: true});
    })""")


def tone_wav(path: Path, seconds: float = 3.0, sr: int = 16000) -> Path:
    t = np.arange(int(sr * seconds)) / sr
    wave = 0.3 * np.sin(2 * np.pi * 170 * t) + 0.01 * np.random.default_rng(1).standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), sr, format="WAV", subtype="PCM_16")
    path.write_bytes(buf.getvalue())
    return path


def test_speak_streams_and_fills_the_player(page: Any, server: Server, tmp_path: Path) -> None:
    wait_for_voice(page, VOICE)
    assert page.input_value("#voice") == VOICE
    page.wait_for_function("() => /demo_model/.test(document.querySelector('#health').textContent)")
    assert page.get_attribute("#status", "role") == "status"

    page.fill("#text", TEXT)
    page.fill("#seed", "7")
    page.click("#speak")
    page.wait_for_function("() => document.querySelector('#player').src.startsWith('blob:')")
    duration = player_duration(page)
    assert 0 < duration < 60, duration

    stats = page.text_content("#stats")
    assert "first audio" in stats.lower(), stats
    assert "s of audio" in stats, stats
    assert page.get_attribute("#status", "class") == "ok", page.text_content("#status")
    assert page.get_attribute("#download", "href").startswith("blob:")
    assert page.is_enabled("#speak")
    stats_data = page.evaluate("() => ({...document.querySelector('#stats').dataset})")
    assert 0 < int(stats_data["firstMs"]) < int(stats_data["totalMs"]), stats_data  # played while streaming

    # the WAV in the player holds exactly the PCM the API streams for the same request (no byte lost or swapped
    # at the chunk boundaries)
    wav = page.evaluate("""async () => {
        const buf = await (await fetch(document.querySelector('#player').src)).arrayBuffer();
        const hash = await crypto.subtle.digest('SHA-256', buf.slice(44));
        return {size: buf.byteLength, rate: new DataView(buf).getUint32(24, true),
                sha: [...new Uint8Array(hash)].map(b => b.toString(16).padStart(2, '0')).join('')};
    }""")
    body = {"model": "demo_model", "input": TEXT, "voice": VOICE, "response_format": "pcm", "seed": 7, "speed": 1}
    with server.client() as c:
        r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200, r.text
    assert wav["size"] == 44 + len(r.content) == 44 + int(stats_data["bytes"])
    assert wav["rate"] == int(r.headers["x-sample-rate"])
    assert abs(duration - len(r.content) / 2 / wav["rate"]) < 0.05
    assert wav["sha"] == hashlib.sha256(r.content).hexdigest()

    shot = tmp_path / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, len(data)
    assert not page.errors, page.errors
    if os.environ.get("WEB_PAGE_SCREENSHOT"):  # keep a copy to look at
        shutil.copy(shot, os.environ["WEB_PAGE_SCREENSHOT"])


def test_add_voice_and_errors(page: Any, server: Server, tmp_path: Path) -> None:
    name = "browser tone"
    wav = tone_wav(tmp_path / "tone.wav")
    wait_for_voice(page, VOICE)
    try:
        page.fill("#add-name", "../escape")  # the browser checks the name's pattern before sending
        assert page.evaluate("() => document.querySelector('#add-name').validity.patternMismatch")
        page.fill("#add-name", name)
        assert page.evaluate("() => document.querySelector('#add-name').validity.valid")
        page.fill("#add-text", "Good morning everyone.")
        page.set_input_files("#add-file", str(wav))
        page.click("#add-submit")
        wait_for_voice(page, name)
        page.wait_for_function("name => document.querySelector('#voice').value === name", arg=name)
        assert "Added voice" in page.text_content("#status")
        with server.client() as c:
            count = len(c.get("/v1/audio/voices").json()["voices"])
        page.wait_for_function("n => document.querySelector('#health').textContent.includes(n + ' voices')", arg=count)

        # the same name again: the server's 409 message, shown in the status line
        page.set_input_files("#add-file", str(wav))
        page.fill("#add-name", name)
        page.click("#add-submit")
        page.wait_for_function("() => document.querySelector('#status').textContent.includes('409')")
        assert "exists" in page.text_content("#status")

        # empty text: the server's 400 message
        page.fill("#text", "   ")
        page.click("#speak")
        page.wait_for_function("() => document.querySelector('#status').className === 'error'")
        status = page.text_content("#status")
        assert "input is empty" in status, status
        assert page.is_enabled("#speak") and page.is_disabled("#stop")

        # a voice deleted behind the page's back: the server names the saved voices
        with server.client() as c:
            assert c.delete(f"/v1/audio/voices/{name}").status_code == 204
        page.fill("#text", "Hello.")
        page.click("#speak")
        page.wait_for_function("() => document.querySelector('#status').textContent.includes('no voice named')")
        assert VOICE in page.text_content("#status")
        # the only console errors are the failed requests' status lines
        assert all("status of 4" in e for e in page.errors), page.errors
    finally:
        with server.client() as c:
            c.delete(f"/v1/audio/voices/{name}")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an API key and no saved voice."""
    root = tmp_path_factory.mktemp("keyed")
    srv = start_server(root / "voices", root / "server.log", "--api-key", KEY)
    try:
        yield srv
    finally:
        srv.stop()


def test_api_key_no_voices_and_stop(browser: Any, keyed_server: Server, tmp_path: Path) -> None:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(keyed_server.url + "/")
        page.wait_for_function("() => document.querySelector('#status').textContent.includes('401')")
        assert "API key" in page.text_content("#status")
        assert page.evaluate("() => document.querySelector('#key-box').open")
        assert page.is_disabled("#speak")

        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")  # change event: reload the voices with the key
        page.wait_for_selector("#voice-hint:not([hidden])")
        assert "no voices" in page.text_content("#voice-hint").lower()
        assert page.is_disabled("#speak")
        assert page.evaluate("() => localStorage.getItem('cosyvoice-cpu.api-key')") == KEY

        page.fill("#add-name", "keyed")
        page.set_input_files("#add-file", str(tone_wav(tmp_path / "tone.wav")))
        page.click("#add-submit")
        page.wait_for_function("() => document.querySelector('#voice').value === 'keyed'")
        assert page.is_hidden("#voice-hint")

        page.fill("#text", TEXT)
        page.click("#speak")
        page.click("#stop")
        page.wait_for_function("() => document.querySelector('#status').textContent.startsWith('Stopped')")
        page.wait_for_function("() => !document.querySelector('#speak').disabled")
        assert page.is_disabled("#stop")

        page.reload()  # the key is remembered
        page.wait_for_function("() => document.querySelector('#voice').value === 'keyed'")
        assert page.input_value("#api-key") == KEY
        assert not errors, errors
    finally:
        context.close()


def test_a_page_of_another_origin_cannot_add_a_voice(browser: Any, server: Server) -> None:
    """Issue #28: a page on another origin created a voice with a ``no-cors`` multipart POST (no API key set).
    http://localhost:PORT is another origin than http://127.0.0.1:PORT (and both are loopback, so no private
    network rule of the browser gets in the way): its POST carries ``Origin: http://localhost:PORT``."""
    from cosyvoice_cpu.cli.speech import _tone_wav

    name = "planted by a page"
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server.url.replace("127.0.0.1", "localhost") + "/health")
        kind = page.evaluate(
            """async ([url, name, wav]) => {
            const bytes = Uint8Array.from(atob(wav), c => c.charCodeAt(0));
            const form = new FormData();
            form.append('name', name);
            form.append('prompt_text', 'Good morning everyone.');
            form.append('file', new Blob([bytes], {type: 'audio/wav'}), 'prompt.wav');
            const r = await fetch(url + '/v1/audio/voices', {method: 'POST', mode: 'no-cors', body: form});
            return r.type;
        }""",
            [server.url, name, base64.b64encode(_tone_wav()).decode()],
        )
        assert kind == "opaque"  # the page cannot see the answer, but the request was sent
    finally:
        context.close()
    with server.client() as c:
        assert name not in [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]]
        assert re.search(r'endpoint="/v1/audio/voices",outcome="bad_request"\} [1-9]', c.get("/metrics").text)


def test_the_api_reference_renders_offline(page: Any, server: Server) -> None:
    page.goto(server.url + "/docs")
    page.wait_for_function("() => document.querySelector('#ops').textContent.includes('/v1/audio/speech')")
    text = page.text_content("#ops")
    assert "multipart/form-data" in text and "audio/mpeg" in text and "429" in text
    assert not page.errors, page.errors


def test_speak_as_you_type_over_the_websocket(page: Any) -> None:
    """The page's text stream section: typed text goes over ``/v1/audio/speech/stream`` and is spoken."""
    wait_for_voice(page, VOICE)
    page.wait_for_function("() => !document.querySelector('#live-start').disabled")
    page.click("#live-start")
    page.wait_for_function("() => !document.querySelector('#live-text').disabled")
    page.type("#live-text", TEXT, delay=20)  # key by key: each keystroke sends what is new
    page.click("#live-end")
    page.wait_for_function("() => document.querySelector('#live-status').dataset.stopReason")
    data = page.evaluate("() => ({...document.querySelector('#live-status').dataset})")
    assert data["stopReason"] == "end" and int(data["bytes"]) > 0, (data, page.text_content("#live-status"))
    assert page.get_attribute("#live-status", "class") == "ok", page.text_content("#live-status")
    assert "s of audio" in page.text_content("#live-status")
    assert page.is_enabled("#live-start") and page.is_disabled("#live-text")
    assert not page.errors, page.errors
