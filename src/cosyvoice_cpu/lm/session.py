"""Torch-free driver of the exported LM graph (``lm.onnx``): embeddings, a shared KV cache, prefill and decode.

The graph (written by :mod:`cosyvoice_cpu.export.lm.cosyvoice2`) is the Qwen2 backbone plus the speech head; it takes
``inputs_embeds`` (B, S, D), a KV cache per layer and the per-row cache lengths, and returns the speech-token
log-probabilities at the last position of every row. Embedding tables live beside it as ``.npy`` files (float32
or float16; gathered rows are widened to float32). The text and speech tables are read row by row with ``pread``
(:mod:`cosyvoice_cpu.lm.row_table`): a memory map would keep the pages around every row ever looked up resident, up
to the whole 545 MB text table in a long-running server. The two special rows are loaded.

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
a view of those rows of a cache of more rows. S > 1 is run for one row at
a time (``LMSession.prefill``); a decode (S = 1) may mix rows of any lengths. The graph uses only the GQA inputs
that onnxruntime 1.24 already has (no ``query_seqlens``); it loads and gives the same logp on 1.24.1 and 1.32.0.

Nothing here samples: :meth:`LMSession.decode` returns log-probabilities for a sampler to use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import BoundRun, SessionConfig, as_config, check_io
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.jsontypes import JsonValue
from cosyvoice_cpu.lm.kv_cache import KVCache, LMSpec, past_names, present_names
from cosyvoice_cpu.lm.row_table import open_table
from cosyvoice_cpu.lm_files import EMBEDDING_FILES, EXPORT_HINT, GRAPH_FILE, MIN_ROWS_KEY, SPECIALS

logger = logging.getLogger(__name__)


class LMSession:
    """The LM graph, opened through the backend seam, with its embedding tables read from their files on demand.

    Args:
        graph: path of ``lm.onnx`` (or a quantized variant with the same inputs/outputs).
        embeddings: paths of the ``text``, ``speech`` and ``special`` tables (see :data:`EMBEDDING_FILES`).
        attrs: the LM facts (:class:`LMSpec` fields); checked against the graph and the tables.
        threads: intra-op threads, or the whole :class:`~cosyvoice_cpu.backends.base.SessionConfig` (its
            ``backend`` opens the graph: ONNX Runtime binds the cache in place; another backend copies it through
            each call).
        min_rows: the fewest rows a one-position call runs on; ``None`` reads the graph's ``min_rows`` metadata
            (default 1). An ``int4`` graph has 2: ORT's AVX2 4-bit ``MatMulNBits`` kernel for one row rounds
            differently from the one for several (which give every row the same bits however many there are),
            so a row decoded alone would differ from the same row in the scheduler's batch. With 2 a lone row is
            run beside an idle one (a spare cache row if need be), on the many-row kernel.
    """

    def __init__(
        self,
        graph: str | Path,
        embeddings: Mapping[str, str | Path],
        attrs: Mapping[str, JsonValue],
        threads: int | SessionConfig = 2,
        min_rows: int | None = None,
    ) -> None:
        config = as_config(threads)
        self.spec = spec = LMSpec.from_attrs(attrs)
        self.graph = Path(graph)
        if not self.graph.is_file():
            raise ModelDirError(f"{self.graph} is missing; {EXPORT_HINT}")
        self.tables = {k: self._load_table(k, embeddings) for k in EMBEDDING_FILES}
        self.session = open_graph(self.graph, config)
        self._check_graph()
        if min_rows is None:
            meta = self.session.metadata()
            try:
                min_rows = int(meta.get(MIN_ROWS_KEY, 1))
            except ValueError as e:
                raise ModelDirError(
                    f"{self.graph} has metadata {MIN_ROWS_KEY}={meta[MIN_ROWS_KEY]!r}, not an integer; {EXPORT_HINT}"
                ) from e
        if not 1 <= min_rows <= 2:
            raise ConfigError(f"min_rows must be 1 or 2, got {min_rows}")
        self.min_rows = min_rows
        logger.info(
            "LM graph %s loaded (%d layers, max_len %d, %d threads)",
            self.graph,
            spec.num_layers,
            spec.max_len,
            config.threads,
        )

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        attrs: Mapping[str, JsonValue],
        graph_file: str = GRAPH_FILE,
        threads: int | SessionConfig = 2,
        min_rows: int | None = None,
    ) -> LMSession:
        """Open ``graph_file`` and the tables named in ``attrs["embeddings"]`` (default names) in model_dir."""
        model_dir = Path(model_dir)
        names = {**EMBEDDING_FILES, **dict(attrs.get("embeddings", {}))}
        return cls(model_dir / graph_file, {k: model_dir / v for k, v in names.items()}, attrs, threads, min_rows)

    def _load_table(self, key: str, embeddings: Mapping[str, str | Path]) -> np.ndarray:
        s = self.spec
        rows, width = {
            "text": (s.text_vocab, s.text_dim),
            "speech": (s.speech_rows, s.hidden),
            "special": (len(SPECIALS), s.hidden),
        }[key]
        if key not in embeddings:
            raise ConfigError(f"no path given for the {key} embedding table")
        path = Path(embeddings[key])
        try:
            table = np.load(path) if key == "special" else open_table(path)
        except (OSError, ValueError) as e:
            raise ModelDirError(f"cannot read the {key} embedding table {path} ({e}); {EXPORT_HINT}") from e
        if table.dtype not in (np.float32, np.float16) or table.shape != (rows, width):
            raise ModelDirError(
                f"{path} holds {table.dtype} {table.shape}, expected float32 or float16 {(rows, width)}; {EXPORT_HINT}"
            )
        return table

    def _check_graph(self) -> None:
        """Raise ModelDirError unless the graph's inputs/outputs are exactly the contract for ``self.spec``."""
        s = self.spec
        kv = ["batch", s.kv_heads, s.max_len, s.head_dim]
        want_in = {
            "inputs_embeds": ("tensor(float)", ["batch", "seq", s.hidden]),
            "seqlens_k": ("tensor(int32)", ["batch"]),
            "total_sequence_length": ("tensor(int32)", []),
        }
        want_out = {"logp": ("tensor(float)", ["batch", s.speech_vocab])}
        for i in range(s.num_layers):
            want_in.update({n: ("tensor(float)", kv) for n in past_names(i)})
            want_out.update({n: ("tensor(float)", kv) for n in present_names(i)})
        check_io(self.session, self.graph, want_in, want_out)

    # ---- embeddings -------------------------------------------------------------------------------------------

    def _gather(self, key: str, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        table = self.tables[key]
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(table)):
            raise ConfigError(f"{key} token ids must lie in [0, {len(table)}), got {ids.min()}..{ids.max()}")
        return np.ascontiguousarray(table[ids], dtype=np.float32)

    def embed_text(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Text token ids (T,) -> embeddings (T, text_dim) (v2: the LM input; v1: the text encoder's input)."""
        return self._gather("text", ids)

    def embed_speech(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Speech token ids (T,) (including the stop ids) -> embeddings (T, D)."""
        return self._gather("speech", ids)

    def special(self, name: str) -> np.ndarray:
        """The ``sos`` or ``task_id`` embedding (D,)."""
        if name not in SPECIALS:
            raise ConfigError(f"unknown special embedding {name!r}; choose one of {', '.join(SPECIALS)}")
        return np.array(self.tables["special"][SPECIALS[name]], dtype=np.float32)

    # ---- running ----------------------------------------------------------------------------------------------

    def new_cache(self, rows: int = 1) -> KVCache:
        """A KV cache for ``rows`` sequences of up to ``max_len`` positions each (and the spare row
        ``min_rows`` may need)."""
        return KVCache(self.spec, rows, spare=max(0, self.min_rows - rows))

    def prefill(self, cache: KVCache, row: int, embeds: np.ndarray) -> np.ndarray:
        """Append embeds (T, D) to row ``row`` (empty or not) and return logp (V,) after its last position."""
        cache._check_row(row)
        embeds = np.asarray(embeds, dtype=np.float32)
        if embeds.ndim != 2 or embeds.shape[0] == 0 or embeds.shape[1] != self.spec.hidden:
            raise ConfigError(f"prefill embeds must have shape (T>0, {self.spec.hidden}), got {embeds.shape}")
        if len(embeds) < self.min_rows:  # one position: a step, padded like a decode
            return self._step(cache, [row], embeds)[0]
        return self._run(cache, row, embeds[None], np.array([cache.lengths[row] + len(embeds)]))[0]

    def decode(self, cache: KVCache, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Feed one speech token to each of ``rows``; return logp (len(rows), V) in the order of ``rows``."""
        rows = [int(r) for r in rows]
        if not rows or len(rows) != len(tokens) or len(set(rows)) != len(rows):
            raise ConfigError(f"decode needs distinct rows and one token per row, got rows {rows}, tokens {tokens}")
        for r in rows:
            cache._check_row(r)
        return self._step(cache, rows, self.embed_speech(tokens))

    def _step(self, cache: KVCache, rows: list[int], embeds: np.ndarray) -> np.ndarray:
        """Append one position, embeds (len(rows), D), to each of ``rows``; return logp (len(rows), V).

        The graph runs on the contiguous row range min(rows)..max(rows), widened to ``min_rows`` rows by a
        neighbour (after the range if the cache has one, spare rows included, else before it); rows in the range
        that are not stepped get a zero embedding written one past their end (their length does not change, and
        the next position written to them overwrites it), so they cost compute but not correctness.
        """
        if len(cache.lengths) < self.min_rows:
            raise ConfigError(f"this LM runs at least {self.min_rows} rows per call; make its cache with new_cache()")
        r0, r1 = min(rows), max(rows) + 1
        while r1 - r0 < self.min_rows:
            r1, r0 = (r1 + 1, r0) if r1 < len(cache.lengths) else (r1, r0 - 1)
        active = np.array(rows) - r0
        padded = np.zeros((r1 - r0, 1, self.spec.hidden), np.float32)
        padded[active, 0] = embeds
        embeds = padded
        ends = cache.lengths[r0:r1] + 1  # idle rows: a scratch position just past their end
        idle = np.ones(r1 - r0, bool)
        idle[active] = False
        # a full idle row gets its last position overwritten: harmless, as any further use of it raises
        ends[idle] = np.minimum(ends[idle], self.spec.max_len)
        return self._run(cache, r0, embeds, ends, active=active)[active]

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
        if np.any(ends[act] > self.spec.max_len):
            raise ConfigError(
                f"rows {sorted(int(r0 + i) for i in act if ends[i] > self.spec.max_len)} would exceed the "
                f"KV cache capacity max_len={self.spec.max_len}; end the request or export with a larger max_len"
            )
        feeds = {
            "inputs_embeds": np.ascontiguousarray(embeds),
            "seqlens_k": (ends - 1).astype(np.int32),
            "total_sequence_length": np.array(int(ends.max()), np.int32),
        }
        logp = np.empty((b, self.spec.speech_vocab), np.float32)
        self._binding(cache, r0, b).run(feeds, {"logp": logp})
        cache.lengths[r0 + act] = ends[act]
        return logp
