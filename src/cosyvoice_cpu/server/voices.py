"""The server's saved voices: a :class:`~cosyvoice_cpu.voices.store.VoiceStore` shared by every replica, plus the
model's built-in speakers.

The voices themselves live in a store that every process serving the same directory sees alike
(:class:`~cosyvoice_cpu.voices.store.DirectoryVoiceStore`: one ``NAME.npz`` per voice, published by write, fsync
and rename or link), so a voice uploaded through one replica is listed and used through every other at once, a
deleted one is gone everywhere, and ``kill -9`` at any moment leaves the old voice or the new one, never half of
one. Temporary files left by a writer that died are removed at start; files that do not load (corrupt, made for
another model) are reported and skipped, not served; nothing is deleted except through :meth:`VoiceStore.remove`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cosyvoice_cpu.voices.store import SUFFIX, DirectoryVoiceStore, VoiceExistsError, VoiceNotFoundError
from cosyvoice_cpu.voices.store import VoiceStore as SharedStore
from cosyvoice_cpu.voices.voice import Voice, VoiceError

logger = logging.getLogger(__name__)

__all__ = ["SUFFIX", "VoiceExistsError", "VoiceNotFoundError", "VoiceStore"]


class VoiceStore:
    """Saved voices of one model (family and sample rate) beside its built-in speakers.

    Args:
        directory: where the ``.npz`` files live (created if missing), or a ready :class:`SharedStore`.
        family, sample_rate: the loaded model's; voices made for another model are skipped with a warning.
        builtin: the model's built-in speakers (CosyVoice-300M-SFT), served read-only beside the saved voices.
    """

    def __init__(
        self,
        directory: str | Path | SharedStore,
        family: str,
        sample_rate: int,
        builtin: dict[str, Voice] | None = None,
    ) -> None:
        if isinstance(directory, SharedStore):
            self.store = directory
        else:
            self.store = DirectoryVoiceStore(directory, family, sample_rate)
        self.directory = Path(getattr(self.store, "directory", self.store.location))
        self.family, self.sample_rate = family, sample_rate
        self.builtin = dict(builtin or {})
        saved = self.store.list()
        logger.info("%d saved voices in %s", len(saved), self.store.location)

    @property
    def skipped(self) -> dict[str, str]:
        """File name -> why it is not served (as of the last listing)."""
        return dict(getattr(self.store, "skipped", {}))

    def path(self, name: str) -> Path:
        """The file of voice ``name`` (the name is validated: no path parts can get through)."""
        return self.store.path(name) if isinstance(self.store, DirectoryVoiceStore) else self.directory / name

    def names(self) -> list[str]:
        return sorted({*self.store.list(), *self.builtin})

    def get(self, name: str) -> Voice:
        """The voice called ``name``; VoiceNotFoundError (naming the voices there are) if none."""
        if name in self.builtin:
            return self.builtin[name]
        try:
            return self.store.get(name)
        except VoiceNotFoundError:
            known = ", ".join(self.names()) or "none yet; add one with POST /v1/audio/voices"
            raise VoiceNotFoundError(f"no voice named {name!r}; saved voices: {known}") from None

    def __len__(self) -> int:
        return len(self.names())

    def _check_writable(self, name: str) -> None:
        if name in self.builtin:
            raise VoiceExistsError(
                f"{name!r} is a built-in speaker of the model; it cannot be replaced or deleted (choose another name)"
            )

    def add(self, voice: Voice, overwrite: bool = False) -> Path:
        """Save ``voice`` under its name (atomically, create-if-absent unless ``overwrite``) for every replica."""
        voice.check_model(self.family, self.sample_rate)
        self._check_writable(voice.name)
        self.store.put(voice, overwrite=overwrite)
        return self.path(voice.name)

    def remove(self, name: str) -> None:
        """Delete voice ``name`` everywhere; VoiceNotFoundError if there is none."""
        self._check_writable(name)
        self.store.delete(name)

    def fingerprints(self) -> set[str]:
        """The fingerprints (:attr:`Voice.fingerprint`, the key of per-voice caches) of every voice served, saved
        and built-in; a voice removed or broken since the listing is left out."""
        out = {v.fingerprint for v in self.builtin.values()}
        for name in self.store.list():
            try:
                out.add(self.store.get(name).fingerprint)
            except VoiceError:
                continue
        return out
