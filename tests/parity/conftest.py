"""Session fixtures for the CosyVoice-300M (v1) parity tests: the official modules and ours, from one fixture."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def official_v1(tiny_v1_model_dir: Path) -> dict:
    """The official v1 llm/flow/hift/get_tokenizer, built by HyperPyYAML from the fixture's ``cosyvoice.yaml`` and
    loaded strictly from its checkpoints (exactly what the official ``CosyVoice`` class does)."""
    from tests.parity.official import load_official_model_dir

    return load_official_model_dir(tiny_v1_model_dir)


@pytest.fixture(scope="session")
def ours_v1(tiny_v1_model_dir: Path):
    """Our reference modules for the same directory (:func:`load_reference`, strict)."""
    from cosyvoice_cpu.workshop.parts import load_reference

    return load_reference(tiny_v1_model_dir)


@pytest.fixture(scope="module")
def torch_one_thread():
    """Run a module's tiny models on one intra-op thread (restored afterwards).

    At these sizes a second thread buys nothing, and on a loaded 2-core machine the threads' barrier waits made
    a 0.05 s flow call take up to 9 s; both sides of every comparison run under the same setting.
    """
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
