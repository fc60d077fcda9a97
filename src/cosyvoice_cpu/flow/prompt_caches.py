"""Per-voice work kept in memory across requests: the flow's prompt activations for streaming.

A voice's prompt contributes the same cached activations to every streamed chunk of every request with the same solver
settings (:class:`~cosyvoice_cpu.flow.cosyvoice2_stream.CosyVoice2PromptCache`, or Fun-CosyVoice3's keys and values).
Building them costs one flow solve over the prompt frames; keeping them costs ``steps x rows x L x T_prompt x 256``
values (a 3 s prompt with the full-size CosyVoice2 at 10 steps with CFG: 172 MB in float32, 87 MB in the float16 the
int8 models keep). :class:`PromptCaches` is a thread-safe LRU bounded in bytes: a server with a few hot voices pays the
prompt once per voice; a lone edge box short of memory can set the budget to 0 (``serve --prompt-cache-mb 0``: built
per request, before its first audio, and shared by the requests that run at the same time; the cost measured:
docs/server.md).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection
from typing import Protocol

import numpy as np

from cosyvoice_cpu.flow.base import FlowStage

logger = logging.getLogger(__name__)


class PromptCache(Protocol):
    """A voice's cached prompt activations for one solver setting (a family's stream module defines one).

    ``advice``: what the family has to say about streaming this voice (logged once per voice), or None.
    """

    advice: str | None

    @property
    def nbytes(self) -> int: ...


class PromptCacheKind(Protocol):
    """A family's prompt-cache class: ``build`` integrates the prompt frames alone and keeps their activations
    (:class:`~cosyvoice_cpu.flow.cosyvoice2_stream.CosyVoice2PromptCache`,
    :class:`~cosyvoice_cpu.flow.cosyvoice3_stream.CosyVoice3PromptCache`)."""

    def build(
        self,
        stage: FlowStage,
        prompt_tokens: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        n_timesteps: int | None,
        cfg_rate: float | None,
        dtype: type[np.floating],
    ) -> PromptCache: ...


class PromptVoice(Protocol):
    """What a prompt cache needs of a voice (:class:`~cosyvoice_cpu.voices.voice.Voice` is one): its prompt speech
    tokens (T_p,), prompt mel (T_p * ratio, 80), x-vector (192,), a fingerprint of them and a name for the log."""

    name: str
    fingerprint: str
    speech_tokens: np.ndarray
    mel: np.ndarray
    embedding: np.ndarray


CacheKey = tuple[str, int, float]  # (voice fingerprint, steps, cfg rate)
RequestCaches = dict[CacheKey, PromptCache]  # one request's caches, kept for its later sentences


class PromptCaches:
    """LRU of a family's :class:`PromptCache` keyed by (voice fingerprint, steps, cfg rate), at most ``budget`` bytes.

    ``kind`` is the family's cache class (:class:`PromptCacheKind`); ``dtype`` is the storage type of the cached
    activations (float32, or float16 for half the memory). A request passes its own :data:`RequestCaches` to
    :meth:`get`, so a cache the budget cannot keep is still built once per request, not once per sentence; and a
    cache a running request holds is shared with every request that asks for it meanwhile (one build, one copy per
    voice and setting in use, whatever the budget), requests that ask while it is being built waiting for that build.
    """

    def __init__(
        self, stage: FlowStage, budget: int, kind: PromptCacheKind, dtype: type[np.floating] = np.float32
    ) -> None:
        self.stage = stage
        self.budget = budget
        self.kind = kind
        self.dtype = dtype
        self._items: OrderedDict[CacheKey, PromptCache] = OrderedDict()
        self._lock = threading.Lock()
        self._too_big: set[str] = set()  # voice fingerprints warned about (once a voice)
        self._advised: set[str] = set()  # voice fingerprints whose cache's advice was logged (once a voice)
        self._retains = 0  # how many times retain() ran: a build that overlapped one checks its voice is still kept
        self._kept: set[str] = set()  # the fingerprints the last retain() kept
        # every cache a request still holds (weakly: a cache goes when its last request ends and the LRU has let it
        # go), so a request never builds a second copy of one in use; and the builds under way, which a request
        # for the same cache waits for instead of building its own
        self._in_use: weakref.WeakValueDictionary[CacheKey, PromptCache] = weakref.WeakValueDictionary()
        self._building: dict[CacheKey, threading.Event] = {}
        self.hits = self.misses = self.shared = 0

    @property
    def nbytes(self) -> int:
        """Bytes the LRU keeps (at most ``budget``)."""
        with self._lock:
            return sum(c.nbytes for c in self._items.values())

    @property
    def held_nbytes(self) -> int:
        """Bytes of every cache in memory: those the LRU keeps and those only running requests still hold (a
        cache too big for the budget, one the budget let go, a dropped voice's). Requests holding a cache share it,
        so this counts each cache once; a cache from before a replaced voice's ``retain`` counts until its requests
        end."""
        with self._lock:  # valuerefs() copies at once: a request ending meanwhile cannot resize it mid-count
            return sum(c.nbytes for ref in self._in_use.valuerefs() if (c := ref()) is not None)

    def retain(self, fingerprints: Collection[str]) -> int:
        """Drop the caches of every voice whose fingerprint is not in ``fingerprints`` (the voices still served);
        the bytes freed.

        A deleted or replaced voice's caches can never be asked for again, yet the LRU would keep them until the
        budget pushed them out: a server whose voices change would hold up to ``--prompt-cache-mb`` of them. A
        request still running with the old voice keeps its own reference (:data:`RequestCaches`); a cache of a
        dropped voice whose build was under way during the call is not kept when the build ends.
        """
        keep = set(fingerprints)
        with self._lock:
            self._retains += 1
            self._kept = keep
            stale = [key for key in self._items if key[0] not in keep]
            freed = sum(self._items.pop(key).nbytes for key in stale)
            self._too_big &= keep
            self._advised &= keep
        if stale:
            logger.info("dropped %d prompt caches (%.0f MB) of voices no longer served", len(stale), freed / 1e6)
        return freed

    def get(self, voice: PromptVoice, steps: int, cfg_rate: float, request: RequestCaches | None = None) -> PromptCache:
        """The voice's prompt cache for these settings, built (outside the lock) on a miss.

        ``request``: the calling request's own caches; the result is added to it, and a cache found there is used
        without asking the LRU (a request's sentences share one cache even when the budget keeps none).
        """
        key = (voice.fingerprint, int(steps), float(cfg_rate))
        if request is not None and key in request:
            with self._lock:  # still in use: the LRU's most recent
                if key in self._items:
                    self._items.move_to_end(key)
            return request[key]
        cache = self._get(key, voice, steps, cfg_rate)
        if request is not None:
            request[key] = cache
        return cache

    def _get(self, key: CacheKey, voice: PromptVoice, steps: int, cfg_rate: float) -> PromptCache:
        while True:
            with self._lock:
                cache = self._items.get(key)
                if cache is not None:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return cache
                cache = self._in_use.get(key)
                if cache is not None:  # out of the LRU (or never in it) but a running request holds it: share it
                    self.shared += 1
                    if cache.nbytes <= self.budget and (not self._retains or key[0] in self._kept):
                        self._keep(key, cache)  # in use again: the LRU's most recent (never a dropped voice's)
                    return cache
                building = self._building.get(key)
                if building is None:
                    building = self._building[key] = threading.Event()
                    self.misses += 1
                    retains = self._retains
                    break
            building.wait()  # another request is building this one: take theirs (or build it if theirs failed)
        try:
            cache = self.kind.build(
                self.stage, voice.speech_tokens, voice.mel, voice.embedding, steps, cfg_rate, dtype=self.dtype
            )
            with self._lock:
                self._in_use[key] = cache
                advise = cache.advice is not None and voice.fingerprint not in self._advised
                self._advised.add(voice.fingerprint)
        finally:
            with self._lock:
                del self._building[key]
            building.set()
        if advise:
            logger.info("voice %r: %s", voice.name, cache.advice)
        if cache.nbytes > self.budget:  # too big to keep: the requests using it share it, a later one builds it again
            if self.budget and voice.fingerprint not in self._too_big:  # a budget of 0 keeps none by choice
                self._too_big.add(voice.fingerprint)
                logger.warning(
                    "the streaming cache of voice %r (%.0f MiB) exceeds the prompt cache budget (%.0f MiB): built "
                    "again for every request that finds no running request holding it; raise --prompt-cache-mb to "
                    "keep it",
                    voice.name,
                    cache.nbytes / 2**20,
                    self.budget / 2**20,
                )
            return cache
        with self._lock:
            if self._retains != retains and key[0] not in self._kept:  # its voice was dropped while it was built
                return cache
            self._keep(key, cache)
        logger.info(
            "prompt cache for voice %r (%d steps, cfg %.2f): %.0f MB", voice.name, steps, cfg_rate, cache.nbytes / 1e6
        )
        return cache

    def _keep(self, key: CacheKey, cache: PromptCache) -> None:
        """Make ``cache`` the LRU's most recent and drop the least recent past the budget (call with the lock)."""
        self._items[key] = cache
        self._items.move_to_end(key)
        total = sum(c.nbytes for c in self._items.values())
        while total > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            total -= old.nbytes
