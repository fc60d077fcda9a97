"""The files of a CosyVoice-300M (v1) fixture: ``cosyvoice.yaml``, ``llm.pt``, ``flow.pt``, ``hift.pt``, stand-in
``campplus.onnx`` and ``speech_tokenizer_v1.onnx``, and ``spk2info.pt``.

Weights are random but every key, shape and file format is the released one: the checkpoints are our reference
modules' ``state_dict()`` (keys equal the official ``TransformerLM``/``MaskedDiffWithXvec``/``HiFTGenerator``,
checked by the parity tests, which load a fixture into the official classes strictly); ``hift.pt`` stores weight
norm as ``parametrizations.weight.original0/1`` like the release. ``spk2info.pt`` holds two built-in speakers as the
-SFT/-Instruct downloads do (``{name: {"embedding": (1, 192)}}``); the base CosyVoice-300M ships none.
The fixture also carries a small ``multilingual.tiktoken`` (the text tokenizer asset the v1 yaml's
``whisper.tokenizer.get_tokenizer`` reads): the official downloads do not contain it (it comes with openai-whisper),
but a fixture that does lets our export find it (:func:`cosyvoice_cpu.export.tokenizer_whisper.find_tiktoken`).
Called by :func:`cosyvoice_cpu.export.fixture.write_fixture`, which owns the temp-dir/rename protocol.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from cosyvoice_cpu.export import fixture_onnx
from cosyvoice_cpu.export.fixture_tokenizer import write_fixture_tiktoken
from cosyvoice_cpu.export.fixture_yaml_v1 import TINY_V1, V1Sizes, render_cosyvoice_yaml

logger = logging.getLogger(__name__)

SPEAKERS = ("中文女", "英文男")  # two of the seven CosyVoice-300M-SFT speaker ids


def v1_sizes(size: str) -> V1Sizes:
    """``full`` = the released dimensions; ``tiny`` = a few MB for tests."""
    return V1Sizes() if size == "full" else TINY_V1


def _perturb(module, gen) -> None:
    """Move every vector parameter (norm gains, biases, Snake alphas) and the attention position biases off their
    init values, so no layer is an identity or a no-op by accident (the reference initialises pos_bias to 0)."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if "pos_bias" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            elif p.dim() <= 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def write_cosyvoice_files(out: Path, size: str, seed: int, rng: np.random.Generator, speakers: bool = True) -> None:
    """Write every file of a v1 fixture into the (empty, temporary) directory ``out``; ``speakers=False`` leaves out
    ``spk2info.pt`` (the base CosyVoice-300M; -SFT and -Instruct ship it). Weights do not depend on it."""
    import torch

    from cosyvoice_cpu.export.fixture import released_hift_state
    from cosyvoice_cpu.reference.flow_v1 import FlowV1
    from cosyvoice_cpu.reference.hift import HiFT
    from cosyvoice_cpu.reference.lm_v1 import TransformerLM
    from cosyvoice_cpu.reference.model_dir import SPK2INFO, read_model_config

    (out / "cosyvoice.yaml").write_text(render_cosyvoice_yaml(v1_sizes(size)), encoding="utf-8")
    cfg = read_model_config(out)  # the modules are built from the yaml just written (which validates it)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    lm, flow, hift = TransformerLM(cfg.lm).eval(), FlowV1(cfg.flow).eval(), HiFT(cfg.hift).eval()
    for m in (lm, flow, hift):
        _perturb(m, gen)
    torch.save(lm.state_dict(), out / "llm.pt")
    torch.save(flow.state_dict(), out / "flow.pt")
    torch.save(released_hift_state(hift.state_dict()), out / "hift.pt")
    del lm, flow, hift
    spk2info = {name: {"embedding": torch.randn(1, 192, generator=gen)} for name in SPEAKERS}
    if speakers:
        torch.save(spk2info, out / SPK2INFO)
    fixture_onnx.write_campplus_standin(out / "campplus.onnx", rng)
    fixture_onnx.write_speech_tokenizer_v1_standin(out / "speech_tokenizer_v1.onnx", rng)
    write_fixture_tiktoken(out / "multilingual.tiktoken", seed)
    logger.debug("wrote v1 fixture files (%s, seed %d) to %s", size, seed, out)
