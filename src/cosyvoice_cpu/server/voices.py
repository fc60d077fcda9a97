"""The server's saved voices: one ``NAME.npz`` per voice in a directory, written atomically.

A voice file is written to a temporary file, fsynced and renamed over its final name (:meth:`Voice.save`), so a
crash or ``kill -9`` in the middle of an upload leaves either the old voice or the new one, never half of one.
Temporary files left by such a crash are removed at start. Files that do not load (corrupt, made for another
model) are reported and skipped, not served; nothing is ever deleted except through :meth:`VoiceStore.remove`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from cosyvoice_cpu.voice import Voice, VoiceError, check_name

logger = logging.getLogger(__name__)

SUFFIX = ".npz"


class VoiceNotFoundError(VoiceError):
    """No saved voice of that name."""


class VoiceExistsError(VoiceError):
    """A voice of that name exists and overwriting was not asked for."""


class VoiceStore:
    """Saved voices of one model (family and sample rate), cached in memory after the first load.

    Args:
        directory: where the ``.npz`` files live (created if missing).
        family, sample_rate: the loaded model's; voices made for another model are skipped with a warning.
        builtin: the model's built-in speakers (CosyVoice-300M-SFT), served read-only beside the saved voices.
    """

    def __init__(self, directory: str | Path, family: str, sample_rate: int,
                 builtin: dict[str, Voice] | None = None) -> None:  # fmt: skip
        self.directory = Path(directory)
        self.family, self.sample_rate = family, sample_rate
        self.builtin = dict(builtin or {})
        self._lock = threading.Lock()
        self._voices: dict[str, Voice] = {}
        self.skipped: dict[str, str] = {}  # file name -> why it is not served
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()

    def path(self, name: str) -> Path:
        """The file of voice ``name`` (the name is validated: no path parts can get through)."""
        return self.directory / f"{check_name(name)}{SUFFIX}"

    def _scan(self) -> None:
        for tmp in self.directory.glob(f".*{SUFFIX}.*.tmp"):  # left by a crash during a write
            logger.warning("removing %s, an unfinished voice write", tmp.name)
            tmp.unlink(missing_ok=True)
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                voice = Voice.load(path)
                voice.check_model(self.family, self.sample_rate)
                if voice.name != path.stem:
                    raise VoiceError(f"it holds voice {voice.name!r}, not {path.stem!r}")
            except VoiceError as e:
                self.skipped[path.name] = str(e)
                logger.warning("not serving %s: %s", path, e)
                continue
            self._voices[voice.name] = voice
        logger.info("%d saved voices in %s", len(self._voices), self.directory)

    def names(self) -> list[str]:
        with self._lock:
            return sorted({*self._voices, *self.builtin})

    def get(self, name: str) -> Voice:
        """The voice called ``name``; VoiceNotFoundError (naming the voices there are) if none."""
        with self._lock:
            voice = self._voices.get(name) or self.builtin.get(name)
            if voice is None:
                known = ", ".join(sorted({*self._voices, *self.builtin}))
                known = known or "none yet; add one with POST /v1/audio/voices"
                raise VoiceNotFoundError(f"no voice named {name!r}; saved voices: {known}")
            return voice

    def __len__(self) -> int:
        return len({*self._voices, *self.builtin})

    def _check_writable(self, name: str) -> None:
        if name in self.builtin:
            raise VoiceExistsError(f"{name!r} is a built-in speaker of the model; it cannot be replaced or deleted "
                                   "(choose another name)")  # fmt: skip

    def add(self, voice: Voice, overwrite: bool = False) -> Path:
        """Save ``voice`` under its name (atomically) and serve it from now on."""
        voice.check_model(self.family, self.sample_rate)
        self._check_writable(voice.name)
        path = self.path(voice.name)
        with self._lock:
            if voice.name in self._voices and not overwrite:
                raise VoiceExistsError(f"a voice named {voice.name!r} exists; delete it first or pass overwrite=true")
            voice.save(path)
            self._voices[voice.name] = voice
        logger.info("saved voice %r to %s", voice.name, path)
        return path

    def remove(self, name: str) -> None:
        """Delete voice ``name`` (file and memory); VoiceNotFoundError if there is none."""
        path = self.path(name)
        self._check_writable(name)
        with self._lock:
            if name not in self._voices:
                raise VoiceNotFoundError(f"no voice named {name!r}")
            path.unlink(missing_ok=True)
            del self._voices[name]
        logger.info("deleted voice %r", name)
