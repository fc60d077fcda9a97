"""The files of a Fun-CosyVoice3-0.5B (v3) fixture, in the released layout, with random weights.

``cosyvoice3.yaml`` (:mod:`.fixture_yaml_v3`), ``llm.pt`` (:class:`~cosyvoice_cpu.reference.lm_v3.CosyVoice3LM`
keys), ``flow.pt`` (``FlowV3`` = official ``CausalMaskedDiffWithDiT`` keys), ``hift.pt`` (``CausalHiFT`` =
official ``CausalHiFTGenerator`` keys; weight norm stored as ``parametrizations.weight.original0/1`` like the
release), ``CosyVoice-BlankEN/`` and stand-ins for ``campplus.onnx`` and ``speech_tokenizer_v3.onnx`` (same
contract as v2: ``feats`` (1, 128, T), ``feats_length`` (1,) -> ``indices`` (1, T/4) in [0, 6561)).

The tokenizer keeps the *real* special ids: the official v3 LM asserts that id 151646 (``<|endofprompt|>``) is
in its text, so the small fixture BPE (:func:`.fixture_tokenizer.write_qwen_tokenizer`) is padded with
unreachable filler entries to the 151,643 regular ids of Qwen2, the three Qwen specials sit at 151643-151645 and
the CosyVoice3 specials are added from 151646 on. The LM therefore keeps the real 151,936-row text embedding
even when ``tiny`` (151936 x 64 floats, ~39 MB).

Determinism: the LM weights are drawn key by key from ``torch.Generator().manual_seed(seed)`` in
``named_parameters()`` order (:func:`random_lm_state`), independent of module initialisation and of the flow and
HiFT, so the golden arrays of ``tests/golden/v3_lm.npz`` stay valid while those modules change.
Called by :func:`cosyvoice_cpu.export.fixture.write_fixture`, which owns the temp-dir/rename protocol.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.export import fixture_onnx
from cosyvoice_cpu.export.fixture_tokenizer import QWEN_SPECIALS, write_qwen_tokenizer
from cosyvoice_cpu.export.fixture_yaml_v3 import TINY_V3, V3Sizes, render_cosyvoice3_yaml

logger = logging.getLogger(__name__)

QWEN_REGULAR_IDS = 151643  # Qwen2's byte-level BPE entries; <|endoftext|> is 151643
LM_HEAD_GAIN = 3.0  # the head's logits get std ~3: a peaky distribution, so top-p and the stop ids matter


def v3_sizes(size: str) -> V3Sizes:
    """``full`` = the released dimensions; ``tiny`` = small flow/HiFT, 2-layer 64-wide LM."""
    return V3Sizes() if size == "full" else TINY_V3


def v3_qwen_config(size: str):
    """The backbone shape written to ``CosyVoice-BlankEN/config.json`` (the vocabulary stays the real one)."""
    from cosyvoice_cpu.reference.qwen2 import Qwen2Config

    if size == "full":
        return Qwen2Config()
    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip


def write_blank_en_v3(blank: Path, qwen) -> None:
    """``CosyVoice-BlankEN/``: config files and a Qwen2-format BPE whose specials sit at the real ids."""
    write_qwen_tokenizer(blank, vocab_size=1000)
    vocab = json.loads((blank / "vocab.json").read_text(encoding="utf-8"))
    n = len(vocab)
    if n > QWEN_REGULAR_IDS:
        raise ModelDirError(f"fixture BPE has {n} ids, more than Qwen2's {QWEN_REGULAR_IDS}")
    # fillers no merge produces: they only move the specials to their real ids
    vocab.update({f"<|fixture_pad_{i}|>": i for i in range(n, QWEN_REGULAR_IDS)})
    (blank / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    config_path = blank / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    old = config["added_tokens_decoder"]
    config["added_tokens_decoder"] = {str(QWEN_REGULAR_IDS + i): old[str(n + i)] for i in range(len(QWEN_SPECIALS))}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (blank / "config.json").write_text(json.dumps(qwen.to_json_dict(), indent=2), encoding="utf-8")
    (blank / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": 151643, "max_new_tokens": 2048}, indent=2),
        encoding="utf-8",
    )


def random_lm_state(lm, seed: int) -> None:
    """Fill ``lm``'s parameters in place from one seeded generator, in ``named_parameters()`` order.

    Norm gains 1 + 0.05 N, biases 0.05 N, embeddings N(0, 1), weight matrices N(0, 1/fan_in) (the speech head
    ``LM_HEAD_GAIN`` times that). The tied ``lm_head`` shares ``embed_tokens`` and is not drawn twice.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            x = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * x)
            elif name.endswith(".bias"):
                p.copy_(0.05 * x)
            elif "embed" in name:
                p.copy_(x)
            else:
                gain = LM_HEAD_GAIN if name.startswith("llm_decoder") else 1.0
                p.copy_(x * (gain / math.sqrt(p.shape[-1])))


def write_cosyvoice3_lm_files(out: Path, size: str, seed: int) -> None:
    """The LM part of a v3 fixture: ``cosyvoice3.yaml``, ``CosyVoice-BlankEN/`` and ``llm.pt``.

    Enough for :func:`~cosyvoice_cpu.reference.model_dir.load_reference` with ``stages=("lm",)`` and for the
    official ``CosyVoice3LM``/``CosyVoice3Tokenizer`` (scripts/make_v3_golden.py).
    """
    import torch
    from safetensors.torch import save_file

    from cosyvoice_cpu.reference.lm_v3 import CosyVoice3LM, CosyVoice3LMConfig
    from cosyvoice_cpu.reference.yamlconf import load_yaml_data

    out.mkdir(parents=True, exist_ok=True)
    qwen = v3_qwen_config(size)
    blank = out / "CosyVoice-BlankEN"
    write_blank_en_v3(blank, qwen)
    (out / "cosyvoice3.yaml").write_text(render_cosyvoice3_yaml(v3_sizes(size)), encoding="utf-8")
    data = load_yaml_data(out / "cosyvoice3.yaml")
    lm = CosyVoice3LM(CosyVoice3LMConfig.from_yaml(data["llm"], qwen)).eval()
    random_lm_state(lm, seed)
    torch.save(lm.state_dict(), out / "llm.pt")
    backbone = {f"model.{k}": v.to(torch.bfloat16) for k, v in lm.backbone.state_dict().items()}
    save_file(backbone, str(blank / "model.safetensors"), metadata={"format": "pt"})
    logger.debug("wrote v3 LM fixture files (%s, seed %d) to %s", size, seed, out)


def _perturb(module, gen) -> None:
    """Move vector parameters (norm gains, biases, Snake alphas) off their init values."""
    import torch

    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.dim() <= 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def write_cosyvoice3_files(out: Path, size: str, seed: int, rng: np.random.Generator) -> None:
    """Write every file of a v3 fixture into the (empty, temporary) directory ``out``."""
    import torch

    from cosyvoice_cpu.export.fixture import released_hift_state
    from cosyvoice_cpu.reference.model_dir import read_model_config, v3_stage_classes

    write_cosyvoice3_lm_files(out, size, seed)
    cfg = read_model_config(out)
    flow_cls, hift_cls = v3_stage_classes()
    torch.manual_seed(seed + 1)
    gen = torch.Generator().manual_seed(seed + 1)
    flow, hift = flow_cls(cfg.flow).eval(), hift_cls(cfg.hift).eval()
    for m in (flow, hift):
        _perturb(m, gen)
    torch.save(flow.state_dict(), out / "flow.pt")
    torch.save(released_hift_state(hift.state_dict()), out / "hift.pt")
    del flow, hift
    fixture_onnx.write_campplus_standin(out / "campplus.onnx", rng)
    fixture_onnx.write_speech_tokenizer_standin(out / "speech_tokenizer_v3.onnx", rng)
    logger.debug("wrote v3 fixture files (%s, seed %d) to %s", size, seed, out)
