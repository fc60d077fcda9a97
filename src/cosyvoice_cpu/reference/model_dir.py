"""Load a CosyVoice model directory exactly as released, into the PyTorch reference.

The family is told from the yaml's *content* (which LM/flow/vocoder classes it names), not from its file name:
older CosyVoice2-0.5B downloads ship ``cosyvoice.yaml``. The yaml is read as data (see
:mod:`cosyvoice_cpu.reference.yamlconf`); nothing in it is executed. Checkpoints are loaded with
``weights_only=True`` and every module with ``strict=True``.

Families: ``cosyvoice`` (v1, CosyVoice-300M: TransformerLM, MaskedDiffWithXvec, 22.05 kHz HiFT),
``cosyvoice2`` (v2, CosyVoice2-0.5B: Qwen2LM, CausalMaskedDiffWithXvec, HiFT) and ``cosyvoice3`` (v3,
Fun-CosyVoice3-0.5B: CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator; mel fmax null,
``speech_tokenizer_v3.onnx``). v3's flow and vocoder live in ``flow_v3.py``/``hift_v3.py``, imported lazily
(:func:`v3_stage_classes`): without them a v3 directory still loads its LM (``stages=("lm",)``).
v1 SFT/Instruct directories also ship ``spk2info.pt`` (built-in speakers' x-vectors): :func:`load_speakers`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.reference.yamlconf import Tagged, load_yaml_data

logger = logging.getLogger(__name__)

YAML_NAMES = ("cosyvoice3.yaml", "cosyvoice2.yaml", "cosyvoice.yaml")
LM_CLASSES = {"TransformerLM": "cosyvoice", "Qwen2LM": "cosyvoice2", "CosyVoice3LM": "cosyvoice3"}
SPEECH_TOKENIZER = {"cosyvoice": "speech_tokenizer_v1.onnx", "cosyvoice2": "speech_tokenizer_v2.onnx",
                    "cosyvoice3": "speech_tokenizer_v3.onnx"}  # fmt: skip
SUPPORTED = ("cosyvoice", "cosyvoice2", "cosyvoice3")
V3_CLASSES = {"flow": "CausalMaskedDiffWithDiT", "hift": "CausalHiFTGenerator"}  # what a cosyvoice3 yaml must name
SPK2INFO = "spk2info.pt"  # built-in speakers (CosyVoice-300M-SFT/-Instruct)


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
    def from_yaml(cls, node: Any, v1: bool = False, fmax_default: float | None = 8000.0) -> MelConfig:
        """Read ``feat_extractor``; missing keys take the family's released values (v1: 22.05 kHz, hop 256;
        v3: ``fmax_default=None``, i.e. Nyquist)."""
        d = cls(n_fft=1024, sampling_rate=22050, hop_size=256, win_size=1024) if v1 else cls(fmax=fmax_default)
        if not isinstance(node, Tagged):
            return d
        fmax = node.get("fmax", fmax_default)
        return cls(
            n_fft=int(node.get("n_fft", d.n_fft)),
            num_mels=int(node.get("num_mels", 80)),
            sampling_rate=int(node.get("sampling_rate", d.sampling_rate)),
            hop_size=int(node.get("hop_size", d.hop_size)),
            win_size=int(node.get("win_size", d.win_size)),
            fmin=float(node.get("fmin", 0)),
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
    lm: Any = None  # LMConfig (v2) | TransformerLMConfig (v1) | CosyVoice3LMConfig (v3)
    flow: Any = None  # FlowConfig (v2) | FlowV1Config (v1) | FlowV3Config (v3; None while flow_v3.py is absent)
    hift: Any = None  # HiFTConfig | CausalHiFTConfig (v3; None while hift_v3.py is absent)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def blank_en_dir(self) -> Path:
        return self.model_dir / "CosyVoice-BlankEN"

    @property
    def speech_tokenizer_path(self) -> Path:
        return self.model_dir / SPEECH_TOKENIZER[self.family]

    @property
    def spk2info_path(self) -> Path:
        return self.model_dir / SPK2INFO


def family_of(data: dict[str, Any], where: Path) -> str:
    """Tell the family from the classes a parsed yaml names."""
    llm = data.get("llm")
    if not isinstance(llm, Tagged):
        raise ModelDirError(f"{where} has no 'llm: !new:...' entry; is it a CosyVoice model yaml?")
    family = LM_CLASSES.get(llm.class_name)
    if family is None:
        raise ModelDirError(
            f"{where}: unknown LM class {llm.target}; expected one of {sorted(LM_CLASSES)} "
            "(CosyVoice-300M, CosyVoice2-0.5B or Fun-CosyVoice3-0.5B)"
        )
    return family


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


def detect_family(model_dir: str | Path) -> str:
    """The family of a model directory, from its yaml's content only (no other file is read or checked)."""
    yaml_path = find_yaml(Path(model_dir))
    return family_of(load_yaml_data(yaml_path), yaml_path)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse a model directory's yaml (and, for v2/v3, ``CosyVoice-BlankEN/config.json``)."""
    from cosyvoice_cpu.reference.flow import FlowConfig
    from cosyvoice_cpu.reference.flow_v1 import FlowV1Config
    from cosyvoice_cpu.reference.hift import HiFTConfig
    from cosyvoice_cpu.reference.lm import LMConfig
    from cosyvoice_cpu.reference.lm_v1 import TransformerLMConfig
    from cosyvoice_cpu.reference.qwen2 import Qwen2Config

    model_dir = Path(model_dir)
    yaml_path = find_yaml(model_dir)
    data = load_yaml_data(yaml_path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    family = family_of(data, yaml_path)
    v1 = family == "cosyvoice"
    cfg = ModelConfig(
        model_dir=model_dir,
        yaml_path=yaml_path,
        family=family,
        sample_rate=int(data.get("sample_rate", 22050 if v1 else 24000)),
        token_frame_rate=int(data.get("token_frame_rate", 50 if v1 else 25)),
        token_mel_ratio=0 if v1 else int(data.get("token_mel_ratio", 2)),
        mel=MelConfig.from_yaml(data.get("feat_extractor"), v1, None if family == "cosyvoice3" else 8000.0),
        raw=data,
    )
    if family not in SUPPORTED:
        raise ModelDirError(
            f"{model_dir} is a {family} model; the reference implements {', '.join(SUPPORTED)} so far "
            "(Fun-CosyVoice3 support is tracked as its own issue)"
        )
    if family == "cosyvoice3":
        _read_v3(cfg, data, yaml_path)
        return cfg
    try:
        if v1:
            cfg.lm = TransformerLMConfig.from_yaml(data["llm"])
            cfg.flow = FlowV1Config.from_yaml(data["flow"])
            cfg.token_frame_rate = cfg.flow.input_frame_rate  # v1 yamls have no token_frame_rate entry
        else:
            cfg.lm = LMConfig.from_yaml(data["llm"], Qwen2Config.from_json(cfg.blank_en_dir / "config.json"))
            cfg.flow = FlowConfig.from_yaml(data["flow"])
        cfg.hift = HiFTConfig.from_yaml(data["hift"])
    except (KeyError, ValueError) as e:
        raise ModelDirError(f"{yaml_path}: {e}") from e
    return cfg


def v3_stage_classes() -> tuple[Any, Any]:
    """(FlowV3, CausalHiFT): the v3 flow and vocoder modules, imported lazily."""
    try:
        from cosyvoice_cpu.reference.flow_v3 import FlowV3
        from cosyvoice_cpu.reference.hift_v3 import CausalHiFT
    except ImportError as e:
        raise ModelDirError(
            f"the CosyVoice3 flow/vocoder reference is not available ({e}): reference/flow_v3.py and "
            "reference/hift_v3.py are needed; load the LM alone with load_reference(dir, stages=('lm',))"
        ) from e
    return FlowV3, CausalHiFT


def _read_v3(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a cosyvoice3 ``cfg`` (LM always; flow/HiFT configs when their modules are installed)."""
    from cosyvoice_cpu.reference.lm_v3 import CosyVoice3LMConfig
    from cosyvoice_cpu.reference.qwen2 import Qwen2Config

    for key, expected in V3_CLASSES.items():
        node = data.get(key)
        if not isinstance(node, Tagged) or node.class_name != expected:
            found = node.target if isinstance(node, Tagged) else node
            raise ModelDirError(
                f"{yaml_path} is a cosyvoice3 model (CosyVoice3LM) but its '{key}' entry is {found}, not "
                f"{expected}: the yaml mixes model families; use the cosyvoice3.yaml of the same download"
            )
    try:
        cfg.lm = CosyVoice3LMConfig.from_yaml(data["llm"], Qwen2Config.from_json(cfg.blank_en_dir / "config.json"))
        try:
            from cosyvoice_cpu.reference.flow_v3 import FlowV3Config
            from cosyvoice_cpu.reference.hift_v3 import CausalHiFTConfig
        except ImportError as e:
            logger.warning("%s: v3 flow/HiFT reference modules missing (%s); only the LM can be loaded", yaml_path, e)
            return
        cfg.flow = FlowV3Config.from_yaml(data["flow"])
        cfg.hift = CausalHiFTConfig.from_yaml(data["hift"])
    except (KeyError, ValueError) as e:
        raise ModelDirError(f"{yaml_path}: {e}") from e


def load_checkpoint(path: Path) -> dict[str, Any]:
    """``torch.load`` a released ``*.pt`` state dict safely (``weights_only``, memory-mapped)."""
    import torch

    if not path.is_file():
        raise ModelDirError(f"{path} is missing: the model directory is incomplete; re-download it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ModelDirError(f"{path} is not a readable PyTorch checkpoint ({e}); re-download it") from e
    if not isinstance(state, dict):
        raise ModelDirError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def load_strict(module: Any, state: dict[str, Any], path: Path) -> None:
    """``module.load_state_dict(state, strict=True)`` with a message that names the file.

    ``assign=True`` keeps the (memory-mapped) checkpoint tensors instead of copying them into the freshly
    initialised parameters, so the weights are not resident twice.
    """
    try:
        module.load_state_dict(state, strict=True, assign=True)
        module.float()  # a no-op for fp32 checkpoints; a half-precision one is upcast, the reference is fp32
    except RuntimeError as e:
        raise ModelDirError(
            f"{path} does not match the architecture in the yaml ({str(e).splitlines()[0]} ...): "
            "the checkpoint and the yaml come from different models"
        ) from e


@dataclass
class ReferenceModel:
    """The three stages of a model directory as PyTorch modules (eval mode, fp32)."""

    config: ModelConfig
    lm: Any
    flow: Any
    hift: Any


def load_reference(model_dir: str | Path, stages: tuple[str, ...] = ("lm", "flow", "hift")) -> ReferenceModel:
    """Build the reference modules of a model directory and load its checkpoints strictly.

    Args:
        model_dir: a released (or fixture) CosyVoice-300M, CosyVoice2 or Fun-CosyVoice3 directory.
        stages: which of ``lm``, ``flow``, ``hift`` to load (others stay None).
    """
    from cosyvoice_cpu.reference.flow import Flow
    from cosyvoice_cpu.reference.flow_v1 import FlowV1
    from cosyvoice_cpu.reference.hift import HiFT
    from cosyvoice_cpu.reference.lm import Qwen2LM
    from cosyvoice_cpu.reference.lm_v1 import TransformerLM

    cfg = read_model_config(model_dir)
    v1, v3 = cfg.family == "cosyvoice", cfg.family == "cosyvoice3"
    flow_cls, hift_cls = (FlowV1 if v1 else Flow), HiFT
    if v3 and ("flow" in stages or "hift" in stages):
        flow_cls, hift_cls = v3_stage_classes()
    out = ReferenceModel(cfg, None, None, None)
    if "lm" in stages:
        if v3:
            from cosyvoice_cpu.reference.lm_v3 import CosyVoice3LM

            out.lm = CosyVoice3LM(cfg.lm).eval()
        else:
            out.lm = (TransformerLM(cfg.lm) if v1 else Qwen2LM(cfg.lm)).eval()
        path = cfg.model_dir / "llm.pt"
        load_strict(out.lm, load_checkpoint(path), path)
    if "flow" in stages:
        out.flow = flow_cls(cfg.flow).eval()
        path = cfg.model_dir / "flow.pt"
        load_strict(out.flow, load_checkpoint(path), path)
    if "hift" in stages:
        out.hift = hift_cls(cfg.hift).eval()
        path = cfg.model_dir / "hift.pt"
        try:
            out.hift.load_checkpoint_state(load_checkpoint(path))
        except (KeyError, ValueError, RuntimeError) as e:
            raise ModelDirError(f"{path} does not match the HiFT in the yaml: {e}") from e
    logger.info("loaded %s reference from %s (%s)", cfg.family, cfg.model_dir, ", ".join(stages))
    return out


def load_speakers(model_dir: str | Path) -> dict[str, Any]:
    """The built-in speakers of a CosyVoice-300M-SFT/-Instruct directory: ``spk2info.pt`` as ``{name: (1, 192)}``.

    The file maps a speaker id (e.g. ``中文女``) to a dict whose ``embedding`` (1, 192) x-vector the official
    ``inference_sft``/``inference_instruct`` feed to the LM and the flow; other entries (zero-shot speakers saved
    by ``save_spkinfo`` also hold prompt tokens and mel) are not returned. A directory without the file (base
    models, every CosyVoice2/3) has no built-in speakers: ``{}``.

    Raises:
        ModelDirError: the file is unreadable or not a mapping of speakers with 192-d embeddings.
    """
    import torch

    path = Path(model_dir) / SPK2INFO
    if not path.is_file():
        return {}
    try:
        info = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelDirError(f"{path} is not a readable PyTorch file ({e}); re-download it") from e
    if not isinstance(info, dict):
        raise ModelDirError(f"{path} holds a {type(info).__name__}, not a dict of speakers")
    speakers: dict[str, Any] = {}
    for name, entry in info.items():
        emb = entry.get("embedding") if isinstance(entry, dict) else None
        if not isinstance(emb, torch.Tensor) or emb.numel() != 192:
            raise ModelDirError(f"{path}: speaker {name!r} has no 192-d 'embedding' tensor")
        speakers[str(name)] = emb.detach().float().reshape(1, 192)
    logger.debug("%s: %d built-in speakers", path, len(speakers))
    return speakers
