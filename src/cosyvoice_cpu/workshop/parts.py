"""The torch side's one table of model families (``[export]`` extra): per family its reference loader, the text
tokenizer of the reference pipeline, its export plan and its fixture writer.

This module sits on a floor above the three: the per-family modules (``reference/{lm,flow,hift}/<family>.py``,
:mod:`cosyvoice_cpu.reference.loaders`, :mod:`cosyvoice_cpu.export.families`, ``fixtures/weights/<family>.py``)
never import it; what reads it is what works on a directory of any family, beside it in ``workshop/``:
:func:`load_reference` and :func:`detect_family` here, the exporter (:mod:`.exporter`, :mod:`.export_stages`),
the fixture writer (:mod:`.fixture_writer`) and the reference pipeline (:mod:`.reference_pipeline`). Adding a
family: a row of :mod:`cosyvoice_cpu.facts`, a module per stage that differs, and one line in :data:`PARTS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ExportError, ModelDirError
from cosyvoice_cpu.export.families import ExportCosyVoice, ExportCosyVoice2, ExportCosyVoice3, ExportFamily
from cosyvoice_cpu.facts import FAMILIES, FamilyFacts
from cosyvoice_cpu.fixtures.common import FamilyWriter
from cosyvoice_cpu.fixtures.weights import cosyvoice, cosyvoice2, cosyvoice3
from cosyvoice_cpu.reference import loaders
from cosyvoice_cpu.reference.model_dir import STAGES, FamilyLoader, ModelConfig, ReferenceModel, lm_class, read_yaml
from cosyvoice_cpu.reference.tokenizer import CosyVoice2Tokenizer, QwenTextTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FamilyParts:
    """Everything the torch side does differently for one family.

    Attributes:
        loader: how the reference reads and builds its directories.
        export: what ``cosyvoice-cpu export`` does for it (files, graph modules per stage, manifest sections).
        fixture: how its random-weight fixtures are written.
        tokenizer: the text tokenizer :class:`~cosyvoice_cpu.workshop.reference_pipeline.ReferencePipeline` runs it
            with, or None where that pipeline does not run the family (its prompt rules are the runtime's alone).
    """

    loader: FamilyLoader
    export: ExportFamily
    fixture: FamilyWriter
    tokenizer: type[QwenTextTokenizer] | None = None

    @property
    def facts(self) -> FamilyFacts:
        """The family's row of :mod:`cosyvoice_cpu.facts`."""
        return self.loader.facts


_ROWS = (  # one line per family
    FamilyParts(loaders.COSYVOICE2, ExportCosyVoice2(), cosyvoice2.WRITER, CosyVoice2Tokenizer),
    FamilyParts(loaders.COSYVOICE, ExportCosyVoice(), cosyvoice.WRITER),
    FamilyParts(loaders.COSYVOICE3, ExportCosyVoice3(), cosyvoice3.WRITER),
)
_BY_NAME = {p.facts.name: p for p in _ROWS}
# Keyed by the facts table's names, in its order: a family of the facts without a row is a KeyError at import.
PARTS: dict[str, FamilyParts] = {name: _BY_NAME[name] for name in FAMILIES}


def family_parts(name: str) -> FamilyParts:
    """The parts of family ``name``; :class:`ModelDirError` naming the supported families for others."""
    parts = PARTS.get(name)
    if parts is None:
        raise ModelDirError(f"unknown model family {name!r}; supported: {', '.join(PARTS)}")
    return parts


def export_family(name: str) -> ExportFamily:
    """The export plan of family ``name``; :class:`ExportError` naming the exportable families for others."""
    if name not in PARTS:
        raise ExportError(f"model family {name!r} is not exportable (export supports {', '.join(PARTS)})")
    return PARTS[name].export


def family_of(data: dict[str, Any], where: Path) -> str:
    """Tell the family from the LM class a parsed yaml names."""
    found = lm_class(data, where)
    for parts in PARTS.values():
        if parts.loader.lm_class == found:
            return parts.facts.name
    known = sorted(p.loader.lm_class for p in PARTS.values())
    raise ModelDirError(
        f"{where}: unknown LM class {data['llm'].target}; expected one of {known} "
        "(CosyVoice-300M, CosyVoice2-0.5B or Fun-CosyVoice3-0.5B)"
    )


def detect_family(model_dir: str | Path) -> str:
    """The family of a model directory, from its yaml's content only (no other file is read or checked)."""
    yaml_path, data = read_yaml(Path(model_dir))
    return family_of(data, yaml_path)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse a model directory of any family (:meth:`FamilyLoader.config` of the family its yaml names)."""
    return PARTS[detect_family(model_dir)].loader.config(model_dir)


def load_reference(model_dir: str | Path, stages: tuple[str, ...] = STAGES) -> ReferenceModel:
    """Build the reference modules of a model directory and load its checkpoints strictly.

    Args:
        model_dir: a released (or fixture) CosyVoice-300M, CosyVoice2 or Fun-CosyVoice3 directory.
        stages: which of ``lm``, ``flow``, ``hift`` to load (others stay None).
    """
    return PARTS[detect_family(model_dir)].loader.load(model_dir, stages)
