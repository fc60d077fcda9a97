"""Load a CosyVoice model directory exactly as released, into the PyTorch reference.

The family is told from the yaml's *content* (which LM/flow/vocoder classes it names), not from its file name:
older CosyVoice2-0.5B downloads ship ``cosyvoice.yaml``. The yaml is read as data (see
:mod:`cosyvoice_cpu.reference.yamlconf`); nothing in it is executed. Checkpoints are loaded with
``weights_only=True`` and every module with ``strict=True``.

Families (:mod:`cosyvoice_cpu.facts`; how each is read: :data:`LOADERS`): ``cosyvoice`` (v1,
CosyVoice-300M: TransformerLM, MaskedDiffWithXvec, 22.05 kHz HiFT), ``cosyvoice2`` (v2, CosyVoice2-0.5B: Qwen2LM,
CausalMaskedDiffWithXvec, HiFT) and ``cosyvoice3`` (v3, Fun-CosyVoice3-0.5B: CosyVoice3LM, CausalMaskedDiffWithDiT,
CausalHiFTGenerator; mel fmax null). v3's flow and vocoder are imported lazily (:func:`v3_stage_classes`): without
them a v3 directory still loads its LM (``stages=("lm",)``).
v1 SFT/Instruct directories also ship ``spk2info.pt`` (built-in speakers' x-vectors): :func:`load_speakers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.reference.yamlconf import Tagged, load_yaml_data

logger = logging.getLogger(__name__)

YAML_NAMES = ("cosyvoice3.yaml", "cosyvoice2.yaml", "cosyvoice.yaml")
LM_CLASSES = {"TransformerLM": "cosyvoice", "Qwen2LM": "cosyvoice2", "CosyVoice3LM": "cosyvoice3"}
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
    def from_yaml(cls, node: Any, defaults: MelConfig | None = None) -> MelConfig:
        """Read ``feat_extractor``; missing keys take ``defaults``, the family's released values (v1: 22.05 kHz,
        hop 256; v3: ``fmax=None``, i.e. Nyquist; see :data:`LOADERS`)."""
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
    lm: Any = None  # LMConfig (v2) | TransformerLMConfig (v1) | CosyVoice3LMConfig (v3)
    flow: Any = None  # FlowConfig (v2) | FlowV1Config (v1) | FlowV3Config (v3; None while flow_v3.py is absent)
    hift: Any = None  # HiFTConfig | CausalHiFTConfig (v3; None while hift_v3.py is absent)
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
    """Parse a model directory's yaml (and, for v2/v3, ``CosyVoice-BlankEN/config.json``): defaults the yaml
    leaves out come from the family's facts, the stage configs are read by the family's :data:`LOADERS` entry."""
    model_dir = Path(model_dir)
    yaml_path = find_yaml(model_dir)
    data = load_yaml_data(yaml_path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    family = family_of(data, yaml_path)
    f, loader = facts(family), LOADERS[family]  # facts(): a ModelDirError naming the supported families
    mel_defaults = MelConfig(sampling_rate=f.sample_rate, hop_size=f.mel_hop, **loader.mel)
    cfg = ModelConfig(
        model_dir=model_dir,
        yaml_path=yaml_path,
        family=family,
        sample_rate=int(data.get("sample_rate", f.sample_rate)),
        token_frame_rate=int(data.get("token_frame_rate", f.token_rate)),
        token_mel_ratio=0 if f.mel_per_token is None else int(data.get("token_mel_ratio", f.mel_per_token)),
        mel=MelConfig.from_yaml(data.get("feat_extractor"), mel_defaults),
        raw=data,
    )
    try:
        loader.read(cfg, data, yaml_path)
    except (KeyError, ValueError) as e:
        raise ModelDirError(f"{yaml_path}: {e}") from e
    return cfg


def _read_v1(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a cosyvoice (CosyVoice-300M) ``cfg``: its yaml has no token_frame_rate entry (the flow's rate)."""
    from cosyvoice_cpu.reference.flow.cosyvoice import FlowV1Config
    from cosyvoice_cpu.reference.hift.cosyvoice import HiFTConfig
    from cosyvoice_cpu.reference.lm.cosyvoice import TransformerLMConfig

    cfg.lm = TransformerLMConfig.from_yaml(data["llm"])
    cfg.flow = FlowV1Config.from_yaml(data["flow"])
    cfg.token_frame_rate = cfg.flow.input_frame_rate
    cfg.hift = HiFTConfig.from_yaml(data["hift"])


def _read_v2(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a cosyvoice2 ``cfg`` (the LM's Qwen2 backbone from ``CosyVoice-BlankEN/config.json``)."""
    from cosyvoice_cpu.reference.flow.cosyvoice2 import FlowConfig
    from cosyvoice_cpu.reference.hift.cosyvoice import HiFTConfig
    from cosyvoice_cpu.reference.lm.cosyvoice2 import LMConfig
    from cosyvoice_cpu.reference.lm.qwen2 import Qwen2Config

    cfg.lm = LMConfig.from_yaml(data["llm"], Qwen2Config.from_json(cfg.blank_en_dir / "config.json"))
    cfg.flow = FlowConfig.from_yaml(data["flow"])
    cfg.hift = HiFTConfig.from_yaml(data["hift"])


def v3_stage_classes() -> tuple[Any, Any]:
    """(FlowV3, CausalHiFT): the v3 flow and vocoder modules, imported when called."""
    from cosyvoice_cpu.reference.flow.cosyvoice3 import FlowV3
    from cosyvoice_cpu.reference.hift.cosyvoice3 import CausalHiFT

    return FlowV3, CausalHiFT


def _read_v3(cfg: ModelConfig, data: dict[str, Any], yaml_path: Path) -> None:
    """Fill a cosyvoice3 ``cfg``: the LM, flow and HiFT configs."""
    from cosyvoice_cpu.reference.flow.cosyvoice3 import FlowV3Config
    from cosyvoice_cpu.reference.hift.cosyvoice3 import CausalHiFTConfig
    from cosyvoice_cpu.reference.lm.cosyvoice3 import CosyVoice3LMConfig
    from cosyvoice_cpu.reference.lm.qwen2 import Qwen2Config

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


def _classes_v1(stages: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """(TransformerLM, FlowV1, HiFT): CosyVoice-300M's reference classes, imported when called."""
    from cosyvoice_cpu.reference.flow.cosyvoice import FlowV1
    from cosyvoice_cpu.reference.hift.cosyvoice import HiFT
    from cosyvoice_cpu.reference.lm.cosyvoice import TransformerLM

    return TransformerLM, FlowV1, HiFT


def _classes_v2(stages: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """(Qwen2LM, Flow, HiFT): CosyVoice2's reference classes, imported when called."""
    from cosyvoice_cpu.reference.flow.cosyvoice2 import Flow
    from cosyvoice_cpu.reference.hift.cosyvoice import HiFT
    from cosyvoice_cpu.reference.lm.cosyvoice2 import Qwen2LM

    return Qwen2LM, Flow, HiFT


def _classes_v3(stages: tuple[str, ...]) -> tuple[Any, Any, Any]:
    """(CosyVoice3LM, FlowV3, CausalHiFT); the flow/vocoder only when asked for (the LM loads without them)."""
    from cosyvoice_cpu.reference.lm.cosyvoice3 import CosyVoice3LM

    flow_cls, hift_cls = v3_stage_classes() if ("flow" in stages or "hift" in stages) else (None, None)
    return CosyVoice3LM, flow_cls, hift_cls


class FamilyLoader(NamedTuple):
    """How the reference reads one family: its released ``feat_extractor`` values beyond the facts' rate and hop,
    the stage-config reader, and the module classes ``(lm, flow, hift)`` for the stages asked for."""

    mel: dict[str, Any]
    read: Callable[[ModelConfig, dict[str, Any], Path], None]
    classes: Callable[[tuple[str, ...]], tuple[Any, ...]]


# One loader per family of the facts table, keyed by its name.
LOADERS: dict[str, FamilyLoader] = {
    "cosyvoice": FamilyLoader({"n_fft": 1024, "win_size": 1024}, _read_v1, _classes_v1),
    "cosyvoice2": FamilyLoader({}, _read_v2, _classes_v2),
    "cosyvoice3": FamilyLoader({"fmax": None}, _read_v3, _classes_v3),
}


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


def _mismatches(module: Any, state: dict[str, Any], path: Path, cfg: ModelConfig | None) -> tuple[str, str]:
    """(what the module was built from, the first differences between its state dict and the checkpoint's).

    Each size is attributed to the file that declares it: the Qwen2 backbone's (layer count, hidden and MLP
    sizes, vocabulary) to ``CosyVoice-BlankEN/config.json``, everything else to the yaml.
    """
    import re

    from cosyvoice_cpu.reference.lm.qwen2 import Qwen2Model

    yaml_name = cfg.yaml_path.name if cfg is not None else "the yaml"
    qwen = tuple(f"{n}." for n, m in module.named_modules() if isinstance(m, Qwen2Model))
    blank = "CosyVoice-BlankEN/config.json"
    sources = f"{yaml_name} and {blank}" if qwen else yaml_name

    def declared(key: str) -> str:
        return blank if key.startswith(qwen) else yaml_name

    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    have = {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}

    def lengths(keys: Any) -> dict[str, int]:  # "a.layers.3.w" -> {"a.layers": 4}: module lists and their lengths
        n: dict[str, int] = {}
        for key in keys:
            for m in re.finditer(r"\.(\d+)(?=\.)", key):
                n[key[: m.start()]] = max(n.get(key[: m.start()], 0), int(m.group(1)) + 1)
        return n

    want_n, have_n = lengths(want), lengths(have)
    lists = [
        f"{k}: {have_n[k]} in {path.name}, {want_n[k]} per {declared(k + '.')}"
        f"{' (num_hidden_layers)' if declared(k + '.') == blank and k.endswith('.layers') else ''}"
        for k in want_n
        if k in have_n and want_n[k] != have_n[k]
    ]
    shapes = [
        f"{k}: {list(have[k])} in {path.name}, {list(want[k])} per {declared(k)}"
        for k in want
        if k in have and want[k] != have[k]
    ]
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in want]
    parts = [
        f"{len(lists)} module lists differ in length ({'; '.join(lists[:3])})" if lists else "",
        f"{len(shapes)} tensors differ in shape ({'; '.join(shapes[:3])})" if shapes else "",
        f"{len(missing)} keys are missing from {path.name} ({', '.join(missing[:3])})" if missing else "",
        f"{len(unexpected)} keys in {path.name} are not in the model ({', '.join(unexpected[:3])})"
        if unexpected
        else "",
    ]
    return sources, "; ".join(p for p in parts if p)


def load_strict(module: Any, state: dict[str, Any], path: Path, cfg: ModelConfig | None = None) -> None:
    """``module.load_state_dict(state, strict=True)`` with a message that names the file.

    ``assign=True`` keeps the (memory-mapped) checkpoint tensors instead of copying them into the freshly
    initialised parameters, so the weights are not resident twice. On a mismatch the error names the first
    differing keys and shapes and which file (``cfg``'s yaml or ``CosyVoice-BlankEN/config.json``) declares
    each expected size.
    """
    try:
        module.load_state_dict(state, strict=True, assign=True)
        module.float()  # a no-op for fp32 checkpoints; a half-precision one is upcast, the reference is fp32
    except RuntimeError as e:
        sources, details = _mismatches(module, state, path, cfg)
        raise ModelDirError(
            f"{path} does not match the architecture built from {sources}: "
            f"{details or ' '.join(str(e).split())}; the checkpoint and these files come from different models "
            f"(re-download the directory, or use the {sources} that came with {path.name})"
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
    cfg = read_model_config(model_dir)
    lm_cls, flow_cls, hift_cls = LOADERS[cfg.family].classes(stages)
    out = ReferenceModel(cfg, None, None, None)
    if "lm" in stages:
        out.lm = lm_cls(cfg.lm).eval()
        path = cfg.model_dir / "llm.pt"
        load_strict(out.lm, load_checkpoint(path), path, cfg)
    if "flow" in stages:
        out.flow = flow_cls(cfg.flow).eval()
        path = cfg.model_dir / "flow.pt"
        load_strict(out.flow, load_checkpoint(path), path, cfg)
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
