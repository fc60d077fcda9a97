"""Torch-free driver of the exported LM graph (``lm.onnx`` or ``lm.ov.xml``): embeddings, caches, prefill, decode.

The graph (written by :mod:`cosyvoice_cpu.export.lm.cosyvoice2`) is the Qwen2 backbone plus the speech head; it takes
``inputs_embeds`` (B, S, D), a KV cache per layer and the per-row cache lengths, and returns the speech-token
log-probabilities at the last position of every row. Embedding tables live beside it as ``.npy`` files (float32
or float16; gathered rows are widened to float32). The text and speech tables are read row by row with ``pread``
(:mod:`cosyvoice_cpu.lm.row_table`): a memory map would keep the pages around every row ever looked up resident, up
to the whole 545 MB text table in a long-running server. The two special rows are loaded.

The graph runs in one of two forms (:mod:`cosyvoice_cpu.lm.cache`), by what the backend opened: the ONNX graph with
the cache bound in place (:mod:`~cosyvoice_cpu.lm.bound_graph`, ONNX Runtime) or a stateful graph that keeps it as
its state (:mod:`~cosyvoice_cpu.lm.state_graph`, OpenVINO's LLM form). Both take new positions (B, S, D) and give
the speech head's log-probabilities at each row's last one.

Nothing here samples: :meth:`LMSession.decode` returns log-probabilities for a sampler to use.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig, as_config
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.jsontypes import JsonValue
from cosyvoice_cpu.lm.bound_graph import BoundGraph
from cosyvoice_cpu.lm.cache import LMCache, LMGraph
from cosyvoice_cpu.lm.kv_spec import LMSpec
from cosyvoice_cpu.lm.row_table import open_table
from cosyvoice_cpu.lm.state_graph import StateGraph
from cosyvoice_cpu.lm_files import EMBEDDING_FILES, EXPORT_HINT, GRAPH_FILE, MIN_ROWS_KEY, SPECIALS

logger = logging.getLogger(__name__)


class LMSession:
    """The LM graph, opened through the backend seam, with its embedding tables read from their files on demand.

    Args:
        graph: path of ``lm.onnx`` (or a quantized variant with the same inputs/outputs), or of a stateful graph
            (``lm.ov.xml``) for a backend that opens one.
        embeddings: paths of the ``text``, ``speech`` and ``special`` tables (see :data:`EMBEDDING_FILES`).
        attrs: the LM facts (:class:`LMSpec` fields); checked against the graph and the tables.
        threads: intra-op threads, or the whole :class:`~cosyvoice_cpu.backends.base.SessionConfig` (its
            ``backend`` opens the graph).
        min_rows: the fewest rows a one-position call runs on; ``None`` reads the graph's ``min_rows`` metadata
            (default 1). An ``int4`` graph has 2: ORT's AVX2 4-bit ``MatMulNBits`` kernel for one row rounds
            differently from the one for several (which give every row the same bits however many there are),
            so a row decoded alone would differ from the same row in the scheduler's batch. With 2 a lone row is
            run beside an idle one (a spare cache row if need be), on the many-row kernel. A stateful graph has 1.
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
        self.runner: LMGraph
        if self.session.stateful:
            self.runner = StateGraph(self.session, spec, self.graph)
        else:
            self.runner = BoundGraph(self.session, spec, self.graph, self._min_rows(min_rows))
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

    def _min_rows(self, given: int | None) -> int:
        """``given``, else the graph's ``min_rows`` metadata (default 1)."""
        if given is not None:
            return given
        meta = self.session.metadata()
        try:
            return int(meta.get(MIN_ROWS_KEY, 1))
        except ValueError as e:
            raise ModelDirError(
                f"{self.graph} has metadata {MIN_ROWS_KEY}={meta[MIN_ROWS_KEY]!r}, not an integer; {EXPORT_HINT}"
            ) from e

    @property
    def min_rows(self) -> int:
        """The fewest rows a one-position call runs on (1 on a stateful graph)."""
        return self.runner.min_rows

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

    def new_cache(self, rows: int = 1) -> LMCache:
        """A KV cache for ``rows`` sequences of up to ``max_len`` positions each, of the graph's form."""
        return self.runner.new_cache(rows)

    def prefill(self, cache: LMCache, row: int, embeds: np.ndarray) -> np.ndarray:
        """Append embeds (T, D) to row ``row`` (empty or not) and return logp (V,) after its last position."""
        cache.check_row(row)
        embeds = np.asarray(embeds, dtype=np.float32)
        if embeds.ndim != 2 or embeds.shape[0] == 0 or embeds.shape[1] != self.spec.hidden:
            raise ConfigError(f"prefill embeds must have shape (T>0, {self.spec.hidden}), got {embeds.shape}")
        return self.runner.prefill(cache, row, embeds)

    def decode(self, cache: LMCache, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Feed one speech token to each of ``rows``; return logp (len(rows), V) in the order of ``rows``."""
        rows = [int(r) for r in rows]
        if not rows or len(rows) != len(tokens) or len(set(rows)) != len(rows):
            raise ConfigError(f"decode needs distinct rows and one token per row, got rows {rows}, tokens {tokens}")
        for r in rows:
            cache.check_row(r)
        return self.runner.step(cache, rows, self.embed_speech(tokens))
