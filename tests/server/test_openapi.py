"""The OpenAPI schema describes the server (issue #28), and a bounded schemathesis run against a live server on
loopback keeps it so: statuses, content types, response bodies and headers as documented, 4xx for data outside
the schema, 405 with ``Allow`` for other methods, and never a 5xx."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Server, start_with_voice

SCHEMATHESIS_SECONDS = 120  # the run takes ~25 s on 2 cores; this only stops a runaway one


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own (schemathesis deletes and uploads voices), with short text limits so that the
    generated requests that reach synthesis stay short; OpenAI voice names (the schema's example) speak demo. The
    demo model's random weights do not stop on their own: a generous audio bound lets the engine's per-sentence
    cap end them (``"000000000000000"`` speaks 24 s; the bound itself is tested in test_audio_bound.py)."""
    srv = start_with_voice(tmp_path_factory.mktemp("fuzzed"), "--default-voice", "demo", "--max-input-chars", "16",
                           "--max-instructions-chars", "32", "--timeout", "20",
                           "--max-audio-per-char", "5")  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def test_the_schema_says_what_the_server_sends(fuzzed: Server) -> None:
    with fuzzed.client() as c:
        schema = c.get("/openapi.json").json()
    paths = schema["paths"]
    speech = paths["/v1/audio/speech"]["post"]["responses"]
    assert "HTTPValidationError" not in str(schema)  # validation errors are 400s, not FastAPI's 422
    assert [(p, m) for p, ops in paths.items() for m, op in ops.items() if "422" in op.get("responses", {})] == [
        ("/v1/audio/speech", "post")] and "audio" in speech["422"]["description"]  # only the audio bound's  # fmt: skip
    assert set(speech["200"]["content"]) == {"audio/mpeg", "audio/ogg", "audio/flac", "audio/wav", "audio/pcm",
                                             "text/event-stream"}  # fmt: skip
    assert {"400", "403", "408", "413", "415", "422", "429", "500", "503", "504"} <= set(speech)
    assert {"X-Sample-Rate", "X-Speed-Clamped", "X-Voice"} <= set(speech["200"]["headers"])
    assert "Retry-After" in speech["429"]["headers"]
    body = schema["components"]["schemas"]["SpeechRequest"]["properties"]
    assert body["input"]["maxLength"] == 16 and body["speed"]["minimum"] == 0.25 and body["speed"]["maximum"] == 4
    upload = paths["/v1/audio/voices"]["post"]
    form = upload["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["name", "file"] and form["properties"]["file"]["format"] == "binary"
    assert {"201", "400", "409", "413"} <= set(upload["responses"])
    assert {"204", "404", "409"} <= set(paths["/v1/audio/voices/{name}"]["delete"]["responses"])
    error = schema["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["properties"]["code"] == {"type": "string"} and "code" in error["required"]
    assert "security" not in speech and "securitySchemes" not in schema["components"]  # no key on this server


def test_options_and_405_list_every_method(fuzzed: Server) -> None:
    with fuzzed.client() as c:
        r = c.options("/v1/audio/voices")
        assert r.status_code == 204 and r.headers["allow"] == "GET, OPTIONS, POST"
        r = c.put("/v1/audio/voices")
        assert r.status_code == 405 and r.headers["allow"] == "GET, OPTIONS, POST"
        assert r.json()["error"]["code"] == "method_not_allowed"
        assert c.options("/v1/audio/speech").headers["allow"] == "OPTIONS, POST"
        assert c.options("/v1/audio/voices/demo").headers["allow"] == "DELETE, OPTIONS"


def test_docs_work_offline(fuzzed: Server) -> None:
    with fuzzed.client() as c:
        page = c.get("/docs")
        assert page.status_code == 200 and "/openapi.json" in page.text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)  # nothing from a CDN
        assert c.get("/redoc").status_code == 404


def test_schemathesis_finds_nothing(fuzzed: Server, tmp_path: Path) -> None:
    """Bounded: a fixed seed, 10 examples per operation, one worker, loopback only. positive_data_acceptance is
    left out: a request can match the schema and still be refused, for a voice that is not saved or text with
    nothing to speak (the schema cannot list the saved voices)."""
    cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
           f"{fuzzed.url}/openapi.json", "--max-examples", "10", "--phases", "examples,coverage,fuzzing",
           "--seed", "1", "--workers", "1", "--request-timeout", "60", "--checks", "all",
           "--exclude-checks", "positive_data_acceptance", "--no-color", "--report", "junit",
           "--report-dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=SCHEMATHESIS_SECONDS, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert re.search(r"\d+ generated, \d+ passed", run.stdout), run.stdout[-2000:]
    with fuzzed.client() as c:  # and the server is still whole
        assert c.get("/health").json()["status"] == "ok"
        assert "demo" in [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]]
