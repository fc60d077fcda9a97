"""Saved voices shared by every process that serves them: the :class:`VoiceStore` interface and its directory form.

A server run as several replicas (``cosyvoice-cpu serve --replicas N``, N containers behind a load balancer, N
pods) must see one set of voices: a voice uploaded through one replica is listed and usable through every other
at once, a deleted one is gone everywhere, no reader ever sees half of a voice, and a voice survives the death
of the process that wrote it. :class:`VoiceStore` states that contract; :class:`DirectoryVoiceStore` keeps it
with one ``NAME.npz`` file per voice in a directory on one host or on a shared filesystem:

- **publish is atomic**: the bytes go to a temporary file in the same directory, are fsynced, and are then
  renamed over the final name (``overwrite``) or hard-linked to it (create-if-absent: of two replicas that
  upload the same new name at once, exactly one wins, the other gets :class:`VoiceExistsError`); the directory
  is fsynced after, so the voice is durable once ``put`` returns;
- **no process keeps a private copy of the list**: ``list`` reads the directory, ``get`` opens the file and
  compares its identity (inode, size, mtime) with what it loaded before, so a voice put or deleted by another
  process is seen by the next call; a loaded voice is cached only while its file is unchanged;
- **leftovers of a writer that died** (temporary files) are removed at start when their writer is known to be
  dead (same host, no such process) or they are older than ``stale_after_s``; a live writer's file on this
  host, or a recent one from another host, is left alone (several replicas start while others write).

Another store (an object store) can follow by implementing the four methods with the same guarantees.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

from cosyvoice_cpu.voices.voice import Voice, VoiceError, check_name, fsync_dir, write_temp

logger = logging.getLogger(__name__)

SUFFIX = ".npz"
TMP_SUFFIX = ".tmp"
STALE_AFTER_S = 3600.0


class VoiceNotFoundError(VoiceError):
    """No saved voice of that name."""


class VoiceExistsError(VoiceError):
    """A voice of that name exists and overwriting was not asked for."""


class VoiceStore(ABC):
    """Saved voices by name, shared by every process that opens the same store.

    Every implementation guarantees, across processes and hosts that share it:

    - ``put`` is atomic (a reader gets the whole old voice or the whole new one) and durable once it returns;
      ``put(overwrite=False)`` creates only if absent, also against a concurrent ``put`` elsewhere;
    - after ``put`` or ``delete`` returns, the next ``list``/``get`` of any process sees it;
    - nothing but ``delete`` removes a voice.
    """

    location: str  # where the voices live, for messages and logs

    @abstractmethod
    def list(self) -> list[str]:
        """The names of the voices that can be served, sorted."""

    @abstractmethod
    def get(self, name: str) -> Voice:
        """The voice ``name``; :class:`VoiceNotFoundError` (naming the voices there are) if none can be served."""

    @abstractmethod
    def put(self, voice: Voice, overwrite: bool = False) -> None:
        """Publish ``voice`` under its name; :class:`VoiceExistsError` if it exists and ``overwrite`` is false."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove voice ``name`` everywhere; :class:`VoiceNotFoundError` if there is none."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.list()

    def __len__(self) -> int:
        return len(self.list())


def _tmp_owner() -> str:
    """The part of a temporary file's name that says who writes it: ``~HOST~PID~`` (names never hold ``~``)."""
    return f"~{socket.gethostname().replace('~', '-')}~{os.getpid()}~"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


class DirectoryVoiceStore(VoiceStore):
    """Voices as ``NAME.npz`` files in ``directory`` (created if missing), published atomically.

    Args:
        directory: the voices directory; the same path on a shared filesystem for replicas on several hosts.
        family, sample_rate: when given, files made for another model are not served (reported in ``skipped``).
        stale_after_s: temporary files older than this are removed at start whoever wrote them.
    """

    def __init__(
        self,
        directory: str | Path,
        family: str | None = None,
        sample_rate: int | None = None,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.directory = Path(directory)
        self.location = str(self.directory)
        self.family, self.sample_rate = family, sample_rate
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[tuple[int, int, int], Voice | VoiceError]] = {}  # name -> (file id, result)
        self.skipped: dict[str, str] = {}  # file name -> why it is not served (as of the last list)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sweep(stale_after_s)

    def path(self, name: str) -> Path:
        """The file of voice ``name`` (the name is validated: no path parts can get through)."""
        return self.directory / f"{check_name(name)}{SUFFIX}"

    # ------------------------------------------------------------------ reading

    def _load(self, name: str, path: Path) -> Voice | VoiceError | None:
        """The voice in ``path`` (a VoiceError if it cannot be served; None if there is no file), from the cache
        while the file is the one loaded before. The identity is taken from the opened file, so a file replaced
        between the check and the read is never mistaken for the old one."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            with self._lock:
                self._loaded.pop(name, None)
            return None
        except OSError as e:
            return VoiceError(f"voice file {path} cannot be read ({e.strerror or type(e).__name__})")
        try:
            st = os.fstat(fd)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._lock:
                cached = self._loaded.get(name)
            if cached is not None and cached[0] == key:
                return cached[1]
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
        finally:
            os.close(fd)
        result: Voice | VoiceError
        try:
            voice = Voice.from_bytes(data, str(path))
            if self.family is not None and self.sample_rate is not None:
                voice.check_model(self.family, self.sample_rate)
            if voice.name != name:
                raise VoiceError(f"it holds voice {voice.name!r}, not {name!r}")
            result = voice
        except VoiceError as e:
            result = e
        with self._lock:
            self._loaded[name] = (key, result)
        return result

    def list(self) -> list[str]:
        names, skipped = [], {}
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            if path.name.startswith("."):
                continue
            result = self._load(path.stem, path)
            if isinstance(result, Voice):
                names.append(path.stem)
            elif result is not None:
                skipped[path.name] = str(result)
        for file, why in skipped.items():
            if self.skipped.get(file) != why:
                logger.warning("not serving %s: %s", self.directory / file, why)
        self.skipped = skipped
        with self._lock:  # forget voices whose files are gone
            for name in set(self._loaded) - set(names) - {Path(f).stem for f in skipped}:
                del self._loaded[name]
        return names

    def get(self, name: str) -> Voice:
        try:
            path = self.path(name)
        except VoiceError:  # a name no voice can have (path parts, invisible characters) is not a saved voice
            result: Voice | VoiceError | None = None
        else:
            result = self._load(name, path)
        if isinstance(result, Voice):
            return result
        known = ", ".join(self.list()) or "none yet; add one with POST /v1/audio/voices"
        why = f" ({result})" if result is not None else ""
        raise VoiceNotFoundError(f"no voice named {name!r}{why}; saved voices: {known}")

    # ------------------------------------------------------------------ writing

    def put(self, voice: Voice, overwrite: bool = False) -> None:
        if self.family is not None and self.sample_rate is not None:
            voice.check_model(self.family, self.sample_rate)
        path = self.path(voice.name)
        tmp = write_temp(voice.to_bytes(), self.directory, f".{path.name}{_tmp_owner()}", TMP_SUFFIX)
        try:
            if overwrite:
                os.replace(tmp, path)
            else:
                self._link_new(tmp, path)
            fsync_dir(self.directory)
        finally:
            Path(tmp).unlink(missing_ok=True)
        with self._lock:
            self._loaded.pop(voice.name, None)
        logger.info("saved voice %r to %s", voice.name, path)

    def _link_new(self, tmp: str, path: Path) -> None:
        """Publish ``tmp`` as ``path`` only if ``path`` does not exist (``link`` is atomic, NFS included)."""
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise VoiceExistsError(
                f"a voice named {path.stem!r} exists; delete it first or pass overwrite=true"
            ) from None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            # a filesystem without hard links: check, then rename (a concurrent upload of the same name may win)
            logger.warning(
                "%s has no hard links (%s): uploads of one new name at once are not exclusive",
                self.directory,
                e.strerror,
            )
            if path.exists():
                raise VoiceExistsError(
                    f"a voice named {path.stem!r} exists; delete it first or pass overwrite=true"
                ) from None
            os.replace(tmp, path)

    def delete(self, name: str) -> None:
        path = self.path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise VoiceNotFoundError(f"no voice named {name!r}") from None
        fsync_dir(self.directory)
        with self._lock:
            self._loaded.pop(name, None)
        logger.info("deleted voice %r", name)

    def sweep(self, stale_after_s: float = STALE_AFTER_S) -> list[str]:
        """Remove temporary files whose writer died: written on this host by a process that is gone, of an
        unknown writer (older versions), or older than ``stale_after_s``. Returns the names removed."""
        host, now, removed = socket.gethostname().replace("~", "-"), time.time(), []
        for tmp in self.directory.glob(f".*{SUFFIX}*{TMP_SUFFIX}"):
            parts = tmp.name.split("~")
            try:
                age = now - tmp.stat().st_mtime
            except FileNotFoundError:
                continue  # its writer published it meanwhile
            if len(parts) == 4 and parts[2].isdigit() and age < stale_after_s:
                if parts[1] != host or _pid_alive(int(parts[2])):
                    continue  # a writer on another host, or one alive here: its file is still being written
            logger.warning("removing %s, an unfinished voice write", tmp.name)
            tmp.unlink(missing_ok=True)
            removed.append(tmp.name)
        return removed
