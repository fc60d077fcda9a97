"""The LM's facts the runtime reads (:class:`LMSpec`) and the graph's names of each layer's KV cache.

Imports nothing of the LM's modules: the cache, both graph forms and the exporters read these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.jsontypes import JsonValue
from cosyvoice_cpu.lm_files import EXPORT_HINT


def past_names(i: int) -> tuple[str, str]:
    """Graph input names of layer i's cache: (past_key_i, past_value_i)."""
    return f"past_key_{i}", f"past_value_{i}"


def present_names(i: int) -> tuple[str, str]:
    """Graph output names of layer i's cache: (present_key_i, present_value_i)."""
    return f"present_key_{i}", f"present_value_{i}"


@dataclass(frozen=True)
class LMSpec:
    """The facts of an exported LM the runtime needs (the ``lm`` GraphArtifact's ``attrs``).

    ``speech_rows`` (rows of the speech table; default ``speech_vocab``, the head size) and ``text_dim`` (width of
    the text table; default ``hidden``) differ for CosyVoice-300M, whose text table feeds a text encoder and whose
    speech table has no EOS row.
    """

    max_len: int
    num_layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    speech_vocab: int
    text_vocab: int
    speech_rows: int = 0
    text_dim: int = 0

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, JsonValue]) -> LMSpec:
        optional = ("speech_rows", "text_dim")
        missing = [k for k in cls.__dataclass_fields__ if k not in attrs and k not in optional]
        if missing:
            raise ModelDirError(f"LM attributes lack {', '.join(missing)}; {EXPORT_HINT}")
        spec = cls(**{k: int(attrs[k]) for k in cls.__dataclass_fields__ if k in attrs})
        return replace(spec, speech_rows=spec.speech_rows or spec.speech_vocab, text_dim=spec.text_dim or spec.hidden)
