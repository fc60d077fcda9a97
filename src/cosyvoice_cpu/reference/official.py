"""Build the official CosyVoice models (``token2wav-cosyvoice==0.1.0``) from a model directory, for parity checks
and the PyTorch peer in the benchmark.

The official modules import ``torchaudio`` at module level for audio I/O only; no torchaudio wheel matches the
CPU torch used here, so :func:`install_torchaudio_stub` puts a stub module in its place (nothing on the model path
calls it). Needs torch, HyperPyYAML and the official package (``scripts/install.sh --dev`` installs them).
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import sys
import types
from pathlib import Path

import torch

from cosyvoice_cpu.errors import MissingExtraError

logger = logging.getLogger(__name__)

OFFICIAL_HINT = "pip install token2wav-cosyvoice==0.1.0 hyperpyyaml (or scripts/install.sh --dev)"


def install_torchaudio_stub() -> None:
    """Put a stub ``torchaudio`` in ``sys.modules`` unless a real one imports cleanly."""
    if "torchaudio" in sys.modules:
        return
    try:  # a real torchaudio that imports cleanly is fine too
        import torchaudio  # noqa: F401

        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            del sys.modules[name]

    def _unavailable(*_a, **_k):
        raise RuntimeError("torchaudio stub: audio I/O is not available beside the official CosyVoice code here")

    ta = types.ModuleType("torchaudio")
    ta.load = _unavailable
    ta.save = _unavailable
    ta.__path__ = []  # a package, so submodules import
    compliance = types.ModuleType("torchaudio.compliance")
    compliance.__path__ = []
    kaldi = types.ModuleType("torchaudio.compliance.kaldi")
    kaldi.fbank = _unavailable
    transforms = types.ModuleType("torchaudio.transforms")

    class _Transform(torch.nn.Module):
        """Constructible (the GAN discriminator builds a Spectrogram), unusable."""

        def __init__(self, *_a, **_k) -> None:
            super().__init__()

        def forward(self, *_a, **_k):
            _unavailable()

    transforms.Resample = transforms.Spectrogram = _Transform
    functional = types.ModuleType("torchaudio.functional")
    ta.compliance, compliance.kaldi, ta.transforms, ta.functional = compliance, kaldi, transforms, functional
    modules = {
        "torchaudio": ta,
        "torchaudio.compliance": compliance,
        "torchaudio.compliance.kaldi": kaldi,
        "torchaudio.transforms": transforms,
        "torchaudio.functional": functional,
    }
    for name, mod in modules.items():  # importlib.util.find_spec() (transformers calls it) needs a spec
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=hasattr(mod, "__path__"))
    sys.modules.update(modules)


def require_official() -> None:
    """Import the official LM module once (the stub first); :class:`MissingExtraError` says how to install it."""
    install_torchaudio_stub()
    try:
        import cosyvoice.llm.llm  # noqa: F401
        import hyperpyyaml  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(f"official CosyVoice code not importable ({e}); {OFFICIAL_HINT}") from e


def load_official_model_dir(model_dir: str | Path) -> dict:
    """The official llm/flow/hift (and tokenizer factory) from a model directory's yaml.

    Built with HyperPyYAML exactly as the official ``CosyVoice2`` (``cosyvoice2.yaml``) or ``CosyVoice`` (v1,
    ``cosyvoice.yaml``) class does; the checkpoints load with ``strict=True`` (the llm too, which
    token2wav-cosyvoice 0.1.0's ``CosyVoiceModel.load`` skips). Returns the yaml's dict with the modules in eval mode.
    """
    require_official()
    from hyperpyyaml import load_hyperpyyaml

    d = str(model_dir)
    if os.path.exists(f"{d}/cosyvoice2.yaml"):
        with open(f"{d}/cosyvoice2.yaml") as f:
            configs = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": f"{d}/CosyVoice-BlankEN"})
    else:
        with open(f"{d}/cosyvoice.yaml") as f:
            configs = load_hyperpyyaml(f)

    def load(name: str) -> dict:
        return torch.load(f"{d}/{name}", map_location="cpu", weights_only=True, mmap=True)

    configs["llm"].load_state_dict(load("llm.pt"), strict=True)
    configs["flow"].load_state_dict(load("flow.pt"), strict=True)
    hift = {k.replace("generator.", ""): v for k, v in load("hift.pt").items()}
    configs["hift"].load_state_dict(hift, strict=True)
    for key in ("llm", "flow", "hift"):
        configs[key].eval()
    logger.debug("official models loaded from %s", d)
    return configs
