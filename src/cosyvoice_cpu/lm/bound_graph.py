"""The LM's ONNX graph with its KV cache bound in place (``lm.onnx`` on ONNX Runtime): :class:`BoundGraph`.

Graph contract (B rows, S new positions, L layers, Hkv KV heads, M = ``max_len`` cache capacity, Dh head dim):

- ``inputs_embeds`` float32 (B, S, D); ``past_key_<i>`` / ``past_value_<i>`` float32 (B, Hkv, M, Dh);
  ``seqlens_k`` int32 (B,) = number of valid cache positions of the row *after* this call, minus one;
  ``total_sequence_length`` int32 scalar = max over rows of ``seqlens_k + 1``.
- ``logp`` float32 (B, V) log-softmax of the speech head at position S-1 of each row;
  ``present_key_<i>`` / ``present_value_<i>`` float32 (B, Hkv, M, Dh).

Row b's S new positions are written to cache positions ``seqlens_k[b] + 1 - S ... seqlens_k[b]`` and are also their
RoPE positions; attention is causal over positions ``0 ... seqlens_k[b]``. ``past_*`` and ``present_*`` share one
buffer (:meth:`~cosyvoice_cpu.backends.base.GraphSession.bind_in_place`: on ONNX Runtime an IO binding to raw
pointers, which GroupQueryAttention updates in place, so nothing is copied per step). A call over rows r0..r0+B binds
a view of those rows of a :class:`~cosyvoice_cpu.lm.kv_cache.KVCache` of more rows. S > 1 is run for one row at a
time; a decode (S = 1) may mix rows of any lengths. The graph uses only the GQA inputs that onnxruntime 1.24
already has (no ``query_seqlens``); it loads and gives the same logp on 1.24.1 and 1.32.0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import BoundRun, GraphSession, check_io
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.cache import LMCache, LMGraph, check_capacity
from cosyvoice_cpu.lm.kv_cache import KVCache
from cosyvoice_cpu.lm.kv_spec import LMSpec, past_names, present_names


class BoundGraph(LMGraph):
    """The bound-cache LM graph over :class:`~cosyvoice_cpu.lm.kv_cache.KVCache` s.

    Args:
        session: the opened ``lm.onnx`` (checked against the contract for ``spec``).
        spec: the LM's facts.
        path: the graph file, for messages.
        min_rows: the fewest rows a one-position call runs on (1 or 2; see
            :class:`~cosyvoice_cpu.lm.session.LMSession`).
    """

    def __init__(self, session: GraphSession, spec: LMSpec, path: Path, min_rows: int = 1) -> None:
        if not 1 <= min_rows <= 2:
            raise ConfigError(f"min_rows must be 1 or 2, got {min_rows}")
        self.session, self.spec, self.min_rows = session, spec, min_rows
        kv = ["batch", spec.kv_heads, spec.max_len, spec.head_dim]
        want_in = {
            "inputs_embeds": ("tensor(float)", ["batch", "seq", spec.hidden]),
            "seqlens_k": ("tensor(int32)", ["batch"]),
            "total_sequence_length": ("tensor(int32)", []),
        }
        want_out = {"logp": ("tensor(float)", ["batch", spec.speech_vocab])}
        for i in range(spec.num_layers):
            want_in.update({n: ("tensor(float)", kv) for n in past_names(i)})
            want_out.update({n: ("tensor(float)", kv) for n in present_names(i)})
        check_io(session, path, want_in, want_out)

    def new_cache(self, rows: int) -> KVCache:
        """A :class:`KVCache` for ``rows`` sequences (and the spare row ``min_rows`` may need)."""
        return KVCache(self.spec, rows, spare=max(0, self.min_rows - rows))

    def prefill(self, cache: LMCache, row: int, embeds: np.ndarray) -> np.ndarray:
        if len(embeds) < self.min_rows:  # one position: a step, padded like a decode
            return self.step(cache, [row], embeds)[0]
        return self._run(_bound(cache), row, embeds[None], np.array([cache.lengths[row] + len(embeds)]))[0]

    def step(self, cache: LMCache, rows: list[int], embeds: np.ndarray) -> np.ndarray:
        """Append one position to each of ``rows``.

        The graph runs on the contiguous row range min(rows)..max(rows), widened to ``min_rows`` rows by a
        neighbour (after the range if the cache has one, spare rows included, else before it); rows in the range
        that are not stepped get a zero embedding written one past their end (their length does not change, and
        the next position written to them overwrites it), so they cost compute but not correctness.
        """
        kv = _bound(cache)
        if len(kv.lengths) < self.min_rows:
            raise ConfigError(f"this LM runs at least {self.min_rows} rows per call; make its cache with new_cache()")
        r0, r1 = min(rows), max(rows) + 1
        while r1 - r0 < self.min_rows:
            r1, r0 = (r1 + 1, r0) if r1 < len(kv.lengths) else (r1, r0 - 1)
        active = np.array(rows) - r0
        padded = np.zeros((r1 - r0, 1, self.spec.hidden), np.float32)
        padded[active, 0] = embeds
        ends = kv.lengths[r0:r1] + 1  # idle rows: a scratch position just past their end
        idle = np.ones(r1 - r0, bool)
        idle[active] = False
        # a full idle row gets its last position overwritten: harmless, as any further use of it raises
        ends[idle] = np.minimum(ends[idle], self.spec.max_len)
        return self._run(kv, r0, padded, ends, active=active)[active]

    def _binding(self, cache: KVCache, r0: int, b: int) -> BoundRun:
        """Runs with rows r0..r0+b of every layer's cache bound as both past and present (in place).

        Kept on the cache (which owns the buffers bound) and reused by later steps over the same rows, so a step
        only feeds the small inputs and ``logp``.
        """
        return cache.binding(self, r0, b, lambda: self.session.bind_in_place(self._pairs(cache, r0, b)))

    def _pairs(self, cache: KVCache, r0: int, b: int) -> dict[str, tuple[str, np.ndarray]]:
        """``past_*`` input -> (its ``present_*`` output, rows r0..r0+b of that layer's keys or values)."""
        pairs = {}
        for i in range(self.spec.num_layers):
            for bufs, pn, qn in zip((cache.keys, cache.values), past_names(i), present_names(i)):
                pairs[pn] = (qn, bufs[i][r0 : r0 + b])
        return pairs

    def _run(
        self, cache: KVCache, r0: int, embeds: np.ndarray, ends: np.ndarray, active: np.ndarray | None = None
    ) -> np.ndarray:
        """Run rows r0..r0+B with embeds (B, S, D) so that row b holds ``ends[b]`` positions afterwards.

        ``active`` (indices into the B rows) are the rows whose lengths advance; default all. Returns logp (B, V).
        """
        b, s, _ = embeds.shape
        if s > 1 and b > 1:
            raise ConfigError("multi-position steps run one row at a time")
        act = np.arange(b) if active is None else active
        check_capacity(self.spec, r0 + act, ends[act])
        feeds = {
            "inputs_embeds": np.ascontiguousarray(embeds),
            "seqlens_k": (ends - 1).astype(np.int32),
            "total_sequence_length": np.array(int(ends.max()), np.int32),
        }
        logp = np.empty((b, self.spec.speech_vocab), np.float32)
        self._binding(cache, r0, b).run(feeds, {"logp": logp})
        cache.lengths[r0 + act] = ends[act]
        return logp


def _bound(cache: LMCache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise ConfigError(f"this LM graph binds its own KV buffers; it cannot run a {type(cache).__name__}")
    return cache
