"""Import the official CosyVoice code (``token2wav-cosyvoice==0.1.0``) for parity tests.

The official modules import ``torchaudio`` at module level for audio I/O only; no torchaudio wheel matches the
CPU torch used here, so a stub module stands in (nothing on the model path calls it). In CI (``CI`` set) a
missing official package is a failure, never a skip: parity is what makes the reference trustworthy.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types

import pytest
import torch


def _install_torchaudio_stub() -> None:
    if "torchaudio" in sys.modules:
        return
    try:  # a real torchaudio that imports cleanly is fine too
        importlib.import_module("torchaudio")
        return
    except Exception:
        for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            del sys.modules[name]

    def _unavailable(*_a, **_k):
        raise RuntimeError("torchaudio stub: audio I/O is not available in parity tests")

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


def official(module: str) -> types.ModuleType:
    """Import an official module (e.g. ``"cosyvoice.flow.flow"``); skip locally, fail in CI, if absent."""
    _install_torchaudio_stub()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        msg = f"official CosyVoice code not importable ({e}); run scripts/install.sh --dev"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max|ref| for same-shaped tensors or arrays (the parity tests' error measure)."""
    import numpy as np

    a, b = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x, dtype=np.float64) for x in (ours, ref))
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != {b.shape}")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def load_official_model_dir(model_dir) -> dict:
    """Build the official llm/flow/hift (and tokenizer factory) from a model directory's yaml with HyperPyYAML,
    exactly as the official ``CosyVoice2`` (``cosyvoice2.yaml``) or ``CosyVoice`` (v1, ``cosyvoice.yaml``) class
    does, and load the checkpoints with ``strict=True`` (the llm too, which token2wav-cosyvoice 0.1.0's
    ``CosyVoiceModel.load`` skips)."""
    official("cosyvoice.llm.llm")
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
    return configs
