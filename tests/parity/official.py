"""Import the official CosyVoice code (``token2wav-cosyvoice==0.1.0``) for parity tests.

The loader and the ``torchaudio`` stub live in :mod:`cosyvoice_cpu.reference.official` (the benchmark's PyTorch
peer uses them too); this module adds the tests' policy. In CI (``CI`` set) a
missing official package is a failure, never a skip: parity is what makes the reference trustworthy.
"""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch

from cosyvoice_cpu.reference.official import install_torchaudio_stub, load_official_model_dir

__all__ = ["load_official_model_dir", "official", "rel_err"]


def official(module: str) -> types.ModuleType:
    """Import an official module (e.g. ``"cosyvoice.flow.flow"``); skip locally, fail in CI, if absent."""
    install_torchaudio_stub()
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
