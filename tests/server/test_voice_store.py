"""The shared voice store (``voices/store.py``): atomic publish, create-if-absent and coherent reads across
processes, as replicas on one host (or on a shared filesystem) use it. Voices here are random arrays of the
right shapes, so no engine is loaded and the whole module runs in a few seconds."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.voices.store import DirectoryVoiceStore, VoiceExistsError, VoiceNotFoundError
from cosyvoice_cpu.voices.voice import Voice

TOKENS = 400  # 800 mel frames: ~330 KB per file, so a write takes long enough to overlap the others


def make_voice(name: str, writer: int, version: int = 0) -> Voice:
    """A valid CosyVoice2 voice whose arrays say who wrote it (``mel`` is filled with ``writer * 1000 + version``)."""
    rng = np.random.default_rng(writer * 1000 + version)
    return Voice(name, f"written by {writer} v{version}", rng.integers(0, 6561, TOKENS),
                 np.full((2 * TOKENS, 80), writer * 1000 + version, np.float32), rng.standard_normal(192),
                 meta={"writer": writer, "version": version})  # fmt: skip


def _writer(directory: str, writer: int, rounds: int, out: mp.Queue) -> None:
    """Each round: put a private voice, race for a shared new name, and overwrite the common voice."""
    store = DirectoryVoiceStore(directory, "cosyvoice2", 24000)
    won = []
    for r in range(rounds):
        store.put(make_voice(f"own {writer} {r}", writer, r))
        try:
            store.put(make_voice(f"race {r}", writer, r))
            won.append(r)
        except VoiceExistsError:
            pass
        store.put(make_voice("common", writer, r), overwrite=True)
    out.put((writer, won))


def _reader(directory: str, seconds: float, out: mp.Queue) -> None:
    """Read ``common`` and the listing over and over: every voice read must be whole and as it was written."""
    store = DirectoryVoiceStore(directory, "cosyvoice2", 24000)
    reads, bad, deadline = 0, [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        for name in ["common", *store.list()[:3]]:
            try:
                v = store.get(name)
                w, ver = v.meta["writer"], v.meta["version"]
                if not (np.all(v.mel == w * 1000 + ver) and v.prompt_text == f"written by {w} v{ver}"):
                    bad.append(f"{name}: mixed content")
                reads += 1
            except VoiceNotFoundError:
                continue  # not written yet
            except Exception as e:  # a half-written or corrupt file would land here
                bad.append(f"{name}: {type(e).__name__}: {e}")
    out.put((reads, bad, dict(store.skipped)))


def test_two_processes_upload_at_once_and_every_reader_sees_whole_voices(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    rounds = 12
    reader = ctx.Process(target=_reader, args=(str(tmp_path), 4.0, q))
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), w, rounds, q)) for w in (1, 2)]
    for p in [reader, *writers]:
        p.start()
    results, deadline = [], time.monotonic() + 60
    while len(results) < 3 and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=1))
        except queue.Empty:
            codes = [p.exitcode for p in [reader, *writers]]
            assert all(c in (None, 0) for c in codes), f"a store process crashed: exit codes {codes}"
    for p in [reader, *writers]:
        p.join(30)
        assert p.exitcode == 0
    won = {r[0]: r[1] for r in results if isinstance(r[1], list) and isinstance(r[0], int) and len(r) == 2}
    reads, bad, skipped = next(r for r in results if len(r) == 3)
    assert bad == [] and skipped == {}, (bad, skipped)
    assert reads > 50  # the reader really overlapped the writes
    # create-if-absent: each contested name was won by exactly one writer, and holds that writer's voice
    assert sorted(won[1] + won[2]) == list(range(rounds))
    store = DirectoryVoiceStore(tmp_path, "cosyvoice2", 24000)
    for r in range(rounds):
        winner = 1 if r in won[1] else 2
        assert store.get(f"race {r}").meta == {"writer": winner, "version": r}
    names = store.list()
    assert len(names) == 1 + 2 * rounds + rounds  # common + own voices + race voices
    assert store.get("common").meta["version"] == rounds - 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_a_change_through_one_store_is_seen_at_once_through_another(tmp_path: Path) -> None:
    a, b = DirectoryVoiceStore(tmp_path), DirectoryVoiceStore(tmp_path)  # as two replicas would open it
    a.put(make_voice("alice", 1))
    assert b.list() == ["alice"] and b.get("alice").meta["writer"] == 1
    a.put(make_voice("alice", 2), overwrite=True)  # b's cached copy is stale now: its next get reloads
    assert b.get("alice").meta["writer"] == 2
    with pytest.raises(VoiceExistsError, match="overwrite=true"):
        b.put(make_voice("alice", 3))
    b.delete("alice")
    assert a.list() == [] and len(a) == 0 and "alice" not in a
    with pytest.raises(VoiceNotFoundError, match="saved voices: none yet"):
        a.get("alice")
    with pytest.raises(VoiceNotFoundError):
        a.delete("alice")


def test_voices_of_another_model_and_broken_files_are_skipped_not_served(tmp_path: Path) -> None:
    DirectoryVoiceStore(tmp_path).put(make_voice("good", 1))
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "renamed.npz").write_bytes((tmp_path / "good.npz").read_bytes())
    store = DirectoryVoiceStore(tmp_path, "cosyvoice2", 24000)
    assert store.list() == ["good"] and set(store.skipped) == {"corrupt.npz", "renamed.npz"}
    with pytest.raises(VoiceNotFoundError, match="not a readable voice file"):
        store.get("corrupt")
    other = DirectoryVoiceStore(tmp_path, "cosyvoice", 22050)
    assert other.list() == [] and "made for cosyvoice2" in other.skipped["good.npz"]
    with pytest.raises(Exception, match="made for cosyvoice2"):
        other.put(make_voice("mine", 1))


def test_leftovers_are_removed_only_when_their_writer_is_gone(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    files = {
        "legacy": ".a.npz.abc123.tmp",  # the single-process store's naming: its writer is gone
        "dead here": f".a.npz~{host}~{dead.pid}~x1.tmp",
        "alive here": f".a.npz~{host}~{os.getpid()}~x2.tmp",
        "other host, recent": f".a.npz~elsewhere~{os.getpid()}~x3.tmp",
        "other host, old": f".a.npz~elsewhere~{os.getpid()}~x4.tmp",
    }
    for name in files.values():
        (tmp_path / name).write_bytes(b"half a write")
    old = time.time() - 7200
    os.utime(tmp_path / files["other host, old"], (old, old))
    DirectoryVoiceStore(tmp_path)
    left = {k for k, name in files.items() if (tmp_path / name).exists()}
    assert left == {"alive here", "other host, recent"}
