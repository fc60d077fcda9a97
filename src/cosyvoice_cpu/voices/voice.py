"""A cloned voice: everything the engine needs about a prompt, computed once and saved as a small ``.npz``.

A :class:`Voice` holds the prompt's transcript, its speech tokens (25 Hz), its mel at the model rate and the
speaker x-vector. Saving is atomic (temporary file + rename), loading validates every array, so a server never
serves a half-written or corrupt voice.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.jsontypes import JsonValue

logger = logging.getLogger(__name__)

VOICE_FORMAT = 1
NAME_RE = re.compile(r"^[A-Za-z0-9\u00C0-\uFFFF][\w\u00C0-\uFFFF .-]{0,63}$")
N_MELS = 80
EMBEDDING_DIM = 192


class VoiceError(ConfigError):
    """A voice file is missing, corrupt, from another model family, or its name is not allowed."""


def check_name(name: str) -> str:
    """A voice name usable as a file name everywhere: 1-64 letters, digits, ``_ - . space``, no path parts, and no
    invisible characters (controls, format and bidi characters such as U+202E or U+FEFF, unassigned code points):
    a name that looks like another one in a listing, or reverses the text after it, is refused."""
    import unicodedata

    if not isinstance(name, str) or not NAME_RE.match(name) or name.strip() != name or ".." in name:
        raise VoiceError(
            f"voice name {name!r} is not allowed: use 1-64 letters, digits, '_', '-', '.', or spaces, starting with "
            "a letter or digit (no slashes, no '..')"
        )
    bad = next((c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), None)
    if bad is not None:
        raise VoiceError(
            f"voice name {name!r} is not allowed: it holds the invisible character U+{ord(bad):04X} (a control, "
            "format or bidi character); use letters, digits, '_', '-', '.' and spaces"
        )
    return name


def write_temp(data: bytes, directory: Path, prefix: str, suffix: str = ".tmp") -> str:
    """``data`` in a new temporary file of ``directory`` (mode 0644), flushed to disk: ready to be published by a
    rename or link. Returns its path; on failure nothing is left behind."""
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def fsync_dir(directory: Path) -> None:
    """Make a rename, link or unlink in ``directory`` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass
class Voice:
    """A prompt, ready for synthesis.

    Attributes:
        name: the voice's name (see :func:`check_name`).
        prompt_text: the transcript of the prompt audio ("" for cross-lingual voices).
        speech_tokens: (T_tok,) int32 speech tokens of the prompt (25 Hz for CosyVoice2, 50 Hz for CosyVoice-300M).
        mel: (T_mel, 80) float32 log-mel of the prompt at the model's sample rate (CosyVoice2: T_mel = 2 * T_tok).
        embedding: (192,) float32 speaker x-vector (campplus).
        family: model family the features were made for (a name of :data:`~cosyvoice_cpu.facts.FAMILIES`).
        A CosyVoice-300M built-in (SFT) speaker is a voice with no prompt: no tokens, no mel, no transcript.
        sample_rate: the model's sample rate the mel was computed at.
        meta: free-form facts (source file, duration, creation time).
    """

    name: str
    prompt_text: str
    speech_tokens: np.ndarray
    mel: np.ndarray
    embedding: np.ndarray
    family: str = "cosyvoice2"
    sample_rate: int = 24000
    meta: dict[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name(self.name)
        self.speech_tokens = np.asarray(self.speech_tokens, dtype=np.int32).reshape(-1)
        self.mel = np.asarray(self.mel, dtype=np.float32)
        self.embedding = np.asarray(self.embedding, dtype=np.float32).reshape(-1)
        if self.mel.ndim != 2 or self.mel.shape[1] != N_MELS:
            raise VoiceError(f"voice {self.name!r}: mel must be (frames, {N_MELS}), got {self.mel.shape}")
        if self.embedding.shape != (EMBEDDING_DIM,):
            raise VoiceError(
                f"voice {self.name!r}: embedding must hold {EMBEDDING_DIM} values, got {self.embedding.shape}"
            )
        if not (np.isfinite(self.mel).all() and np.isfinite(self.embedding).all()):
            raise VoiceError(f"voice {self.name!r} holds NaN or infinite values; make it again from the prompt audio")
        family = self.family_facts
        if self.builtin:
            if not family.builtin_speakers or self.prompt_text:
                raise VoiceError(f"voice {self.name!r} has no speech tokens; make it again from the prompt audio")
            return
        tokens, vocab = self.speech_tokens, family.speech_vocab
        if tokens.size == 0 or tokens.min() < 0 or tokens.max() >= vocab or self.mel.shape[0] == 0:
            raise VoiceError(
                f"voice {self.name!r} has no valid speech tokens (ids in [0, {vocab})) or no mel; make "
                "it again from the prompt audio"
            )
        ratio = family.mel_per_token
        if ratio and self.mel.shape[0] != ratio * tokens.size:
            raise VoiceError(
                f"voice {self.name!r}: {self.mel.shape[0]} mel frames for {tokens.size} tokens (need "
                f"{ratio} per token); make it again from the prompt audio"
            )

    @property
    def family_facts(self) -> FamilyFacts:
        """The facts of the voice's family (:mod:`cosyvoice_cpu.facts`); VoiceError for an unknown one."""
        try:
            return facts(self.family)
        except ModelDirError:
            raise VoiceError(f"voice {self.name!r} is for an unknown model family {self.family!r}") from None

    @property
    def builtin(self) -> bool:
        """A speaker without prompt audio (CosyVoice-300M-SFT's ``spk2info.pt``): only the x-vector conditions."""
        return self.speech_tokens.size == 0 and self.mel.shape[0] == 0

    @property
    def fingerprint(self) -> str:
        """sha256 of what synthesis uses (tokens, mel, embedding): the key of per-voice caches."""
        digest = hashlib.sha256()
        for arr in (self.speech_tokens, self.mel, self.embedding):
            digest.update(np.ascontiguousarray(arr).tobytes())
        return digest.hexdigest()

    @property
    def duration(self) -> float:
        """Seconds of prompt audio (from the mel frames at the family's mel rate)."""
        return self.mel.shape[0] * self.family_facts.mel_hop / self.sample_rate

    # ------------------------------------------------------------------ files

    def to_bytes(self) -> bytes:
        header = {
            "format": VOICE_FORMAT,
            "name": self.name,
            "prompt_text": self.prompt_text,
            "family": self.family,
            "sample_rate": self.sample_rate,
            "meta": self.meta,
        }
        buf = io.BytesIO()
        np.savez(
            buf,
            header=np.array(json.dumps(header, ensure_ascii=False)),
            speech_tokens=self.speech_tokens,
            mel=self.mel,
            embedding=self.embedding,
        )
        return buf.getvalue()

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temporary file in the same directory, fsync, then rename over ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = write_temp(self.to_bytes(), path.parent, f".{path.name}.")
        try:
            os.replace(tmp, path)
            fsync_dir(path.parent)  # make the rename itself durable
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "voice") -> Voice:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                header = json.loads(str(z["header"]))
                arrays = {k: z[k] for k in ("speech_tokens", "mel", "embedding")}
            if not isinstance(header, dict) or header.get("format") != VOICE_FORMAT:
                version = header.get("format") if isinstance(header, dict) else "?"
                raise VoiceError(
                    f"{where} has voice format {version}, this version reads {VOICE_FORMAT}; make the voice again"
                )
            return cls(
                str(header["name"]),
                str(header["prompt_text"]),
                family=str(header["family"]),
                sample_rate=int(header["sample_rate"]),
                meta=dict(header.get("meta", {})),
                **arrays,
            )
        except VoiceError:
            raise
        except (OSError, ValueError, TypeError, KeyError, zipfile.BadZipFile) as e:
            raise VoiceError(f"{where} is not a readable voice file ({type(e).__name__}); make the voice again") from e

    @classmethod
    def load(cls, path: str | Path) -> Voice:
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise VoiceError(f"voice file {path} not found") from e
        except OSError as e:
            raise VoiceError(f"voice file {path} cannot be read ({e.strerror or type(e).__name__})") from e
        return cls.from_bytes(data, str(path))

    def check_model(self, family: str, sample_rate: int) -> None:
        """Raise :class:`VoiceError` unless the voice was made for this model family and rate."""
        if (self.family, self.sample_rate) != (family, sample_rate):
            raise VoiceError(
                f"voice {self.name!r} was made for {self.family} at {self.sample_rate} Hz, this model is {family} at "
                f"{sample_rate} Hz; make the voice again with this model"
            )
