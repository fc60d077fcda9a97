"""Released checkpoints read safely: ``torch.load(weights_only=True, mmap=True)``, strict loading with a message
naming the file that disagrees, and the built-in speakers of ``spk2info.pt``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ModelDirError

logger = logging.getLogger(__name__)

SPK2INFO = "spk2info.pt"  # built-in speakers (CosyVoice-300M-SFT/-Instruct)


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


def _mismatches(module: Any, state: dict[str, Any], path: Path, cfg: Any) -> tuple[str, str]:
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


def load_strict(module: Any, state: dict[str, Any], path: Path, cfg: Any = None) -> None:
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
