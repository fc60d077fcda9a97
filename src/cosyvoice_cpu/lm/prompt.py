"""The LM's prefill input (T, D) per family, torch-free.

- CosyVoice2: ``[sos, text_emb(prompt_text ⊕ text), task_id, speech_emb(prompt_speech)]``: table rows only.
- CosyVoice-300M (v1): ``[sos, speaker, encode(text_emb(prompt_text ⊕ text)), task_id, speech_emb(prompt_speech)]``
  where ``encode`` is the causal Conformer text encoder graph (``lm_text_encoder.onnx``) and ``speaker`` the
  projected, L2-normalised x-vector (left out in instruct mode, as the official ``frontend_instruct`` drops
  ``llm_embedding``). See :mod:`cosyvoice_cpu.export.lm.cosyvoice` for the graph.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig, as_config, check_io
from cosyvoice_cpu.backends.registry import open_graph
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.lm.session import LMSession

logger = logging.getLogger(__name__)

EMBEDDING_DIM = 192  # campplus x-vectors


class TextEncoder:
    """``lm_text_encoder.onnx``: text embeddings (T, Dt) and an x-vector -> encoded text (T, D), speaker (D,).

    Args:
        path: the graph file; dims: (Dt, D) the text table width and the LM width (checked against the graph).
        threads: ORT intra-op threads (or a SessionConfig).
    """

    def __init__(self, path: str | Path, dims: tuple[int, int], threads: int | SessionConfig = 1) -> None:
        path = Path(path)
        if not path.is_file():
            raise ModelDirError(f"{path} is missing; re-export the model directory with `cosyvoice-cpu export`")
        self.session = open_graph(path, as_config(threads))
        dt, d = dims
        check_io(
            self.session,
            path,
            {"text_embeds": ("tensor(float)", [1, "seq", dt]), "embedding": ("tensor(float)", [1, EMBEDDING_DIM])},
            {"text": ("tensor(float)", [1, "seq", d]), "speaker": ("tensor(float)", [1, d])},
        )

    def __call__(self, text_embeds: np.ndarray, embedding: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(T, Dt) float32 and a (192,) x-vector (None: zeros, output unused) -> ((T, D), (D,))."""
        emb = np.zeros(EMBEDDING_DIM, np.float32) if embedding is None else np.asarray(embedding, np.float32)
        if emb.size != EMBEDDING_DIM:
            raise ConfigError(f"the speaker embedding must hold {EMBEDDING_DIM} values, got {emb.shape}")
        text, speaker = self.session.run(
            None,
            {
                "text_embeds": np.ascontiguousarray(text_embeds[None], np.float32),
                "embedding": emb.reshape(1, EMBEDDING_DIM),
            },
        )
        return text[0], speaker[0]


def assemble(
    session: LMSession,
    text_ids: np.ndarray,
    prompt_speech: np.ndarray,
    encoder: TextEncoder | None = None,
    speaker: np.ndarray | None = None,
    own_rows: int = 0,
) -> np.ndarray:
    """The prefill embeddings (T, D) for ``text_ids`` (prompt transcript ⊕ text, int64) and prompt speech tokens.

    ``encoder`` is given for CosyVoice-300M (then ``speaker``, a (192,) x-vector or None, adds its row); CosyVoice2
    takes neither (a speaker is refused: its LM has no speaker input). ``own_rows`` (CosyVoice-300M): the first
    that many text rows are encoded on their own. The text encoder is causal, so they equal the rows of the whole
    encoding (bitwise on the tiny fixture's int8w export, where the rows did not depend on the length; at worst
    float rounding), and they are then a function of those ids alone, whatever kernel paths another length
    takes: the LM prefix cache (:mod:`cosyvoice_cpu.lm.prefix`) keys them by the prompt transcript.
    """
    text = session.embed_text(text_ids)
    if encoder is None:
        if speaker is not None:
            raise ConfigError("this model's LM takes no speaker embedding (CosyVoice2/3 condition only the flow)")
        parts = [session.special("sos")[None], text]
    else:
        encoded, spk = encoder(text, speaker)
        if own_rows:
            encoded[:own_rows] = encoder(text[:own_rows], speaker)[0]
        parts = [session.special("sos")[None]] + ([] if speaker is None else [spk[None]]) + [encoded]
    return np.concatenate(parts + [session.special("task_id")[None], session.embed_speech(prompt_speech)])
