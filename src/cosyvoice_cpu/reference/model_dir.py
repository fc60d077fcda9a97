"""A CosyVoice model directory as released, read into the PyTorch reference by a family's :class:`FamilyLoader`.

The yaml is read as data (see :mod:`cosyvoice_cpu.reference.yamlconf`); nothing in it is executed. Checkpoints are
loaded with ``weights_only=True`` and every module with ``strict=True`` (:mod:`.checkpoint`). Each family's loader
(:mod:`.loaders`) says which LM class its yaml names, its released ``feat_extractor`` values, how its stage
configs are read and which module classes it builds. Which family a directory holds is told by
:func:`cosyvoice_cpu.workshop.parts.detect_family` from the yaml's *content* (older CosyVoice2-0.5B downloads ship
``cosyvoice.yaml``); :func:`cosyvoice_cpu.workshop.parts.load_reference` detects and loads in one call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.reference.checkpoint import SPK2INFO, load_checkpoint, load_strict
from cosyvoice_cpu.reference.yamlconf import Tagged, load_yaml_data

logger = logging.getLogger(__name__)

YAML_NAMES = ("cosyvoice3.yaml", "cosyvoice2.yaml", "cosyvoice.yaml")
STAGES = ("lm", "flow", "hift")


@dataclass
class MelConfig:
    """The yaml's ``feat_extractor`` (matcha ``mel_spectrogram``): the prompt-mel / flow-target features."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0

    @classmethod
    def from_yaml(cls, node: Any, defaults: MelConfig | None = None) -> MelConfig:
        """Read ``feat_extractor``; missing keys take ``defaults``, the family's released values (v1: 22.05 kHz,
        hop 256; v3: ``fmax=None``, i.e. Nyquist; see :attr:`FamilyLoader.mel`)."""
        d = replace(defaults) if defaults is not None else cls()
        if not isinstance(node, Tagged):
            return d
        fmax = node.get("fmax", d.fmax)
        return cls(
            n_fft=int(node.get("n_fft", d.n_fft)),
            num_mels=int(node.get("num_mels", d.num_mels)),
            sampling_rate=int(node.get("sampling_rate", d.sampling_rate)),
            hop_size=int(node.get("hop_size", d.hop_size)),
            win_size=int(node.get("win_size", d.win_size)),
            fmin=float(node.get("fmin", d.fmin)),
            fmax=None if fmax is None else float(fmax),
        )


@dataclass
class ModelConfig:
    """Everything the reference needs to know about a model directory."""

    model_dir: Path
    yaml_path: Path
    family: str
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int  # mel frames per token (v2/v3: 2); 0 for v1, whose length regulator interpolates
    mel: MelConfig
    lm: Any = None  # the family's LM config (reference/lm/<family>.py)
    flow: Any = None  # the family's flow config (reference/flow/<family>.py)
    hift: Any = None  # the family's vocoder config (reference/hift/)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def blank_en_dir(self) -> Path:
        return self.model_dir / "CosyVoice-BlankEN"

    @property
    def speech_tokenizer_path(self) -> Path:
        return self.model_dir / facts(self.family).speech_tokenizer

    @property
    def spk2info_path(self) -> Path:
        return self.model_dir / SPK2INFO


def find_yaml(model_dir: Path) -> Path:
    """The model yaml of a directory (``cosyvoice3.yaml``, ``cosyvoice2.yaml`` or ``cosyvoice.yaml``)."""
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory {model_dir} does not exist or is not a directory")
    for name in YAML_NAMES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise ModelDirError(
        f"{model_dir} holds none of {', '.join(YAML_NAMES)}: point at a released CosyVoice model directory "
        "(e.g. CosyVoice2-0.5B) or make one with `cosyvoice-cpu fixture`"
    )


def read_yaml(model_dir: Path) -> tuple[Path, dict[str, Any]]:
    """(the yaml's path, its data): ``qwen_pretrain_path`` resolved to the directory's ``CosyVoice-BlankEN``."""
    yaml_path = find_yaml(model_dir)
    return yaml_path, load_yaml_data(yaml_path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})


def lm_class(data: dict[str, Any], where: Path) -> str:
    """The class name of the yaml's ``llm`` entry (what tells the family)."""
    llm = data.get("llm")
    if not isinstance(llm, Tagged):
        raise ModelDirError(f"{where} has no 'llm: !new:...' entry; is it a CosyVoice model yaml?")
    return llm.class_name


@dataclass
class ReferenceModel:
    """The three stages of a model directory as PyTorch modules (eval mode, fp32)."""

    config: ModelConfig
    lm: Any
    flow: Any
    hift: Any


@dataclass(frozen=True)
class FamilyLoader:
    """How the reference reads one family's directory.

    Attributes:
        facts: the family's row of :mod:`cosyvoice_cpu.facts`.
        lm_class: the class its yaml's ``llm`` entry names (``TransformerLM``, ``Qwen2LM``, ``CosyVoice3LM``).
        mel: its released ``feat_extractor`` values beyond the facts' rate and hop.
        read: fills the stage configs of a :class:`ModelConfig` from the parsed yaml (``(cfg, data, yaml_path)``).
        lm, flow, hift: the module classes, each built from its stage config.
    """

    facts: FamilyFacts
    lm_class: str
    mel: dict[str, Any]
    read: Callable[[ModelConfig, dict[str, Any], Path], None]
    lm: type
    flow: type
    hift: type

    def config(self, model_dir: str | Path) -> ModelConfig:
        """Parse a directory of this family: defaults the yaml leaves out come from the facts, the stage configs
        are read by :attr:`read`. Raises :class:`ModelDirError` when the yaml names another family's LM."""
        model_dir = Path(model_dir)
        yaml_path, data = read_yaml(model_dir)
        if (found := lm_class(data, yaml_path)) != self.lm_class:
            raise ModelDirError(f"{yaml_path} names {found}, not {self.lm_class}: it is not a {self.facts.name} model")
        f = self.facts
        cfg = ModelConfig(
            model_dir=model_dir,
            yaml_path=yaml_path,
            family=f.name,
            sample_rate=int(data.get("sample_rate", f.sample_rate)),
            token_frame_rate=int(data.get("token_frame_rate", f.token_rate)),
            token_mel_ratio=0 if f.mel_per_token is None else int(data.get("token_mel_ratio", f.mel_per_token)),
            mel=MelConfig.from_yaml(
                data.get("feat_extractor"), MelConfig(sampling_rate=f.sample_rate, hop_size=f.mel_hop, **self.mel)
            ),
            raw=data,
        )
        try:
            self.read(cfg, data, yaml_path)
        except (KeyError, ValueError) as e:
            raise ModelDirError(f"{yaml_path}: {e}") from e
        return cfg

    def build(self, cfg: ModelConfig, stages: tuple[str, ...] = STAGES) -> ReferenceModel:
        """The modules of ``stages`` built from ``cfg``, freshly (randomly) initialised, in eval mode."""
        return ReferenceModel(
            cfg,
            self.lm(cfg.lm).eval() if "lm" in stages else None,
            self.flow(cfg.flow).eval() if "flow" in stages else None,
            self.hift(cfg.hift).eval() if "hift" in stages else None,
        )

    def load(self, model_dir: str | Path, stages: tuple[str, ...] = STAGES) -> ReferenceModel:
        """Build the modules of ``stages`` and load the directory's checkpoints into them strictly."""
        cfg = self.config(model_dir)
        out = ReferenceModel(cfg, None, None, None)  # each stage loaded before the next is built: one random copy
        if "lm" in stages:
            out.lm = self.lm(cfg.lm).eval()
            path = cfg.model_dir / "llm.pt"
            load_strict(out.lm, load_checkpoint(path), path, cfg)
        if "flow" in stages:
            out.flow = self.flow(cfg.flow).eval()
            path = cfg.model_dir / "flow.pt"
            load_strict(out.flow, load_checkpoint(path), path, cfg)
        if "hift" in stages:
            out.hift = self.hift(cfg.hift).eval()
            path = cfg.model_dir / "hift.pt"
            try:
                out.hift.load_checkpoint_state(load_checkpoint(path))
            except (KeyError, ValueError, RuntimeError) as e:
                raise ModelDirError(f"{path} does not match the HiFT in the yaml: {e}") from e
        logger.info("loaded %s reference from %s (%s)", cfg.family, cfg.model_dir, ", ".join(stages))
        return out
