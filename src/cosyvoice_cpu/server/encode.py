"""Audio encoders for the speech API's ``response_format``, for whole responses and for chunked streaming.

:class:`Encoder` takes float mono samples push by push and returns the bytes that are ready; all returned
bytes concatenated form one file of the format. wav and pcm are written here; flac, mp3 and opus go through
libsndfile (bundled with ``soundfile``), which writes into :class:`_Sink`, an append-only file-like object
that hands out new bytes on every push. Findings with libsndfile 1.2.2, which this module is built around:

* wav (streaming): a 44-byte PCM16 header whose RIFF and data sizes are 0xFFFFFFFF (length unknown, as
  streaming TTS servers send it), then raw PCM. libsndfile reads it: it clamps the data chunk to the bytes
  present. Not streaming: a standard header with the exact sizes.
* flac: frames come out as each 4096-sample block fills. At close libsndfile seeks back to rewrite
  STREAMINFO (min/max frame size, total samples, MD5). When streaming, those bytes are already sent, so the
  rewrite is dropped: total samples 0 and MD5 0 mean "unknown" in the FLAC spec (as libFLAC leaves them on
  output it cannot seek). libsndfile then reports an unknown length, and soundfile's read raises a seek error
  after the last block, with that block already decoded into its ``out`` array.
* mp3: constant 64 kbit/s at 16-32 kHz (lame) gives a usable length estimate without a Xing/Info header. lame
  writes a blank Info-tag frame first and fills it in at close (a seek back). A stream that cannot
  receive that fill gets no blank frame: we drop it, and with it lame's gapless info. The rest decodes to the
  same samples, behind 1105 samples of delay (576 encoder + 529 decoder) and with the padding of the last frame.
* opus (Ogg): pages flush only every 1000 ms by default. When streaming we set libsndfile's
  SFC_SET_OGG_PAGE_LATENCY_MS to 100 ms, so a page goes out on nearly every push. There are no seek-backs,
  and the final granule position trims the length exactly. Opus takes 8/12/16/24/48 kHz; other rates are
  resampled to 48 kHz with soxr.
"""

from __future__ import annotations

import io
import logging
import struct
import tempfile
from typing import IO

import numpy as np
import soundfile as sf
import soxr

logger = logging.getLogger(__name__)

FORMATS: dict[str, str] = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",  # raw 16-bit little-endian mono, like OpenAI's pcm
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",  # Ogg Opus
    "flac": "audio/flac",
}

_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
_RATES = {
    "opus": (8000, 12000, 16000, 24000, 48000),  # anything else is resampled to the last one
    "mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
}
_MP3_COMPRESSION = 0.63  # libsndfile maps 0..1 to 160..8 kbit/s at 16-32 kHz: 64 kbit/s (~128 at 44.1/48 kHz)
_OGG_PAGE_LATENCY_MS = 100.0
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h; soundfile has no wrapper for it
_UNKNOWN_SIZE = 0xFFFFFFFF
SPOOL_BYTES = 4 << 20  # a whole file is held in memory up to this size, then in a temporary file


class UnsupportedFormatError(ValueError):
    """A ``response_format`` this server cannot encode."""


def check_format(name: str) -> str:
    """The normalized (lower-case) format name; raises :class:`UnsupportedFormatError` if unsupported."""
    fmt = name.strip().lower() if isinstance(name, str) else ""
    if fmt not in FORMATS:
        raise UnsupportedFormatError(
            f"unsupported response_format {name!r}; supported: {', '.join(FORMATS)} "
            "(aac is not available, libsndfile has no AAC encoder: use mp3 or opus)"
        )
    return fmt


def _wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE PCM16 mono header; ``data_bytes=None`` writes 0xFFFFFFFF sizes (unknown length)."""
    riff = _UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN_SIZE if data_bytes is None else data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16)  # PCM, mono, 16 bit
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", data)


def _to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples, clipped to [-1, 1], as rounded little-endian int16 (scale 32767)."""
    x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.round(x * 32767.0).astype("<i2")


def _mp3_frame_length(head: bytes) -> int | None:
    """Byte length of the MPEG Layer III frame whose 4-byte header is ``head``, or None if it is not one."""
    if len(head) < 4 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0 or (head[1] >> 1) & 3 != 1:
        return None
    version, rate_index, bitrate_index = (head[1] >> 3) & 3, (head[2] >> 2) & 3, head[2] >> 4
    if version == 1 or rate_index == 3 or bitrate_index in (0, 15):
        return None
    mpeg1 = version == 3
    kbps = (
        (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
        if mpeg1
        else (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)
    )[bitrate_index]
    rate = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}[version][rate_index]
    return (144 if mpeg1 else 72) * kbps * 1000 // rate + ((head[2] >> 1) & 1)


class _Sink:
    """Append-only file-like target for libsndfile's virtual IO (write/seek/tell/read).

    Bytes past ``sent`` are pending and may still be rewritten; :meth:`take` hands them out. A write behind
    ``sent`` (a seek-back to patch a header already sent) is dropped, and the lost bytes are logged.
    """

    def __init__(self) -> None:
        self.pending = bytearray()
        self.sent = 0  # bytes handed out
        self.pos = 0

    @property
    def end(self) -> int:
        """Total bytes written so far."""
        return self.sent + len(self.pending)

    def write(self, data: bytes) -> int:
        """Write at the current position; returns the length written (always all of it)."""
        data, n, start = bytes(data), len(data), self.pos
        if start > self.end:
            self.pending.extend(bytes(start - self.end))
        if start < self.sent:
            lost = min(n, self.sent - start)
            logger.debug("dropped a %d-byte rewrite at offset %d: already sent", lost, start)
            data, start = data[lost:], start + lost
        i = start - self.sent
        self.pending[i : i + len(data)] = data
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move the position (whence as for files) and return it."""
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.end}[whence] + offset
        return self.pos

    def tell(self) -> int:
        """The current position."""
        return self.pos

    def read(self, size: int = -1) -> bytes:
        """Bytes still pending at the position (libsndfile does not read back while writing)."""
        i = max(self.pos - self.sent, 0)
        data = bytes(self.pending[i : None if size < 0 else i + size])
        self.pos += len(data)
        return data

    def take(self, skip_blank_mp3_tag: bool = False, final: bool = False) -> bytes:
        """Hand out the pending bytes; optionally drop a leading blank (still unfilled) mp3 Info-tag frame.

        Until the first mp3 frame is complete nothing is handed out (unless ``final``), so a short stream
        keeps lame's filled-in tag.
        """
        data = bytes(self.pending)
        if skip_blank_mp3_tag and self.sent == 0:
            size = _mp3_frame_length(data[:4])
            if size is not None and len(data) < size and not final:
                return b""
            if size is not None and len(data) >= size and not any(data[4:size]):
                data = data[size:]
        self.sent += len(self.pending)
        self.pending.clear()
        return data


class Encoder:
    """Incremental encoder for one response: ``push`` float mono samples, then ``finish`` once.

    Not streaming, the file is written into a temporary file held in memory up to :data:`SPOOL_BYTES` and on disk
    beyond (``tempfile.SpooledTemporaryFile``, in ``$TMPDIR``), so a long whole file does not sit in memory; with
    ``spool``, ``finish`` leaves it there for :meth:`output` instead of returning its bytes.

    Args:
        fmt: a name in :data:`FORMATS` (any case); sample_rate: of the pushed samples, in Hz;
        streaming: emit bytes as they become ready (chunked HTTP) rather than all at ``finish``;
        spool: (not streaming) keep the file for :meth:`output`; ``finish`` then returns ``b""``.
    """

    def __init__(self, fmt: str, sample_rate: int, streaming: bool, spool: bool = False) -> None:
        self.fmt = check_format(fmt)
        if int(sample_rate) != sample_rate or sample_rate <= 0:
            raise ValueError(f"bad sample rate {sample_rate!r}")
        self.sample_rate = int(sample_rate)
        self.streaming = streaming
        self.spool = spool and not streaming
        self.media_type = FORMATS[self.fmt]
        self._done = False
        self._out: IO[bytes] | None = None  # the whole file (not streaming)
        self._pcm_bytes = 0
        self._resampler: soxr.ResampleStream | None = None
        self._sink: _Sink | None = None
        self._file: sf.SoundFile | None = None
        self._written = 0  # samples given to libsndfile
        self._header = b""
        if not streaming:
            self._out = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, prefix="cosyvoice-speech-")
        if self.fmt == "wav":
            if streaming:
                self._header = _wav_header(self.sample_rate, None)
            else:
                self._out.write(_wav_header(self.sample_rate, 0))  # sizes filled in at finish
        elif self.fmt in _SOUNDFILE:
            self._open_soundfile()

    def _open_soundfile(self) -> None:
        rate, rates = self.sample_rate, _RATES.get(self.fmt)
        if rates and rate not in rates:
            rate = rates[-1]
            self._resampler = soxr.ResampleStream(self.sample_rate, rate, 1, dtype="float32")
            logger.debug("%s: resampling %d Hz to %d Hz", self.fmt, self.sample_rate, rate)
        major, subtype = _SOUNDFILE[self.fmt]
        extra = {"compression_level": _MP3_COMPRESSION, "bitrate_mode": "CONSTANT"} if self.fmt == "mp3" else {}
        self._sink = _Sink() if self.streaming else None
        target = self._sink if self.streaming else self._out  # whole: a real file, so the header patches land
        self._file = sf.SoundFile(target, "w", rate, 1, subtype, format=major, **extra)
        if self.fmt == "opus" and self.streaming:
            self._set_ogg_page_latency(_OGG_PAGE_LATENCY_MS)

    def _set_ogg_page_latency(self, ms: float) -> None:
        try:  # soundfile's cffi handle: private API, so fall back to libsndfile's default (1000 ms) on failure
            value = sf._ffi.new("double*", ms)
            status = sf._snd.sf_command(self._file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, sf._ffi.sizeof("double"))
        except (AttributeError, TypeError) as exc:
            status = exc
        if status != 0:
            logger.debug("could not set the Ogg page latency (%s); pages flush every 1000 ms", status)

    def push(self, samples: np.ndarray) -> bytes:
        """Encode float32 mono samples in [-1, 1] (clipped outside); returns the bytes ready now (maybe b"")."""
        if self._done:
            raise RuntimeError("push after finish")
        x = np.clip(np.nan_to_num(np.asarray(samples, dtype=np.float32).reshape(-1)), -1.0, 1.0)
        if self.fmt in ("wav", "pcm"):
            pcm = _to_int16(x).tobytes()
            if self.streaming:
                out, self._header = self._header + pcm, b""
                return out
            self._out.write(pcm)
            self._pcm_bytes += len(pcm)
            return b""
        self._write(x, last=False)
        return self._take() if self.streaming else b""

    def _write(self, x: np.ndarray, last: bool) -> None:
        if self._resampler is not None:
            x = np.clip(self._resampler.resample_chunk(x, last=last), -1.0, 1.0)
        if last and not self._written and not len(x):
            x = np.zeros(1, np.float32)  # libsndfile writes no valid flac/mp3/opus without audio: one zero sample
        if len(x):
            self._file.write(_to_int16(x) if self.fmt == "flac" else x)  # flac: our int16, exactly as wav/pcm
            self._written += len(x)

    def _take(self, final: bool = False) -> bytes:
        return self._sink.take(skip_blank_mp3_tag=self.fmt == "mp3", final=final)

    def finish(self) -> bytes:
        """Flush the encoder and return the remaining bytes (with ``spool``: ``b""``, the file is in
        :meth:`output`); call once."""
        if self._done:
            raise RuntimeError("finish called twice")
        self._done = True
        if self.streaming and self.fmt in ("wav", "pcm"):
            return self._header  # streaming wav: the header if nothing was pushed
        if self.fmt in _SOUNDFILE:
            self._write(np.zeros(0, np.float32), last=True)
            self._file.close()  # flushes; flac and mp3 seek back to patch their headers here
            if self.streaming:
                return self._take(final=True)
        elif self.fmt == "wav":
            self._out.seek(0)
            self._out.write(_wav_header(self.sample_rate, self._pcm_bytes))
        if self.spool:
            return b""
        file, _ = self.output()
        with file:
            return file.read()

    def output(self) -> tuple[IO[bytes], int]:
        """(the whole file, rewound, and its size in bytes) after :meth:`finish` of a non-streaming encoder; the
        caller closes it (a file on disk is deleted then)."""
        if self.streaming or not self._done:
            raise RuntimeError("output is the whole file of a finished, non-streaming encoder")
        size = self._out.seek(0, io.SEEK_END)
        self._out.seek(0)
        return self._out, size

    def close(self) -> None:
        """Drop the whole file (a response that will not be sent); no-op when streaming."""
        if self._out is not None:
            self._out.close()


def encode_all(fmt: str, samples: np.ndarray, sample_rate: int) -> bytes:
    """The whole file of ``samples`` (float mono in [-1, 1]) in format ``fmt``."""
    encoder = Encoder(fmt, sample_rate, streaming=False)
    return encoder.push(samples) + encoder.finish()
