"""A voice's streaming caches go with the voice (found by ``bench/server_mix.py``: a server whose voices were
replaced kept every old version's caches until the LRU's budget pushed them out, up to ``--prompt-cache-mb`` of
voices nobody could ask for). Seen from outside through ``/metrics``' ``cosyvoice_prompt_cache_bytes``."""

from __future__ import annotations

from pathlib import Path

import httpx

from cosyvoice_cpu.cli.speech import _tone_wav

from .conftest import prompt_cache_bytes, start_server


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
