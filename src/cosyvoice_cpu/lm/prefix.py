"""The LM's KV-cache entries of a prompt transcript, kept between requests.

A CosyVoice2/3 prefill is ``[sos, text_emb(prompt_text ⊕ text), task_id, speech_emb(prompt_speech)]``. Attention
is causal, so the keys and values of its first ``1 + len(prompt_text)`` positions depend on the prompt transcript
alone: every request with the same voice (or the same instruction) starts with the same ones. A request prefills
them in a call of their own and the rest after them (:meth:`PrefixCache.load`); the entries are kept, keyed by
the transcript's token ids, and a later request copies them into its cache row instead of recomputing them.
CosyVoice-300M's prefill is ``[sos, speaker, encode(text_emb(prompt_text ⊕ text)), ...]``: its text encoder is
causal too, so the prefix is ``2 + len(prompt_text)`` positions keyed by the transcript and the x-vector, with the
transcript's rows encoded on their own (``lm_prompt.assemble(own_rows=...)``: equal to the whole encoding's up to
float rounding, and then a function of the key alone).

The split is done whether or not the prefix is cached, so a request's output never depends on what ran before
it. With weight-only quantized or float32 graphs (each row's products are computed alone) the split also gives
the very bits of one call (measured on the full-size ``int8w`` and the tiny fp32 and ``int4`` LMs); with the
dynamic-int8 recipe, whose activations are quantized per call, the first call's scales differ (tests:
``tests/unit/test_lm_prefix.py``).

Size: ``2 x layers x kv_heads x head_dim x 4`` bytes per position: 24 KB for CosyVoice2 (24 layers, 2 KV heads
of 64), 0.7 MB for a 28-position transcript. The cache keeps the most recently used entries within
``max_bytes`` (default 16 MB).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.cache import LMCache
from cosyvoice_cpu.lm.session import LMSession

logger = logging.getLogger(__name__)

DEFAULT_BYTES = 16 << 20


def prefix_key(prompt_text: np.ndarray, speaker: np.ndarray | None = None) -> tuple[bytes, int]:
    """(key, positions) of the prefix ``[sos, (speaker,) prompt_text]``: ``prompt_text`` int64 ids, ``speaker``
    the (192,) x-vector of a CosyVoice-300M request whose prefill has a speaker row (None otherwise)."""
    ids = np.ascontiguousarray(prompt_text, np.int64)
    if speaker is None:
        return ids.tobytes(), 1 + ids.size
    return ids.tobytes() + b"|speaker|" + np.ascontiguousarray(speaker, np.float32).tobytes(), 2 + ids.size


class PrefixCache:
    """Most recently used prompt-transcript KV entries of one :class:`LMSession`, within ``max_bytes``.

    Thread-safe: a prefix missing in two threads at once is computed by both (with the same result).
    """

    def __init__(self, session: LMSession, max_bytes: int = DEFAULT_BYTES) -> None:
        if max_bytes < 0:
            raise ConfigError(f"the LM prefix cache's size cannot be negative, got {max_bytes} bytes")
        self.session = session
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached entries."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, cache: LMCache, row: int, key: bytes, embeds: np.ndarray) -> None:
        """Make row ``row`` of ``cache`` hold the prefix ``embeds`` (n, D), from the cache or by a prefill of its
        own (:meth:`LMCache.read` / :meth:`LMCache.write` copy the entries); ``key`` identifies the prefix (the
        transcript's token ids)."""
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if kv is not None:
            cache.write(row, kv)
            return
        cache.reset(row)
        self.session.prefill(cache, row, embeds)
        kv = cache.read(row, len(embeds))
        with self._lock:
            self.misses += 1
            self._put(key, kv)

    def _put(self, key: bytes, kv: np.ndarray) -> None:
        if kv.nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        self._bytes -= 0 if old is None else old.nbytes
        self._entries[key] = kv
        self._bytes += kv.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes
            logger.debug(
                "LM prefix cache full (%d bytes): dropped an entry of %d bytes", self.max_bytes, dropped.nbytes
            )
