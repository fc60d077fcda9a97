"""``cosyvoice-cpu fixture``: a model directory in the official released layout, with random weights.

Real CosyVoice weights cannot be downloaded here, so tests and benchmarks run on fixtures that are faithful in
everything but the weight values: the official yaml schema and class tags, ``llm.pt``/``flow.pt``/``hift.pt``
with the released key names and shapes (HiFT weight norm stored as ``parametrizations.weight.original0/1``
like the release), ``CosyVoice-BlankEN/`` (Qwen2 ``config.json``, ``model.safetensors``, a small BPE in the
Qwen2 file format) and stand-ins for ``campplus.onnx`` and ``speech_tokenizer_v2.onnx`` with the official
graph contracts. The official implementation loads a fixture unchanged and strictly (tests/parity).

Sizes: ``tiny`` (a few MB, for tests) and ``full`` (the real CosyVoice2-0.5B dimensions, for speed/memory).

Family ``cosyvoice`` (CosyVoice-300M, v1; ``tiny`` or ``full``) writes the v1 layout instead: ``cosyvoice.yaml``,
``speech_tokenizer_v1.onnx``, ``spk2info.pt`` and no ``CosyVoice-BlankEN/`` (see :mod:`.fixture_v1`).
Family ``cosyvoice3`` (Fun-CosyVoice3-0.5B, v3; ``tiny`` or ``full``) writes ``cosyvoice3.yaml``, the DiT flow and
causal HiFT checkpoints, ``speech_tokenizer_v3.onnx`` and a BlankEN with the real special ids (see :mod:`.fixture_v3`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import replace_dir
from cosyvoice_cpu.export.fixture_onnx import write_campplus_standin, write_speech_tokenizer_standin
from cosyvoice_cpu.export.fixture_tokenizer import write_qwen_tokenizer
from cosyvoice_cpu.export.fixture_yaml import FlowHiftSizes, render_cosyvoice2_yaml

logger = logging.getLogger(__name__)

FAMILIES = ("cosyvoice2", "cosyvoice", "cosyvoice3")
SIZES = ("tiny", "full", "demo")
FAMILY_SIZES = {"cosyvoice2": SIZES, "cosyvoice": ("tiny", "full"), "cosyvoice3": ("tiny", "full")}
V1_VARIANTS = ("base", "sft", "instruct")  # the CosyVoice-300M downloads: same layout, -SFT/-Instruct add speakers

# Modules the official HiFTGenerator wraps in weight_norm (saved as parametrizations in hift.pt).
_HIFT_WEIGHT_NORMED = re.compile(
    r"^(conv_pre|conv_post|ups\.\d+|(source_)?resblocks\.\d+\.convs[12]\.\d+|f0_predictor\.condnet\.\d+)\.weight$"
)


@dataclass(frozen=True)
class FixtureSpec:
    """What to generate."""

    family: str = "cosyvoice2"
    size: str = "tiny"
    seed: int = 0
    variant: str = "sft"  # CosyVoice-300M only: base (no spk2info.pt), sft or instruct (both ship built-in speakers)

    def validate(self) -> None:
        if self.variant not in V1_VARIANTS:
            raise ConfigError(f"fixture variant {self.variant!r} is unknown; choose from {V1_VARIANTS}")
        if self.variant != "sft" and self.family != "cosyvoice":
            raise ConfigError(f"fixture variants are CosyVoice-300M downloads; {self.family} has none (omit --variant)")
        if self.family not in FAMILIES:
            raise ConfigError(f"fixture family {self.family!r} is not supported yet; choose from {FAMILIES}")
        if self.size not in SIZES:
            raise ConfigError(f"fixture size {self.size!r} is unknown; choose from {SIZES}")
        if self.size not in FAMILY_SIZES[self.family]:
            raise ConfigError(
                f"fixture size {self.size!r} is not made for {self.family}; choose from {FAMILY_SIZES[self.family]}"
            )
        if self.seed < 0:
            raise ConfigError(f"fixture seed must be >= 0, got {self.seed}")


def _qwen_and_sizes(size: str, tokenizer_ids: int):
    from cosyvoice_cpu.reference.qwen2 import Qwen2Config

    if size == "full":
        return Qwen2Config(), FlowHiftSizes()
    vocab = int(np.ceil((tokenizer_ids + 32) / 64) * 64)  # room for the 17 CosyVoice specials
    qwen = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    sizes = FlowHiftSizes(
        llm_size=64,
        # the official PreLookaheadLayer / Upsample1D hard-code 512 channels; "demo" (the packaged runtime demo
        # model) trades loading into the official code for a 64-wide encoder, 8x smaller
        flow_input_size=64 if size == "demo" else 512,
        encoder_heads=2,
        encoder_units=64,
        encoder_blocks=1,
        estimator_channels=64,
        estimator_head_dim=32,
        estimator_blocks=1,
        estimator_mid_blocks=2,
        estimator_heads=2,
        hift_channels=32,
        f0_channels=32,
    )
    return qwen, sizes


def released_hift_state(state: dict) -> dict:
    """Turn plain conv weights into the released ``hift.pt`` layout: weight norm as g/v parametrizations.

    For each weight-normed module, ``original0`` = g = ||W|| over all axes but 0 (keepdim) and
    ``original1`` = v = W, so that folding gives W back.
    """
    import torch

    out = {}
    for key, value in state.items():
        if _HIFT_WEIGHT_NORMED.match(key):
            prefix = key[: -len(".weight")]
            g = torch.linalg.vector_norm(value, dim=tuple(range(1, value.dim())), keepdim=True)
            out[f"{prefix}.parametrizations.weight.original0"] = g
            out[f"{prefix}.parametrizations.weight.original1"] = value.clone()
        else:
            out[key] = value
    return out


def _perturb_norms(module, gen) -> None:
    """Move norm weights and biases off their init values so no layer is an identity by accident."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith(".bias") or name.endswith("alpha"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def write_fixture(spec: FixtureSpec, out: str | Path, force: bool = False) -> Path:
    """Write a random-weight model directory in the official layout; atomically (temp dir, then rename).

    Returns:
        the directory written.
    Raises:
        ConfigError: bad spec; FileExistsError: ``out`` exists and ``force`` is False.
    """
    from cosyvoice_cpu.reference.model_dir import load_reference

    spec.validate()
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        rng = np.random.default_rng(spec.seed)
        if spec.family == "cosyvoice":
            from cosyvoice_cpu.export.fixture_v1 import write_cosyvoice_files

            write_cosyvoice_files(tmp, spec.size, spec.seed, rng, speakers=spec.variant != "base")
        elif spec.family == "cosyvoice3":
            from cosyvoice_cpu.export.fixture_v3 import write_cosyvoice3_files

            write_cosyvoice3_files(tmp, spec.size, spec.seed, rng)
        else:
            _write_cosyvoice2_files(tmp, spec, rng)
        # a released directory is checked after writing: every module must load strictly
        load_reference(tmp)
        tmp.chmod(0o755)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s %s fixture (seed %d) to %s", spec.size, spec.family, spec.seed, out)
    return out


def _write_cosyvoice2_files(tmp: Path, spec: FixtureSpec, rng: np.random.Generator) -> None:
    """Every file of a CosyVoice2 fixture, written into the temporary directory ``tmp``."""
    import torch
    from safetensors.torch import save_file

    blank = tmp / "CosyVoice-BlankEN"
    n_ids = write_qwen_tokenizer(blank, vocab_size=1000)
    qwen, sizes = _qwen_and_sizes(spec.size, n_ids)
    (blank / "config.json").write_text(json.dumps(qwen.to_json_dict(), indent=2), encoding="utf-8")
    (blank / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": 151643, "max_new_tokens": 2048}, indent=2),
        encoding="utf-8",
    )
    (tmp / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(sizes), encoding="utf-8")

    # Build the reference modules from the files just written (this also validates them), then
    # initialise, and save in the released layout.
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        (tmp / name).write_bytes(b"")
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    model = _build_random(tmp)
    for m in (model.lm, model.flow, model.hift):
        _perturb_norms(m, gen)
    torch.save(model.lm.state_dict(), tmp / "llm.pt")
    torch.save(model.flow.state_dict(), tmp / "flow.pt")
    torch.save(released_hift_state(model.hift.state_dict()), tmp / "hift.pt")
    backbone = {f"model.{k}": v.to(torch.bfloat16) for k, v in model.lm.backbone.state_dict().items()}
    save_file(backbone, str(blank / "model.safetensors"), metadata={"format": "pt"})
    del model, backbone

    write_campplus_standin(tmp / "campplus.onnx", rng)
    write_speech_tokenizer_standin(tmp / "speech_tokenizer_v2.onnx", rng)


def _build_random(model_dir: Path):
    """Reference modules for ``model_dir``'s yaml and BlankEN config, freshly (randomly) initialised."""
    from cosyvoice_cpu.reference.flow import Flow
    from cosyvoice_cpu.reference.hift import HiFT
    from cosyvoice_cpu.reference.lm import Qwen2LM
    from cosyvoice_cpu.reference.model_dir import ReferenceModel, read_model_config

    cfg = read_model_config(model_dir)
    return ReferenceModel(cfg, Qwen2LM(cfg.lm).eval(), Flow(cfg.flow).eval(), HiFT(cfg.hift).eval())
