"""What the LM's users see of a KV cache and of the graph that runs it: :class:`LMCache` and :class:`LMGraph`.

Two forms implement them, chosen by what the backend opened (``GraphSession.stateful``):

- :mod:`cosyvoice_cpu.lm.bound_graph`: the ONNX graph with the cache as ``past_*`` inputs and ``present_*`` outputs,
  bound in place to buffers the LM owns (:class:`~cosyvoice_cpu.lm.kv_cache.KVCache`); ONNX Runtime.
- :mod:`cosyvoice_cpu.lm.state_graph`: a stateful graph that keeps the cache as its own state
  (:class:`~cosyvoice_cpu.lm.state_graph.StateCache`); OpenVINO's LLM form.

The session (:class:`~cosyvoice_cpu.lm.session.LMSession`), the scheduler, the prefix cache and the text streams
use a cache only through the members below, so either form serves all of them.

Shapes (L layers, Hkv KV heads, Dh head dim, D hidden, V speech vocab): a row's entries move as float32
(2, L, Hkv, n, Dh), keys then values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.kv_spec import LMSpec


class LMCache(ABC):
    """Decoding state of ``rows`` sequences: ``lengths`` (rows + spare,) int64, positions held per row.

    Spare rows (last, only a bound cache has them) are never a caller's: they pad a lone row's call.
    """

    spec: LMSpec
    lengths: np.ndarray

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows a caller may use."""

    @abstractmethod
    def reset(self, row: int) -> None:
        """Forget row ``row`` (length 0)."""

    @abstractmethod
    def release(self, row: int, keep: int) -> int:
        """Row ``row`` is no request's any more: give back what it holds past ``keep`` positions; return bytes."""

    @abstractmethod
    def read(self, row: int, n: int) -> np.ndarray:
        """A copy of row ``row``'s first ``n`` positions: float32 (2, L, Hkv, n, Dh)."""

    @abstractmethod
    def write(self, row: int, kv: np.ndarray) -> None:
        """Make ``kv`` (as :meth:`read` returns it) the whole content of row ``row``."""

    def check_row(self, row: int) -> None:
        """ConfigError unless ``row`` is one of the caller's rows."""
        if not 0 <= row < self.rows:
            raise ConfigError(f"row {row} is out of range for a KV cache of {self.rows} rows")

    def check_kv(self, kv: np.ndarray) -> None:
        """ConfigError unless ``kv`` has the shape of a row's entries of this LM (at most ``max_len`` positions)."""
        s, n = self.spec, kv.shape[3] if kv.ndim == 5 else -1
        if kv.shape != (2, s.num_layers, s.kv_heads, n, s.head_dim) or n > s.max_len:
            raise ConfigError(f"KV entries of shape {kv.shape} do not fit this LM's cache")


class LMGraph(ABC):
    """The LM graph over its cache: append positions to rows, get the speech head's log-probabilities.

    ``min_rows``: the fewest rows a one-position call runs on (see :class:`~cosyvoice_cpu.lm.session.LMSession`).
    """

    min_rows: int = 1

    @abstractmethod
    def new_cache(self, rows: int) -> LMCache:
        """A cache for ``rows`` sequences of up to ``max_len`` positions each."""

    @abstractmethod
    def prefill(self, cache: LMCache, row: int, embeds: np.ndarray) -> np.ndarray:
        """Append embeds (S, D) to row ``row``; logp (V,) after its last position."""

    @abstractmethod
    def step(self, cache: LMCache, rows: list[int], embeds: np.ndarray) -> np.ndarray:
        """Append one position, embeds (len(rows), D), to each of ``rows``; logp (len(rows), V) in their order."""


def check_capacity(spec: LMSpec, rows: Sequence[int], ends: Sequence[int]) -> None:
    """ConfigError naming the rows whose length after a call (``ends``) would pass ``max_len``."""
    over = sorted(int(r) for r, e in zip(rows, ends) if e > spec.max_len)
    if over:
        raise ConfigError(
            f"rows {over} would exceed the KV cache capacity max_len={spec.max_len}; end the request or export "
            "with a larger max_len"
        )
