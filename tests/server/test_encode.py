"""The speech API's audio encoders: every format, streamed and whole, decoded back with soundfile."""

from __future__ import annotations

import io
import struct
from itertools import cycle

import numpy as np
import pytest
import soundfile as sf
import soxr

from cosyvoice_cpu.server.encode import FORMATS, Encoder, UnsupportedFormatError, check_format, encode_all

RATES = (24000, 22050)  # the models' output rates
CHUNKS = (0, 1000, 0, 3333, 7, 5000, 1, 2400)  # uneven pushes, empty ones included
LOSSLESS = ("wav", "pcm", "flac")
MP3_DELAY = 576 + 529  # lame's encoder delay + the decoder's; only a gapless (Info-tag) mp3 hides it
MP3_FRAME = 576  # samples per MPEG-2 Layer III frame (16-24 kHz)


def sine(rate: int, seconds: float = 1.5, amplitude: float = 0.5) -> np.ndarray:
    """A 440 Hz sine."""
    return (amplitude * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def quantized(x: np.ndarray) -> np.ndarray:
    """The int16 the lossless formats must hold: clipped, scaled by 32767, rounded."""
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def encode(fmt: str, x: np.ndarray, rate: int, streaming: bool, chunks=CHUNKS) -> tuple[bytes, list[bytes]]:
    """All bytes, and the bytes each push returned."""
    encoder = Encoder(fmt, rate, streaming)
    pushed, start = [], 0
    for size in cycle(chunks):
        if start >= len(x):
            break
        pushed.append(encoder.push(x[start : start + size]))
        start += size
    return b"".join(pushed) + encoder.finish(), pushed


def decode(fmt: str, data: bytes, rate: int, dtype: str = "float32") -> tuple[int, np.ndarray]:
    """(sample rate, samples). Reads in blocks into NaN-filled buffers: a streamed flac has an unknown length,
    and soundfile raises after libsndfile has decoded its last block (see encode.py)."""
    if fmt == "pcm":
        pcm = np.frombuffer(data, "<i2")
        return rate, pcm.astype(np.int16) if dtype == "int16" else (pcm / 32767).astype(np.float32)
    blocks = []
    with sf.SoundFile(io.BytesIO(data)) as f:
        while True:
            buf = np.full(8192, np.nan)
            try:
                block = f.read(8192, dtype="float64", out=buf)
            except sf.LibsndfileError:
                block = buf[: np.count_nonzero(~np.isnan(buf))]
            if not len(block):
                break
            blocks.append(block)
        out_rate = f.samplerate
    y = np.concatenate(blocks) if blocks else np.zeros(0)
    return out_rate, (np.round(y * 32768).astype(np.int16) if dtype == "int16" else y.astype(np.float32))


def expected_rate(fmt: str, rate: int) -> int:
    """Opus takes 24 kHz but not 22.05 kHz: the encoder resamples that to 48 kHz."""
    return 48000 if fmt == "opus" and rate == 22050 else rate


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip(fmt: str, rate: int, streaming: bool) -> None:
    x = sine(rate)
    data, _ = encode(fmt, x, rate, streaming)
    out_rate, y = decode(fmt, data, rate, "int16" if fmt in LOSSLESS else "float32")
    assert out_rate == expected_rate(fmt, rate)
    if fmt in LOSSLESS:
        np.testing.assert_array_equal(y, quantized(x))
        return
    ref = soxr.resample(x, rate, out_rate) if out_rate != rate else x
    delay = 0
    if fmt == "opus":  # the Ogg granule positions cut the pre-skip and the padded last frame: exact (±2 for soxr)
        assert abs(len(y) - len(ref)) <= 2
    elif streaming:  # mp3 without its Info tag: lame's delay in front, the last frame padded out
        assert MP3_DELAY <= len(y) - len(ref) < MP3_DELAY + 2 * MP3_FRAME
        delay = MP3_DELAY
    else:  # whole mp3: the Info/LAME tag carries delay and padding, the decoder trims both (gapless)
        assert len(y) == len(ref)
    y = y[delay:]
    n = min(len(y), len(ref))
    assert np.corrcoef(y[:n], ref[:n])[0, 1] > 0.9
    spectrum = np.abs(np.fft.rfft(y[:n] * np.hanning(n)))
    assert abs(np.fft.rfftfreq(n, 1 / out_rate)[np.argmax(spectrum)] - 440) < 2


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_clipping(fmt: str) -> None:
    x = np.array([-3, -1.5, -1, -0.25, 0, 0.25, 1, 1.5, 3] * 800, dtype=np.float32)
    if fmt in LOSSLESS:
        _, y = decode(fmt, encode_all(fmt, x, 24000), 24000, "int16")
        np.testing.assert_array_equal(y, quantized(x))
        assert y.max() == 32767 and y.min() == -32767
        return
    loud = 3 * sine(24000, 0.5)  # clipped to a near-square wave, not wrapped around
    _, y = decode(fmt, encode_all(fmt, loud, 24000), 24000)
    assert np.abs(y).max() < 1.3
    n = min(len(y), len(loud))
    assert np.corrcoef(y[:n], np.clip(loud, -1, 1)[:n])[0, 1] > 0.9


def test_streaming_wav_header() -> None:
    data, pushed = encode("wav", sine(24000), 24000, streaming=True)
    fmt_chunk = struct.pack("<IHHIIHH", 16, 1, 1, 24000, 48000, 2, 16)
    assert pushed[0][:44] == b"RIFF\xff\xff\xff\xffWAVEfmt " + fmt_chunk + b"data\xff\xff\xff\xff"
    whole = encode_all("wav", sine(24000), 24000)
    assert struct.unpack("<I", whole[4:8])[0] == len(whole) - 8 and struct.unpack("<I", whole[40:44])[0] == 36000 * 2
    assert whole[44:] == data[44:]
    assert sf.info(io.BytesIO(data)).frames == 36000  # libsndfile clamps the 0xFFFFFFFF data size to the file


def test_header_seek_backs() -> None:
    """Streaming drops libsndfile's rewrites of bytes already sent; whole files keep them."""
    x = sine(24000)
    flac, _ = encode("flac", x, 24000, streaming=True)
    whole = encode_all("flac", x, 24000)

    def total(b: bytes) -> int:  # STREAMINFO's 36-bit total samples
        return int.from_bytes(b[21:26], "big") & 0xFFFFFFFFF

    assert flac[:4] == b"fLaC" and total(flac) == 0 and flac[26:42] == bytes(16)  # unknown length, no MD5
    assert total(whole) == len(x) and whole[26:42] != bytes(16)
    mp3, _ = encode("mp3", x, 24000, streaming=True)
    whole = encode_all("mp3", x, 24000)
    assert b"Info" in whole[:200] and b"Info" not in mp3[:200]  # the blank tag frame was dropped, not sent
    assert len(whole) - len(mp3) == 192  # one 64 kbit/s frame at 24 kHz: 72 * 64000 / 24000 bytes


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streaming_emits_before_finish(fmt: str, rate: int) -> None:
    """6 s in 0.2 s pushes. Observed: flac emits its header on the first push, then a frame per 4096-sample
    block (the partial last block at finish); mp3 some frames per push, lame keeping ~0.1 s until finish; opus a
    page per push at the 100 ms page latency the encoder sets (with libsndfile's default of 1000 ms only every
    5th push returned bytes, and 17% of them came at finish). wav/pcm: everything, at once."""
    x = sine(rate, 6.0)
    data, pushed = encode(fmt, x, rate, streaming=True, chunks=(rate // 5,))
    assert all(pushed), [len(p) for p in pushed]
    assert sum(map(len, pushed)) > 0.9 * len(data)
    whole, _ = encode(fmt, x, rate, streaming=False, chunks=(rate // 5,))
    assert len(whole) > 0 and decode(fmt, whole, rate)[0] == expected_rate(fmt, rate)


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_empty_input(fmt: str, streaming: bool) -> None:
    data, _ = encode(fmt, np.zeros(0, np.float32), 24000, streaming)
    rate, y = decode(fmt, data, 24000)
    assert rate == 24000 and len(y) <= 1 and np.abs(y).max(initial=0) < 1e-6  # flac/mp3/opus: one zero sample


def test_formats_and_errors() -> None:
    assert FORMATS == {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/ogg",
                       "flac": "audio/flac"}  # fmt: skip
    assert check_format(" MP3 ") == "mp3" and Encoder("Opus", 24000, True).media_type == "audio/ogg"
    with pytest.raises(UnsupportedFormatError, match=r"aac.*mp3 or opus") as err:
        check_format("aac")
    assert isinstance(err.value, ValueError) and all(f in str(err.value) for f in FORMATS)
    for bad in ("ogg", "", "wav2"):
        with pytest.raises(UnsupportedFormatError, match="wav, pcm, mp3, opus, flac"):
            check_format(bad)
    with pytest.raises(UnsupportedFormatError):
        Encoder("aac", 24000, streaming=True)
    with pytest.raises(ValueError):
        Encoder("wav", 0, streaming=True)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_push_after_finish(fmt: str) -> None:
    encoder = Encoder(fmt, 24000, streaming=True)
    encoder.push(sine(24000, 0.1))
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.push(sine(24000, 0.1))
    with pytest.raises(RuntimeError):
        encoder.finish()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_long_whole_file_is_spooled_to_disk_not_held_in_memory(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``"stream": false`` held the whole encoded file in memory (77.5 MB of WAV for 1,615 s of audio in issue
    #35). Past the spool size the file is on disk: the Python memory it takes stays at a chunk's worth however long
    the audio, and the file is the one encode_all makes."""
    import tracemalloc

    from cosyvoice_cpu.server import encode as encode_module

    monkeypatch.setattr(encode_module, "SPOOL_BYTES", 256 << 10)
    rate, second = 24000, sine(24000, 1.0)
    tracemalloc.start()
    try:
        encoder = Encoder(fmt, rate, streaming=False, spool=True)
        for _ in range(120):  # 2 minutes: 5.8 MB as wav or pcm
            assert encoder.push(second) == b""
        assert encoder.finish() == b""
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + (256 << 10), peak  # the spool's 256 KB and a chunk, not the file
    file, size = encoder.output()
    with file:
        data = file.read()
    assert size == len(data) and (fmt not in ("wav", "pcm") or size >= 120 * rate * 2)
    assert data == encode_all(fmt, np.tile(second, 120), rate) or fmt in ("mp3", "opus")  # lossy: same length
    got_rate, y = decode(fmt, data, rate)
    assert got_rate == expected_rate(fmt, rate) and abs(len(y) - 120 * got_rate) <= 1
