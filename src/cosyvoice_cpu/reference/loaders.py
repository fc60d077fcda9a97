"""How the reference reads each family's directory: one :class:`~cosyvoice_cpu.reference.model_dir.FamilyLoader`
per family (its yaml's LM class, its released ``feat_extractor`` values, its stage-config reader and its module
classes). :mod:`cosyvoice_cpu.workshop.parts` puts each in its family's row; a fixture writer uses its own family's
directly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.reference.flow.cosyvoice import FlowV1, FlowV1Config
from cosyvoice_cpu.reference.flow.cosyvoice2 import Flow, FlowConfig
from cosyvoice_cpu.reference.flow.cosyvoice3 import FlowV3, FlowV3Config
from cosyvoice_cpu.reference.hift.cosyvoice import HiFT, HiFTConfig
from cosyvoice_cpu.reference.hift.cosyvoice3 import CausalHiFT, CausalHiFTConfig
from cosyvoice_cpu.reference.lm.cosyvoice import TransformerLM, TransformerLMConfig
from cosyvoice_cpu.reference.lm.cosyvoice2 import LMConfig, Qwen2LM
from cosyvoice_cpu.reference.lm.cosyvoice3 import CosyVoice3LM, CosyVoice3LMConfig
from cosyvoice_cpu.reference.lm.qwen2 import Qwen2Config
from cosyvoice_cpu.reference.model_dir import FamilyLoader, ModelConfig
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

V3_CLASSES = {"flow": "CausalMaskedDiffWithDiT", "hift": "CausalHiFTGenerator"}  # what a cosyvoice3 yaml must name


def read_cosyvoice(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a CosyVoice-300M ``cfg``: its yaml has no token_frame_rate entry (the flow's rate)."""
    cfg.lm = TransformerLMConfig.from_yaml(data["llm"])
    cfg.flow = FlowV1Config.from_yaml(data["flow"])
    cfg.token_frame_rate = cfg.flow.input_frame_rate
    cfg.hift = HiFTConfig.from_yaml(data["hift"])


def read_cosyvoice2(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a CosyVoice2 ``cfg`` (the LM's Qwen2 backbone from ``CosyVoice-BlankEN/config.json``)."""
    cfg.lm = LMConfig.from_yaml(data["llm"], Qwen2Config.from_json(cfg.blank_en_dir / "config.json"))
    cfg.flow = FlowConfig.from_yaml(data["flow"])
    cfg.hift = HiFTConfig.from_yaml(data["hift"])


def read_cosyvoice3(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a Fun-CosyVoice3 ``cfg``: the LM, flow and HiFT configs (a yaml mixing families is refused)."""
    for key, expected in V3_CLASSES.items():
        node = data.get(key)
        if not isinstance(node, Tagged) or node.class_name != expected:
            found = node.target if isinstance(node, Tagged) else node
            raise ModelDirError(
                f"{yaml_path} is a cosyvoice3 model (CosyVoice3LM) but its '{key}' entry is {found}, not "
                f"{expected}: the yaml mixes model families; use the cosyvoice3.yaml of the same download"
            )
    cfg.lm = CosyVoice3LMConfig.from_yaml(data["llm"], Qwen2Config.from_json(cfg.blank_en_dir / "config.json"))
    cfg.flow = FlowV3Config.from_yaml(data["flow"])
    cfg.hift = CausalHiFTConfig.from_yaml(data["hift"])


# CosyVoice-300M: TransformerLM, MaskedDiffWithXvec, the 22.05 kHz HiFT (n_fft/win 1024)
COSYVOICE = FamilyLoader(
    facts("cosyvoice"), "TransformerLM", {"n_fft": 1024, "win_size": 1024}, read_cosyvoice, TransformerLM, FlowV1, HiFT
)
# CosyVoice2-0.5B: Qwen2LM, CausalMaskedDiffWithXvec, HiFT
COSYVOICE2 = FamilyLoader(facts("cosyvoice2"), "Qwen2LM", {}, read_cosyvoice2, Qwen2LM, Flow, HiFT)
# Fun-CosyVoice3-0.5B: CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator; mel fmax null (Nyquist)
COSYVOICE3 = FamilyLoader(
    facts("cosyvoice3"), "CosyVoice3LM", {"fmax": None}, read_cosyvoice3, CosyVoice3LM, FlowV3, CausalHiFT
)
