"""A voice's streaming caches go with the voice (found by ``bench/server_mix.py``: a server whose voices were
replaced kept every old version's caches until the LRU's budget pushed them out, up to ``--prompt-cache-mb`` of
voices nobody could ask for). Seen from outside through ``/metrics``' ``cosyvoice_prompt_cache_bytes``, and a
cache only a running request holds through ``cosyvoice_prompt_cache_held_bytes``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from cosyvoice_cpu.cli.speech import _tone_wav

from .conftest import add_voice, gauge, prompt_cache_bytes, start_server


def _upload(c: httpx.Client, name: str, seconds: float, overwrite: bool = False) -> None:
    """Save voice ``name`` from a tone of ``seconds`` (another length: another voice, with another cache)."""
    data = {"name": name, "prompt_text": "Good morning everyone.", "overwrite": str(overwrite).lower()}
    r = c.post("/v1/audio/voices", files={"file": ("v.wav", _tone_wav(seconds), "audio/wav")}, data=data)
    assert r.status_code == 201, r.text


def _stream(c: httpx.Client, voice: str) -> None:
    body = {"model": "tts-1", "input": "Hello there.", "voice": voice, "response_format": "pcm", "seed": 1}
    r = c.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.content, r.text


def test_a_replaced_or_deleted_voice_keeps_no_cache(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "voices", tmp_path / "server.log")
    try:
        with srv.client() as c:
            _upload(c, "a", 3.0)
            _upload(c, "b", 4.0)
            _stream(c, "a")
            a_old = prompt_cache_bytes(c)
            _stream(c, "b")
            b = prompt_cache_bytes(c) - a_old
            assert a_old > 0 and b > 0
            _upload(c, "a", 3.5, overwrite=True)  # a new recording under the old name
            assert prompt_cache_bytes(c) == b  # the old recording's cache is gone at once
            _stream(c, "a")
            a_new = prompt_cache_bytes(c) - b
            assert a_new > 0 and a_new != a_old
            _upload(c, "a", 3.5, overwrite=True)  # the same recording again: its cache is still good
            assert prompt_cache_bytes(c) == a_new + b
            assert c.delete("/v1/audio/voices/b").status_code == 204
            assert prompt_cache_bytes(c) == a_new
            _stream(c, "a")  # still kept: no rebuild, no growth
            assert prompt_cache_bytes(c) == a_new
            assert c.delete("/v1/audio/voices/a").status_code == 204
            assert prompt_cache_bytes(c) == 0
            assert c.get("/health").json()["status"] == "ok"
    finally:
        srv.stop()


def test_a_cache_only_a_running_request_holds_is_counted_as_held(tmp_path: Path) -> None:
    """With ``--prompt-cache-mb 0`` the budget keeps nothing, yet a text stream between two sentences holds its
    voice's cache: the held gauge counts it (the memory is there), the kept gauge does not, and it goes when the
    stream ends."""
    connect = pytest.importorskip("websockets.sync.client").connect
    srv = start_server(tmp_path / "voices", tmp_path / "server.log", "--prompt-cache-mb", "0")
    try:
        with srv.client() as c, connect(srv.url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
            assert add_voice(c).status_code == 201
            ws.send(json.dumps({"type": "start", "model": "tts-1", "voice": "demo", "seed": 1}))
            text = "The pump on line three is running hot, and the cooling water is low. Please check it now. "
            ws.send(json.dumps({"type": "text", "text": text}))
            while not isinstance(m := ws.recv(timeout=60), bytes):  # the text speaks, the stream stays open
                assert json.loads(m)["type"] == "started", m  # not done, not an error
            metrics = c.get("/metrics").text
            assert gauge(metrics, "cosyvoice_prompt_cache_bytes") == 0
            assert gauge(metrics, "cosyvoice_prompt_cache_held_bytes") > 0
            ws.send(json.dumps({"type": "end"}))
            for _ in ws:  # the rest of the audio and done, until the server closes
                pass
            deadline = time.monotonic() + 10  # the request's thread lets go of it just after the socket closes
            while gauge(c.get("/metrics").text, "cosyvoice_prompt_cache_held_bytes") > 0:
                assert time.monotonic() < deadline, "a stream that ended still holds its voice's cache"
                time.sleep(0.05)
    finally:
        srv.stop()
