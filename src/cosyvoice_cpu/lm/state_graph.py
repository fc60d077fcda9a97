"""The LM as a stateful graph (``lm.ov.xml``, OpenVINO's LLM form): the KV cache is the compiled model's state.

Graph contract (B rows in the call, S new positions, P positions in the state, D hidden, V speech vocab; written by
:mod:`cosyvoice_cpu.export.lm.openvino_stateful`):

- inputs: ``inputs_embeds`` float32 (B, S, D); ``attention_mask`` int64 (B, P + S), 1 where a state position or new
  position of the row is real; ``position_ids`` int64 (B, S), the RoPE positions of the new positions; ``beam_idx``
  int32 (B,), which batch row of the state each row of the call continues (a ``Gather`` before the call: a subset
  drops rows, a repeat copies one).
- output: ``logp`` float32 (B, V), the speech head's log-softmax after each row's last new position.
- state: per layer i, ``past_key_<i>present_key_<i>`` / ``past_value_<i>present_value_<i>`` (B, Hkv, P, Dh), S
  positions appended per call to every row.

:class:`StateCache` keeps the scheduler's rows as the state's batch rows, in the order of its ``slots``, with a host
copy of the attention mask: a row's real positions need not be contiguous, since RoPE takes explicit positions and
the mask hides the rest. So rows of different lengths decode in one call; a row that sits a call out gets a
masked position; a new row joins as a masked copy of another (``beam_idx`` repeats it) and a finished one leaves
at the next call (``beam_idx`` drops it). Nothing is copied per step. A long prefill while other rows are in the
state runs alone on a second request (:data:`SIDE_PREFILL`), its entries merged back by one state write; the same
write compacts the state once masked positions outnumber real ones. ``read`` / ``write`` move a row's entries
through the state's get/set, so the prefix cache works as on the bound graph.

A prefill runs in calls of a few sizes only (:func:`prefill_pieces`): :data:`PIECE` positions a call, the rest last
after masked padding up to a multiple of :data:`PIECE_STEP`. OpenVINO's CPU plugin keeps a few MB for every new
number of positions a call brings, so a server fed prompts of every length would grow without end; in pieces it
meets at most ``PIECE / PIECE_STEP`` sizes, no slower (measured: docs/backends.md, "Memory per prompt length"). The
padding's queries of a row with no earlier position see no real key: the warm-up checks that the graph keeps them
finite.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import GraphSession, ModelState, check_io
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.lm.cache import LMCache, LMGraph, check_capacity
from cosyvoice_cpu.lm.kv_spec import LMSpec, past_names, present_names

logger = logging.getLogger(__name__)

# A prefill of more positions than this, while other rows are in the state, runs on a request of its own (its
# entries merged back with one state write) rather than beside them: every row of a call computes every position.
SIDE_PREFILL = 32
# Masked positions the state may hold beyond twice its longest row before it is compacted
SLACK = 64
# A prefill's calls: PIECE positions each, then the rest after masked padding to a multiple of PIECE_STEP
PIECE = 64
PIECE_STEP = 8


def prefill_pieces(n: int) -> list[tuple[int, int, int]]:
    """The calls that prefill n positions: (start, stop, padding) each, the padding masked positions before
    ``[start, stop)``; every call brings ``stop - start + padding`` positions, a multiple of :data:`PIECE_STEP`
    up to :data:`PIECE`. Whole pieces first, so the padded rest has real positions before it where n > PIECE."""
    whole = n - n % PIECE
    pieces = [(a, a + PIECE, 0) for a in range(0, whole, PIECE)]
    if n > whole or not pieces:
        pieces.append((whole, n, -(n - whole) % PIECE_STEP))
    return pieces


def state_names(i: int) -> tuple[str, str]:
    """The state names of layer i's keys and values (MakeStateful's: the input name, then the output name)."""
    (pk, pv), (qk, qv) = past_names(i), present_names(i)
    return pk + qk, pv + qv


class StateGraph(LMGraph):
    """The stateful LM graph; its caches are :class:`StateCache` s, each on a request of its own."""

    def __init__(self, session: GraphSession, spec: LMSpec, path: Path) -> None:
        if not session.stateful:
            raise ConfigError(f"{path} keeps no state; open it as the bound-cache LM graph")
        want_in = {
            "inputs_embeds": ("tensor(float)", ["batch", "seq", spec.hidden]),
            "attention_mask": ("tensor(int64)", ["batch", "total"]),
            "position_ids": ("tensor(int64)", ["batch", "seq"]),
            "beam_idx": ("tensor(int32)", ["batch"]),
        }
        check_io(session, path, want_in, {"logp": ("tensor(float)", ["batch", spec.speech_vocab])})
        self.session, self.spec, self.path = session, spec, path
        self._warm()

    def _warm(self) -> None:
        """Compile the model and run a prefill and a step on a throwaway request, at load: the first call of each
        size makes its kernels, which the first request would otherwise wait for (measured: docs/backends.md, "The LM
        on OpenVINO"). The prefills bring the smallest size, padded at the start of a row, and a whole piece, which
        every prompt longer than one uses; the log-probabilities must be finite (a NaN from the padding's queries
        would reach every later position of the row)."""
        cache = self.new_cache(1)
        n = min(PIECE, self.spec.max_len - 2)
        embeds = np.random.default_rng(0).standard_normal((n + 2, self.spec.hidden)).astype(np.float32)
        logp = [cache.prefill(0, embeds[:1]), cache.prefill(0, embeds[1 : n + 1]), cache.step([0], embeds[n + 1 :])[0]]
        if not all(np.isfinite(p).all() for p in logp):
            raise ModelDirError(
                f"{self.path}: the LM gives non-finite log-probabilities after masked padding at load; this "
                "OpenVINO version does not keep a fully masked attention row finite: run the LM on ONNX Runtime "
                "(--backend onnxruntime) and report the OpenVINO version"
            )

    def new_cache(self, rows: int) -> StateCache:
        return StateCache(self.spec, rows, self.session)

    def prefill(self, cache: LMCache, row: int, embeds: np.ndarray) -> np.ndarray:
        return _stateful(cache).prefill(row, embeds)

    def step(self, cache: LMCache, rows: list[int], embeds: np.ndarray) -> np.ndarray:
        return _stateful(cache).step(rows, embeds)


class StateCache(LMCache):
    """``rows`` sequences in the state of one request of a stateful LM graph (see the module docstring).

    ``slots``: the row held by each batch row of the state; ``mask`` int64 (len(slots), P): its real positions.
    Rows reset or released stay in the state until the next call drops them (``gone``).
    """

    def __init__(self, spec: LMSpec, rows: int, session: GraphSession) -> None:
        if rows <= 0:
            raise ConfigError(f"a KV cache needs at least one row, got {rows}")
        self.spec, self._rows, self._session = spec, rows, session
        self.lengths = np.zeros(rows, np.int64)
        self.state: ModelState = session.open_state()
        self._side: StateCache | None = None
        self.slots: list[int] = []
        self.mask = np.zeros((0, 0), np.int64)
        self.gone: set[int] = set()
        self.names = [n for i in range(spec.num_layers) for n in state_names(i)]

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def live(self) -> list[int]:
        """The rows the state holds entries of, in slot order."""
        return [r for r in self.slots if r not in self.gone]

    def reset(self, row: int) -> None:
        self.check_row(row)
        self._forget(row)

    def release(self, row: int, keep: int = 0) -> int:
        """Drop row ``row`` from the state whatever ``keep`` says (the state has no pages to keep: the next call
        runs without the row); return the bytes its entries held."""
        self.check_row(row)
        held = int(self.lengths[row]) * 2 * self.spec.num_layers * self.spec.kv_heads * self.spec.head_dim * 4
        self._forget(row)
        return held

    def _forget(self, row: int) -> None:
        self.lengths[row] = 0
        if row in self.slots:
            self.gone.add(row)
        if not self.live:  # nothing left: an empty state costs no call
            self._empty()

    def read(self, row: int, n: int) -> np.ndarray:
        self.check_row(row)
        if not 0 <= n <= self.lengths[row]:
            raise ConfigError(f"row {row} holds {self.lengths[row]} positions, cannot read {n}")
        if n == 0:
            s = self.spec
            return np.zeros((2, s.num_layers, s.kv_heads, 0, s.head_dim), np.float32)
        return self._entries(self.state.read(), self.mask[self.slots.index(row)], self.slots.index(row))[..., :n, :]

    def write(self, row: int, kv: np.ndarray) -> None:
        self.check_kv(kv)
        self.check_row(row)
        others = [r for r in self.live if r != row]
        contents = self._contents() if others else {}
        contents[row] = np.asarray(kv, np.float32)
        self._repack(contents)

    # ---- running ----------------------------------------------------------------------------------------------

    def prefill(self, row: int, embeds: np.ndarray) -> np.ndarray:
        """Append embeds (S, D) to row ``row``; logp (V,) after the last."""
        self.check_row(row)
        check_capacity(self.spec, [row], [self.lengths[row] + len(embeds)])
        if len(embeds) > SIDE_PREFILL and any(r != row for r in self.live):
            return self._prefill_aside(row, embeds)
        logp = np.zeros(0, np.float32)
        for start, stop, pad in prefill_pieces(len(embeds)):
            logp = self._call({row: embeds[start:stop]}, pad)[0]
        return logp

    def step(self, rows: list[int], embeds: np.ndarray) -> np.ndarray:
        """Append one position, embeds (len(rows), D), to each of ``rows``; logp (len(rows), V)."""
        for r in rows:
            self.check_row(r)
        check_capacity(self.spec, rows, self.lengths[rows] + 1)
        return self._call({r: embeds[i : i + 1] for i, r in enumerate(rows)})

    def _call(self, fed: dict[int, np.ndarray], pad: int = 0) -> np.ndarray:
        """One call over every live row and the fed rows: ``fed`` row -> its new positions (n, D), n alike for all,
        after ``pad`` masked positions (the call brings S = pad + n). Rows not fed get S masked positions; returns
        logp (len(fed), V) in ``fed``'s order."""
        keep = [b for b, r in enumerate(self.slots) if r not in self.gone]
        rows = [self.slots[b] for b in keep] + [r for r in fed if r not in self.live]
        beam = keep + [0] * (len(rows) - len(keep))  # a new row: a copy of slot 0, masked out
        n = len(next(iter(fed.values())))
        s = pad + n
        old = np.zeros((len(rows), self.mask.shape[1]), np.int64)
        old[: len(keep)] = self.mask[keep]
        embeds = np.zeros((len(rows), s, self.spec.hidden), np.float32)
        new = np.zeros((len(rows), s), np.int64)
        positions = np.zeros((len(rows), s), np.int64)
        for b, r in enumerate(rows):
            if r in fed:
                embeds[b, pad:], new[b, pad:] = fed[r], 1
                positions[b, pad:] = self.lengths[r] + np.arange(n)
        mask = np.concatenate([old, new], axis=1)
        if not self.slots:
            beam = list(range(len(rows)))  # an empty state takes the call's batch
        feeds = {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": positions}
        (logp,) = self.state.run({**feeds, "beam_idx": np.array(beam, np.int32)}, ["logp"])
        self.slots, self.mask, self.gone = rows, mask, set()
        for r in fed:
            self.lengths[r] += n
        if mask.shape[1] > 2 * int(self.lengths[rows].max()) + SLACK:
            self._repack(self._contents())
        return logp[[rows.index(r) for r in fed]]

    def _prefill_aside(self, row: int, embeds: np.ndarray) -> np.ndarray:
        """Prefill row ``row`` alone on a second request, then write every row's entries back as the state."""
        contents = self._contents()
        if self._side is None:
            self._side = StateCache(self.spec, self._rows, self._session)
        side = self._side
        try:
            if row in contents:
                side.write(row, contents[row])
            logp = side.prefill(row, embeds)
            contents[row] = side.read(row, int(side.lengths[row]))
        finally:
            side.reset(row)  # empty again, whatever happened
        self._repack(contents)
        return logp

    # ---- moving entries ---------------------------------------------------------------------------------------

    def _entries(self, tensors: dict[str, np.ndarray], mask: np.ndarray, b: int) -> np.ndarray:
        """Batch row ``b``'s real positions (``mask``) of state ``tensors``: (2, L, Hkv, n, Dh)."""
        real = np.flatnonzero(mask)
        kv = [tensors[name][b][:, real] for name in self.names]  # (Hkv, n, Dh) each: layer 0 keys, values, ...
        return np.stack([np.stack(kv[0::2]), np.stack(kv[1::2])])

    def _contents(self) -> dict[int, np.ndarray]:
        """Every live row's entries (2, L, Hkv, n, Dh), from one read of the state."""
        if not self.live:
            return {}
        tensors = self.state.read()
        return {r: self._entries(tensors, self.mask[b], b) for b, r in enumerate(self.slots) if r not in self.gone}

    def _repack(self, contents: dict[int, np.ndarray]) -> None:
        """Make ``contents`` (row -> entries) the state, each row's positions first, masked padding after."""
        rows = [r for r in sorted(contents) if contents[r].shape[3]]
        self.lengths[:] = 0
        if not rows:
            self._empty()
            return
        tensors, mask = self._tensors([contents[r] for r in rows])
        self.lengths[rows] = mask.sum(axis=1)
        self.state.write(tensors)
        self.slots, self.mask, self.gone = rows, mask, set()

    def _tensors(self, entries: list[np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """State tensors holding ``entries`` (each (2, L, Hkv, n, Dh)) as batch rows, each row's positions first
        and zeros after (the inverse of :meth:`_entries`); and their mask (rows, P)."""
        s, p = self.spec, max(kv.shape[3] for kv in entries)
        tensors = {name: np.zeros((len(entries), s.kv_heads, p, s.head_dim), np.float32) for name in self.names}
        mask = np.zeros((len(entries), p), np.int64)
        for b, kv in enumerate(entries):
            n = kv.shape[3]
            for i, name in enumerate(self.names):  # names: layer 0 keys, layer 0 values, layer 1 keys, ...
                tensors[name][b, :, :n] = kv[i % 2, i // 2]
            mask[b, :n] = 1
        return tensors, mask

    def _empty(self) -> None:
        """No row in the state: the next call starts from the graph's empty state."""
        self.state.reset()
        self.slots, self.mask, self.gone = [], np.zeros((0, 0), np.int64), set()


def _stateful(cache: LMCache) -> StateCache:
    if not isinstance(cache, StateCache):
        raise ConfigError(f"this LM graph keeps its cache as its state; it cannot run a {type(cache).__name__}")
    return cache
