"""OpenAI compatibility through the official SDK (issue #28): OpenAI's voice names, its speed range and the model
family name; and whole files (``"stream": false``) that carry their real length, as files written by the SDK."""

from __future__ import annotations

import io
import struct
import typing
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import typing_extensions

from .conftest import VOICE, Server

openai = pytest.importorskip("openai")  # the dev extra installs it
TEXT = "Warning: line three is overheating."


def sdk_names(alias: object) -> set[str]:
    """Every string of the Literal types inside ``alias`` (an SDK type such as ``Union[str, Literal[...], ...]``)."""
    if typing.get_origin(alias) in (typing.Literal, typing_extensions.Literal):
        return {a for a in typing.get_args(alias) if isinstance(a, str)}
    return set().union(*(sdk_names(a) for a in typing.get_args(alias)))


def sdk_voices() -> set[str]:
    """The voice names the installed SDK's ``audio.speech.create`` lists (13 in openai 3.60, with marin and cedar)."""
    from openai.types.audio import speech_create_params

    names = sdk_names(speech_create_params.Voice)
    assert len(names) >= 13, names  # the SDK's own list was found
    return names


def client(server: Server) -> object:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_voice_names_speak_the_default_voice(tuned: Server) -> None:
    c = client(tuned)
    want = c.audio.speech.create(model="tts-1", voice=VOICE, input="Hi.", response_format="pcm",
                                 extra_body={"seed": 5}).content  # fmt: skip
    names = sdk_voices()
    for name in sorted(names):
        r = c.audio.speech.with_raw_response.create(model="tts-1", voice=name, input="Hi.", response_format="pcm",
                                                    extra_body={"seed": 5})  # fmt: skip
        assert r.headers["x-voice"] == VOICE
        assert r.content == want, name
    from cosyvoice_cpu.server.checks import OPENAI_VOICES

    assert set(OPENAI_VOICES) == names  # what docs/server.md lists too


def test_every_openai_model_name_of_the_sdk_is_taken(tuned: Server) -> None:
    from openai.types.audio.speech_model import SpeechModel

    for model in sorted(sdk_names(SpeechModel)):
        r = client(tuned).audio.speech.create(model=model, voice=VOICE, input="Hi.", response_format="pcm")
        assert len(r.content) > 2400, model


def test_openai_voice_names_without_a_default_voice_say_how(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(server).audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
    error = e.value.body
    assert error["code"] == "voice_not_found" and "--default-voice NAME" in error["message"]
    assert "'alloy' is an OpenAI voice" in error["message"] and VOICE in error["message"]


@pytest.mark.parametrize(("speed", "applied"), [(0.25, 0.5), (0.4, 0.5), (3.0, 2.0), (4.0, 2.0)])
def test_openai_speeds_are_clamped_and_the_response_says_so(tuned: Server, speed: float, applied: float) -> None:
    c = client(tuned)
    r = c.audio.speech.with_raw_response.create(model="tts-1", voice=VOICE, input=TEXT, response_format="pcm",
                                                speed=speed, extra_body={"seed": 5})  # fmt: skip
    assert float(r.headers["x-speed-clamped"]) == applied
    same = c.audio.speech.with_raw_response.create(model="tts-1", voice=VOICE, input=TEXT, response_format="pcm",
                                                   speed=applied, extra_body={"seed": 5})  # fmt: skip
    assert "x-speed-clamped" not in same.headers and same.content == r.content


@pytest.mark.parametrize("speed", [0.2, 4.5, -1.0])
def test_speeds_outside_openais_range_are_refused(tuned: Server, speed: float) -> None:
    with pytest.raises(openai.BadRequestError, match=r"0\.25 to 4\.0"):
        client(tuned).audio.speech.create(model="tts-1", voice=VOICE, input=TEXT, speed=speed)


MODEL_NAMES = ["cosyvoice2", "CosyVoice2", "CosyVoice2-0.5B", "demo_model", "Demo_Model", "tts-1-hd", "gpt-4o-mini-tts"]


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_model_names(tuned: Server, model: str) -> None:
    r = client(tuned).audio.speech.create(model=model, voice=VOICE, input="Hi.", response_format="pcm")
    assert len(r.content) > 2400


def test_another_familys_name_is_refused(tuned: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="a cosyvoice2 model") as e:
        client(tuned).audio.speech.create(model="cosyvoice3", voice=VOICE, input="Hi.")
    assert e.value.body["code"] == "model_not_found"


def test_whole_files_carry_their_length(tuned: Server, tmp_path: Path) -> None:
    """``"stream": false``: the whole file at the end, with its real length; before, soundfile.read() failed on
    the FLAC and Python's wave module saw 2**31-1 frames in the WAV."""
    c = client(tuned)
    pcm = np.frombuffer(c.audio.speech.create(model="tts-1", voice=VOICE, input=TEXT, response_format="pcm",
                                              extra_body={"seed": 9, "stream": False}).content, "<i2")  # fmt: skip
    assert len(pcm) > 24000
    for fmt in ("flac", "wav", "mp3", "opus"):
        path = tmp_path / f"speech.{fmt}"
        with c.audio.speech.with_streaming_response.create(model="tts-1", voice=VOICE, input=TEXT,
                                                           response_format=fmt,
                                                           extra_body={"seed": 9, "stream": False}) as r:  # fmt: skip
            assert int(r.headers["content-length"]) > 100
            r.stream_to_file(path)
        data, rate = sf.read(path, dtype="int16")  # a plain read: the length is in the file
        assert rate == 24000
        if fmt in ("flac", "wav"):
            np.testing.assert_array_equal(data, pcm)
        else:  # mp3 with its Info tag: gapless, the exact length; opus: granule positions
            assert len(data) == len(pcm), (fmt, len(data), len(pcm))
    with wave.open(str(tmp_path / "speech.wav")) as w:
        assert w.getnframes() == len(pcm)
    assert sf.info(tmp_path / "speech.flac").frames == len(pcm)


def test_streamed_files_keep_the_streaming_form(tuned: Server) -> None:
    c = client(tuned)
    wav = c.audio.speech.create(model="tts-1", voice=VOICE, input="Hi.", response_format="wav").content
    assert struct.unpack("<I", wav[40:44])[0] == 0xFFFFFFFF  # unknown length: sent as it was made
    flac = c.audio.speech.create(model="tts-1", voice=VOICE, input="Hi.", response_format="flac").content
    assert int.from_bytes(flac[21:26], "big") & 0xFFFFFFFFF == 0  # STREAMINFO total samples: unknown
    with sf.SoundFile(io.BytesIO(flac)) as f:
        assert f.samplerate == 24000
