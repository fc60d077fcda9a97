"""The export's family seam: one small class per model family owning everything the export does differently,
siblings of one base (:class:`ExportFamily`, whose defaults hold for every family).

:mod:`.exporter` and :mod:`.stages` ask the family object of a source directory
(:func:`cosyvoice_cpu.workshop.parts.export_family`, the family's row of the torch side's one table) and never
test a family's name:

- :meth:`ExportFamily.required_files` / :meth:`ExportFamily.copied_onnx` / :meth:`ExportFamily.check_source`: what
  a released directory must hold and the checks made before minutes of work (CosyVoice-300M's tiktoken file);
- :attr:`ExportFamily.plans`: per stage (LM, flow, HiFT) the graph module whose ``export_<stage>`` /
  ``verify_<stage>`` write and gate it, and which graphs take which recipe precision;
- :meth:`ExportFamily.export_tokenizer`, :meth:`ExportFamily.flow_facts`, :meth:`ExportFamily.lm_facts`,
  :meth:`ExportFamily.export_speakers`: the tokenizer file and the manifest sections that differ;
- :attr:`ExportFamily.stateful_lm`: whether ``export --openvino`` also writes the LM as a stateful OpenVINO model.

What the LM numerics gate needs of a family's graph (its attrs, the prompt's text table and x-vector row) is given by
each LM graph module (its ``GATE``, a :class:`cosyvoice_cpu.export.common.LMGate` holding the family's facts):
the plans name those modules, which never import this one.

The facts (sample rate, speech tokenizer, text tokenizer, built-in speakers, ...) come from the one table
:mod:`cosyvoice_cpu.facts`. Torch, onnx and the tokenizer converters are imported inside the methods, so importing
this module stays cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from cosyvoice_cpu.errors import ExportError
from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.manifest import VOICES_DIR

logger = logging.getLogger(__name__)

CHECKPOINTS = ("llm.pt", "flow.pt", "hift.pt")
# The text tokenizer's source files, by the facts' ``text_tokenizer``: Qwen2's BPE ships in CosyVoice-BlankEN/;
# Whisper's tiktoken vocabulary is found (and checked) by :meth:`ExportCosyVoice.check_source`.
TOKENIZER_FILES = {
    "qwen2": (
        "CosyVoice-BlankEN/config.json",
        "CosyVoice-BlankEN/vocab.json",
        "CosyVoice-BlankEN/merges.txt",
        "CosyVoice-BlankEN/tokenizer_config.json",
    ),
    "whisper": (),
}


@dataclass(frozen=True)
class StagePlan:
    """One stage: its reference module, its exporter/verifier, and the graphs its recipe precision applies to."""

    name: str  # for progress lines
    ref: str  # load_reference stage and checkpoint stem
    graphs: Callable[[], ModuleType]  # the stage's graph module (export_<ref>/verify_<ref>), imported when called
    recipe_field: str  # the stage's main Recipe field
    quantized: dict[str, str]  # graph key -> the Recipe field whose precision applies to it

    def precisions(self, recipe: Any) -> dict[str, str]:
        """Recipe field -> precision, for the fields this stage quantizes (the main field first)."""
        fields = dict.fromkeys([self.recipe_field, *self.quantized.values()])
        return {f: getattr(recipe, f) for f in fields}


# The graph modules of the stages, imported when an export needs them (they import torch): plain imports, so that
# readers, IDEs and the import-graph test follow them.
def _lm_cosyvoice2() -> ModuleType:
    from cosyvoice_cpu.export.lm import cosyvoice2

    return cosyvoice2


def _lm_cosyvoice() -> ModuleType:
    from cosyvoice_cpu.export.lm import cosyvoice

    return cosyvoice


def _lm_cosyvoice3() -> ModuleType:
    from cosyvoice_cpu.export.lm import cosyvoice3

    return cosyvoice3


def _flow_cosyvoice2() -> ModuleType:
    from cosyvoice_cpu.export.flow import cosyvoice2

    return cosyvoice2


def _flow_cosyvoice() -> ModuleType:
    from cosyvoice_cpu.export.flow import cosyvoice

    return cosyvoice


def _flow_cosyvoice3() -> ModuleType:
    from cosyvoice_cpu.export.flow import cosyvoice3

    return cosyvoice3


def _hift_cosyvoice() -> ModuleType:
    from cosyvoice_cpu.export.hift import cosyvoice

    return cosyvoice


def _hift_cosyvoice3() -> ModuleType:
    from cosyvoice_cpu.export.hift import cosyvoice3

    return cosyvoice3


ESTIMATORS = {
    "flow_estimator": "flow_estimator",
    "flow_estimator_stream": "flow_estimator",
    "flow_encoder": "flow_encoder",
}
HIFT_QUANTIZED = {"hift_decode": "hift"}


class ExportFamily:
    """What the export of one model family does; each family's subclass sets :attr:`facts` and :attr:`plans`,
    gives :meth:`export_tokenizer` and :meth:`flow_facts`, and overrides the other hooks where its family
    differs."""

    facts: ClassVar[FamilyFacts]
    plans: ClassVar[tuple[StagePlan, ...]]

    @property
    def name(self) -> str:
        """The family's key (``cosyvoice2``, ``cosyvoice``, ``cosyvoice3``)."""
        return self.facts.name

    def required_files(self) -> tuple[str, ...]:
        """Files (relative paths) a released directory of this family must hold."""
        return (*CHECKPOINTS, "campplus.onnx", self.facts.speech_tokenizer, *TOKENIZER_FILES[self.facts.text_tokenizer])

    def copied_onnx(self) -> dict[str, str]:
        """Manifest key -> file name of the front-end ONNX models copied unchanged."""
        return {"campplus": "campplus.onnx", "speech_tokenizer": self.facts.speech_tokenizer}

    def check_source(self, src: Path) -> None:
        """Family-specific checks of a source directory made before the export starts (none by default)."""

    def export_tokenizer(self, cfg: Any, out: Path) -> dict[str, Any]:
        """Write ``tokenizer.json`` into ``out``; returns the manifest's ``text`` section."""
        raise NotImplementedError

    def flow_facts(self, flow: Any) -> dict[str, Any]:
        """The manifest's ``flow`` section: the solver defaults (:func:`solver_facts`) plus the family's own."""
        raise NotImplementedError

    def lm_facts(self, lm_cfg: Any) -> dict[str, Any]:
        """Entries of the manifest's ``lm`` section beyond the ones every family has (none by default)."""
        return {}

    @property
    def stateful_lm(self) -> bool:
        """Whether ``export --openvino`` also writes this family's LM as a stateful OpenVINO model (manifest key
        ``lm_ov``, :mod:`cosyvoice_cpu.export.openvino_lm`): the Qwen2 LM's families (the facts' ``openvino_lm``)."""
        return self.facts.openvino_lm

    def export_speakers(self, cfg: Any, out: Path) -> list[Path]:
        """Built-in speakers written as ``voices/<name>.npz``; families without them return []."""
        if not self.facts.builtin_speakers:
            return []
        return _write_builtin_speakers(cfg, out)


class ExportCosyVoice2(ExportFamily):
    """CosyVoice2-0.5B: the Qwen2 LM, the chunk-causal flow (Conformer encoder, U-Net estimator), HiFT."""

    facts = facts("cosyvoice2")
    plans = (
        StagePlan("LM", "lm", _lm_cosyvoice2, "lm", {"lm": "lm"}),
        StagePlan("flow", "flow", _flow_cosyvoice2, "flow_estimator", ESTIMATORS),
        StagePlan("HiFT", "hift", _hift_cosyvoice, "hift", HIFT_QUANTIZED),
    )

    def export_tokenizer(self, cfg: Any, out: Path) -> dict[str, Any]:
        """:func:`cosyvoice_cpu.export.tokenizer.cosyvoice2.export_tokenizer`."""
        from cosyvoice_cpu.export.tokenizer.cosyvoice2 import export_tokenizer

        return export_tokenizer(cfg.blank_en_dir, out)

    def flow_facts(self, flow: Any) -> dict[str, Any]:
        """Solver defaults plus the streaming facts (the encoder chunk in tokens)."""
        return {
            **solver_facts(flow),
            "pre_lookahead_len": flow.pre_lookahead_len,
            "token_mel_ratio": flow.token_mel_ratio,
            "static_chunk_size": flow.encoder.static_chunk_size,
        }


class ExportCosyVoice(ExportFamily):
    """CosyVoice-300M (base, -SFT, -Instruct): the transformer LM with its text encoder (which takes the LM's
    precision: 78 M parameters at full size), the length-regulated flow, 22.05 kHz HiFT, Whisper's tiktoken
    vocabulary converted to ``tokenizer.json`` and the built-in speakers of ``spk2info.pt``."""

    facts = facts("cosyvoice")
    plans = (
        StagePlan("LM", "lm", _lm_cosyvoice, "lm", {"lm": "lm", "lm_text_encoder": "lm"}),
        StagePlan(
            "flow",
            "flow",
            _flow_cosyvoice,
            "flow_estimator",
            {"flow_estimator": "flow_estimator", "flow_encoder": "flow_encoder"},
        ),
        StagePlan("HiFT", "hift", _hift_cosyvoice, "hift", HIFT_QUANTIZED),
    )

    def check_source(self, src: Path) -> None:
        """The Whisper tiktoken vocabulary must be found now, not after minutes of export."""
        from cosyvoice_cpu.export.tokenizer.cosyvoice import find_tiktoken

        find_tiktoken(src)

    def export_tokenizer(self, cfg: Any, out: Path) -> dict[str, Any]:
        """Whisper's multilingual tiktoken vocabulary converted to ``tokenizer.json``; refused when it is larger
        than the LM's text table (the wrong vocabulary)."""
        from cosyvoice_cpu.export.tokenizer.cosyvoice import find_tiktoken, write_whisper_tokenizer

        path = find_tiktoken(cfg.model_dir)
        text = write_whisper_tokenizer(path, out)
        if text["vocab_size"] > cfg.lm.text_token_size:
            raise ExportError(
                f"{path} has {text['vocab_size']} tokens but the LM's text table has {cfg.lm.text_token_size} rows: "
                "it is the wrong vocabulary for this model (CosyVoice-300M uses Whisper's multilingual.tiktoken)"
            )
        return text

    def flow_facts(self, flow: Any) -> dict[str, Any]:
        """Solver defaults plus the token rate (50 Hz tokens stretched by the length regulator)."""
        return {**solver_facts(flow), "input_frame_rate": flow.input_frame_rate}


class ExportCosyVoice3(ExportFamily):
    """Fun-CosyVoice3-0.5B: CosyVoice2's LM and flow contracts (its own LM head and stop facts, a DiT estimator with its
    own stream graph and time table), the causal HiFT, BlankEN with the v3 special ids."""

    facts = facts("cosyvoice3")
    plans = (
        StagePlan("LM", "lm", _lm_cosyvoice3, "lm", {"lm": "lm"}),
        StagePlan(
            "flow", "flow", _flow_cosyvoice3, "flow_estimator", {**ESTIMATORS, "flow_time": "flow_estimator"}
        ),  # the DiT's time table: the estimator's precision
        StagePlan("HiFT", "hift", _hift_cosyvoice3, "hift", HIFT_QUANTIZED),
    )

    def export_tokenizer(self, cfg: Any, out: Path) -> dict[str, Any]:
        """:func:`cosyvoice_cpu.export.tokenizer.cosyvoice3.export_tokenizer`."""
        from cosyvoice_cpu.export.tokenizer.cosyvoice3 import export_tokenizer

        return export_tokenizer(cfg.blank_en_dir, out)

    def flow_facts(self, flow: Any) -> dict[str, Any]:
        """Solver defaults plus the DiT's chunk mask: 50 frames (25 tokens); no encoder chunk."""
        chunk = flow.estimator.static_chunk_size
        return {
            **solver_facts(flow),
            "pre_lookahead_len": flow.pre_lookahead_len,
            "token_mel_ratio": flow.token_mel_ratio,
            "static_chunk_size": chunk // flow.token_mel_ratio,
            "chunk_frames": chunk,
        }

    def lm_facts(self, lm_cfg: Any) -> dict[str, Any]:
        """The official min-length mask is v3's sos id; the text must hold ``<|endofprompt|>``."""
        return {"min_len_masked_id": lm_cfg.min_len_masked_id, "endofprompt_id": lm_cfg.endofprompt_id}


def solver_facts(flow: Any) -> dict[str, Any]:
    """The flow's solver defaults, the same for every family."""
    return {
        "n_timesteps": flow.cfm.n_timesteps,
        "cfg_rate": flow.cfm.inference_cfg_rate,
        "t_scheduler": flow.cfm.t_scheduler,
        "spk_embed_dim": flow.spk_embed_dim,
    }


def _write_builtin_speakers(cfg: Any, out: Path) -> list[Path]:
    """The speakers of ``spk2info.pt`` as ``voices/<name>.npz`` (voices without prompt audio: the x-vector alone
    conditions the LM and the flow); a directory without the file (base models) has none."""
    import numpy as np

    from cosyvoice_cpu.reference.checkpoint import load_speakers
    from cosyvoice_cpu.voices.voice import Voice, VoiceError

    written = []
    for name, emb in load_speakers(cfg.model_dir).items():
        try:
            voice = Voice(
                name,
                "",
                np.zeros(0, np.int32),
                np.zeros((0, 80), np.float32),
                emb.numpy().reshape(-1),
                family=cfg.family,
                sample_rate=cfg.sample_rate,
                meta={"builtin": True},
            )
        except VoiceError as e:
            raise ExportError(f"built-in speaker {name!r} of spk2info.pt cannot be a voice: {e}") from e
        written.append(voice.save(out / VOICES_DIR / f"{name}.npz"))
    if written:
        (out / VOICES_DIR).chmod(0o755)
    return written
