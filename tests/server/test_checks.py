"""Requests refused before any work (issue #28): any text gets speech or a 400 naming the problem, every text
field has a limit that a megabyte of text cannot get past (and leaves nothing behind), strict JSON types, an
error code on every error, counted 400s, voice names, no Host-built redirects."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cosyvoice_cpu.cli.speech import _tone_wav
from cosyvoice_cpu.voices.voice import VoiceError, check_name

from .conftest import VOICE, Server, add_voice

MB_TEXT = ("Speak happily and with energy. " * 40000)[:1_000_000]


def post_json(c: httpx.Client, body: dict[str, object]) -> httpx.Response:
    """POST a speech body as JSON with ASCII escapes (lone surrogates travel as ``\\ud800``, as JSON allows)."""
    full = {"model": "tts-1", "voice": VOICE, "input": "Hello.", "response_format": "pcm", **body}
    return c.post("/v1/audio/speech", content=json.dumps(full).encode(), headers={"content-type": "application/json"})


def expect(r: httpx.Response, status: int, words: str, code: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert re.search(words, error["message"], re.IGNORECASE), error["message"]
    assert isinstance(error["code"], str) and error["code"], error
    if code is not None:
        assert error["code"] == code, error


def bad_requests(c: httpx.Client, endpoint: str = "/v1/audio/speech") -> int:
    text = c.get("/metrics").text
    found = re.search(rf'cosyvoice_requests_total\{{endpoint="{endpoint}",outcome="bad_request"\}} (\d+)', text)
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize(("body", "words"), [
    ({"input": "a\ud800b"}, r"input holds a lone surrogate U\+D800 at character 1"),
    ({"instructions": "a\udfffb"}, r"instructions holds a lone surrogate U\+DFFF"),
    ({"input": "\x00\x00\x00"}, r"input holds the control character U\+0000"),
    ({"input": "Hi\x00there."}, r"control character U\+0000 at character 2"),
    ({"input": "\x01\x02\x1b"}, r"control character U\+0001"),
    ({"instructions": "Speak\x07 happily."}, r"instructions holds the control character U\+0007"),
    ({"input": "\u200b\ufeff \u2060"}, r"input is only invisible characters"),
    ({"input": " \t\n "}, r"input is empty"),
])  # fmt: skip
def test_any_text_gets_a_400_that_names_the_problem(server: Server, body: dict, words: str) -> None:
    with server.client() as c:
        expect(post_json(c, body), 400, words)


def test_odd_but_valid_text_is_spoken(server: Server) -> None:
    with server.client() as c:
        for text in ("a\ud83d\ude00b", "Tab\tand\r\nnewlines.", "Zero\u200bwidth."):  # a surrogate *pair* is fine
            r = post_json(c, {"input": text})
            assert r.status_code == 200 and len(r.content) > 2400, (text, r.text[:200])


def test_a_megabyte_in_a_text_field_is_refused_at_once_and_leaves_nothing_behind(server: Server) -> None:
    """Before the fix: 1.2-2.5 s in a synthesis worker per request, a message about the voice prompt, and the
    tokenizer's freed memory kept by the workers' malloc arenas (181 -> 834 MB RSS on the demo model for 20)."""
    body = json.dumps({"model": "tts-1", "voice": VOICE, "input": "Hello.", "instructions": MB_TEXT}).encode()

    def one(_: int) -> tuple[httpx.Response, float]:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/audio/speech", content=body, headers={"content-type": "application/json"},
                       timeout=60)  # fmt: skip
        return r, time.perf_counter() - t0

    with server.client() as c:
        before, refused = c.get("/health").json()["rss_mb"], bad_requests(c)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(20)))
        for r, seconds in results:
            expect(r, 400, "instructions has 1000000 characters.*at most 1000", "instructions_too_long")
            assert seconds < 3.0, seconds  # ~0.1-0.3 s; the bound leaves room for a busy machine
        after = c.get("/health").json()["rss_mb"]
        assert after - before < 100, (before, after)  # measured +3 MB; before the fix +650 MB
        assert bad_requests(c) == refused + 20
        assert c.get("/health").json()["active"] == 0  # no synthesis ever started
        t0 = time.perf_counter()
        r = c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")},
                   data={"name": "huge", "prompt_text": MB_TEXT[:1_000_000 - 1000]})  # fmt: skip
        expect(r, 400, "prompt_text has 999000 characters.*at most 1000", "prompt_text_too_long")
        assert time.perf_counter() - t0 < 3.0  # before the fix: still normalizing after 120 s (with wetext)
        expect(post_json(c, {"input": MB_TEXT}), 400, "input has 1000000 characters.*at most 4096", "input_too_long")
        expect(post_json(c, {"model": "m" * 100_000}), 400, "model.*at most 128 characters")
        expect(post_json(c, {"voice": "v" * 100_000}), 400, "voice.*at most 64 characters")
        expect(post_json(c, {"response_format": "w" * 100_000}), 400, "response_format.*at most 16 characters")
        huge = c.post("/v1/audio/speech", content=b" " * (3 << 20), headers={"content-type": "application/json"})
        expect(huge, 413, "3145728 bytes is over this server's limit", "body_too_large")
        assert "huge" not in c.get("/v1/audio/voices").text


def test_instructions_that_fill_the_kv_cache_are_named(server: Server) -> None:
    with server.client() as c:  # the demo model's KV cache has 512 positions
        expect(post_json(c, {"instructions": "Speak happily. " * 60}), 400,
               r"instructions take \d+ tokens.*KV cache of 512 positions.*shorten the instructions",
               "instructions_too_long")  # fmt: skip


def test_wrong_json_types_are_refused(server: Server) -> None:
    with server.client() as c:
        expect(post_json(c, {"speed": "1.0"}), 400, "speed: Input should be a valid number", "invalid_field")
        expect(post_json(c, {"stream": "yes"}), 400, "stream: Input should be a valid boolean", "invalid_field")
        expect(post_json(c, {"seed": 7.5}), 400, "seed: Input should be a valid integer")
        expect(post_json(c, {"normalize": 1}), 400, "normalize: Input should be a valid boolean")
        expect(post_json(c, {"colour": "red"}), 400, "colour.*not permitted", "unknown_field")
        assert post_json(c, {"speed": 1, "seed": 3}).status_code == 200  # an integer is a number


def test_every_error_has_a_code_and_is_counted(server: Server) -> None:
    with server.client() as c:
        refused = bad_requests(c)
        expect(post_json(c, {"voice": "nobody"}), 400, "no voice named 'nobody'", "voice_not_found")
        expect(post_json(c, {"model": "whisper-1"}), 400, "unknown model", "model_not_found")
        expect(post_json(c, {"response_format": "aac"}), 400, "unsupported", "unsupported_format")
        expect(post_json(c, {"input": ""}), 400, "empty", "empty_input")
        expect(c.post("/v1/audio/speech", content=b"{", headers={"content-type": "application/json"}), 400,
               "not valid JSON", "invalid_json")  # fmt: skip
        assert bad_requests(c) == refused + 5  # before the fix these were not counted at all
        expect(c.get("/v1/nothing"), 404, "no endpoint GET /v1/nothing", "not_found")
        expect(c.put("/v1/audio/speech"), 405, "PUT is not allowed", "method_not_allowed")
        expect(c.delete("/v1/audio/voices/nobody"), 404, "no voice", "voice_not_found")
        expect(add_voice(c, name=VOICE), 409, "exists", "voice_exists")
        expect(add_voice(c, name="x", overwrite="maybe"), 400, "overwrite must be true or false", "invalid_field")
        junk = c.post("/v1/audio/voices", files={"file": ("x.wav", b"not audio", "audio/wav")}, data={"name": "junk"})
        expect(junk, 400, "cannot decode", "bad_prompt")
        assert "object at 0x" not in junk.text and "BytesIO" not in junk.text  # no Python reprs in messages


@pytest.mark.parametrize(("name", "words"), [
    ("a\u202eb", r"U\+202E"), ("\ufeffdemo", r"U\+FEFF"), ("．．／demo", r"not allowed"), ("de\u200dmo", r"U\+200D"),
    ("x\u2028y", r"U\+2028"), ("‥", r"not allowed"),
])  # fmt: skip
def test_voice_names_are_normalized_and_invisible_characters_refused(server: Server, name: str, words: str) -> None:
    before = sorted(server.voices.iterdir())
    with server.client() as c:
        expect(add_voice(c, name=name), 400, words, "invalid_voice_name")
    assert sorted(server.voices.iterdir()) == before


def test_full_width_voice_names_are_stored_in_nfkc(server: Server) -> None:
    with server.client() as c:
        r = add_voice(c, name="Ｗｉｄｅ １")
        assert r.status_code == 201 and r.json()["name"] == "Wide 1"
        assert (server.voices / "Wide 1.npz").exists()
        assert post_json(c, {"voice": "Ｗｉｄｅ １"}).status_code == 200
        assert c.delete("/v1/audio/voices/Ｗｉｄｅ １").status_code == 204
    assert not (server.voices / "Wide 1.npz").exists()


def test_check_name_refuses_invisible_characters() -> None:
    for name in ("a\u202eb", "\ufeffx", "x\u200by", "a\u2066b"):
        with pytest.raises(VoiceError, match="invisible character"):
            check_name(name)
    assert check_name("Ünïcödé voice 1") == "Ünïcödé voice 1"


def test_no_redirect_built_from_the_host_header(server: Server) -> None:
    with server.client() as c:
        r = c.get("/metrics/", headers={"Host": "127.0.0.1:1"})
    assert r.status_code == 404 and "location" not in r.headers


def test_the_upload_field_text_is_taken_as_prompt_text(server: Server) -> None:
    """Clients of the first server sent the transcript as ``text`` (ignored then); it was refused as an unknown
    field after the strict upload checks. It is another name of ``prompt_text`` now (docs/server.md, Changes)."""

    def upload(**data: str) -> httpx.Response:
        return c.post("/v1/audio/voices", files={"file": ("p.wav", _tone_wav(), "audio/wav")}, data=data)

    with server.client() as c:
        r = upload(name="old client", text="Good morning everyone.")
        assert r.status_code == 201, r.text
        assert r.json()["prompt_text"] == "Good morning everyone."
        voices = {v["name"]: v for v in c.get("/v1/audio/voices").json()["voices"]}
        assert voices["old client"]["mode"] == "zero-shot"
        assert c.delete("/v1/audio/voices/old client").status_code == 204
        expect(upload(name="twice", text="One thing.", prompt_text="Another."), 400,
               "sent twice with different text, as prompt_text and text", "invalid_field")  # fmt: skip
        expect(upload(name="odd", words="Hi."), 400, r"unknown form fields \['words'\].*'text'", "unknown_field")
    assert not (server.voices / "twice.npz").exists()


def test_bodies_the_json_parser_refuses_get_invalid_json_saying_why(server: Server) -> None:
    """Invalid UTF-8 and deep nesting got FastAPI's "There was an error parsing the body" with the undocumented
    code http_error (issue #35)."""
    json_type = {"content-type": "application/json"}
    with server.client() as c:
        bad_utf8 = b'{"model": "tts-1", "voice": "demo", "input": "caf\xe9 \xff"}'
        expect(c.post("/v1/audio/speech", content=bad_utf8, headers=json_type), 400,
               r"not valid UTF-8 text: byte 0xe9 at offset 49.*encoded as UTF-8", "invalid_json")  # fmt: skip
        deep = b'{"model": "tts-1", "voice": "demo", "input": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        expect(c.post("/v1/audio/speech", content=deep, headers=json_type), 400, "nested too deeply",
               "invalid_json")  # fmt: skip
        assert c.get("/health").json()["status"] == "ok"


SPEECH_BODY = json.dumps({"model": "tts-1", "voice": VOICE, "input": "Hello.", "response_format": "pcm"}).encode()


@pytest.mark.parametrize(("content_type", "words"), [
    ("application/x-www-form-urlencoded", r"says Content-Type: application/x-www-form-urlencoded \(curl -d sends that: "
                                          r"add -H 'Content-Type: application/json'\)"),
    ("text/plain;charset=UTF-8", "says Content-Type: text/plain"),
    (None, "has no Content-Type"),
])  # fmt: skip
def test_a_json_body_without_the_json_content_type_gets_a_415_that_says_so(server: Server, content_type: str | None,
                                                                          words: str) -> None:  # fmt: skip
    """curl's ``-d`` declares form data; the body was then read as bytes and refused with "Input should be a valid
    dictionary or object to extract fields from" (issue #35)."""
    headers = {} if content_type is None else {"content-type": content_type}
    with server.client() as c:
        r = c.post("/v1/audio/speech", content=SPEECH_BODY, headers=headers)
        expect(r, 415, "the body must be a JSON object sent with Content-Type: application/json; this request "
               + words, "unsupported_media_type")  # fmt: skip
        assert "valid dictionary" not in r.text
        for ok in ("application/json; charset=utf-8", "Application/JSON"):
            assert c.post("/v1/audio/speech", content=SPEECH_BODY, headers={"content-type": ok}).status_code == 200
