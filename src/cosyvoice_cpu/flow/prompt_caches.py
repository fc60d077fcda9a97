"""Per-voice work kept in memory across requests: the flow's prompt activations for streaming.

A voice's prompt contributes the same cached activations to every streamed chunk of every request with the same
solver settings (:class:`~cosyvoice_cpu.flow.cosyvoice2_stream.CosyVoice2PromptCache`). Building them costs one flow
solve over the
prompt frames; keeping them costs ``steps x rows x L x T_prompt x 256`` floats (172 MB for a 3 s prompt with the
full-size CosyVoice2 at 10 steps with CFG). :class:`PromptCaches` is a thread-safe LRU bounded in bytes: a server
with a few hot voices pays the prompt once per voice; a lone edge box can set the budget to 0 (built per request).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2PromptCache

logger = logging.getLogger(__name__)


class PromptCaches:
    """LRU of :class:`CosyVoice2PromptCache` keyed by (voice fingerprint, steps, cfg rate), at most ``budget`` bytes.

    ``kind`` is the cache class with a ``build(stage, prompt_tokens, prompt_mel, embedding, steps, cfg_rate,
    dtype)`` classmethod and ``nbytes`` (CosyVoice2's :class:`CosyVoice2PromptCache`, Fun-CosyVoice3's
    ``CosyVoice3PromptCache``);
    ``dtype`` is the storage type of the cached activations (float32, or float16 for half the memory).
    """

    def __init__(
        self, stage: CosyVoice2Flow, budget: int, kind: type = CosyVoice2PromptCache, dtype: Any = np.float32
    ) -> None:
        self.stage = stage
        self.budget = budget
        self.kind = kind
        self.dtype = dtype
        self._items: OrderedDict[tuple[str, int, float], CosyVoice2PromptCache] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._items.values())

    def get(self, voice: Any, steps: int, cfg_rate: float) -> CosyVoice2PromptCache:
        """The voice's prompt cache for these settings, built (outside the lock) on a miss."""
        key = (voice.fingerprint, int(steps), float(cfg_rate))
        with self._lock:
            cache = self._items.get(key)
            if cache is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return cache
            self.misses += 1
        cache = self.kind.build(
            self.stage, voice.speech_tokens, voice.mel, voice.embedding, steps, cfg_rate, dtype=self.dtype
        )
        if cache.nbytes > self.budget:
            return cache  # too big to keep: this request uses it, the next one builds it again
        with self._lock:
            self._items[key] = cache
            self._items.move_to_end(key)
            total = sum(c.nbytes for c in self._items.values())
            while total > self.budget and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                total -= old.nbytes
        logger.info(
            "prompt cache for voice %r (%d steps, cfg %.2f): %.0f MB", voice.name, steps, cfg_rate, cache.nbytes / 1e6
        )
        return cache
