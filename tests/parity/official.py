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
