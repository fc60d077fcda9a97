"""``cosyvoice-cpu export``: an official model directory (any family) -> a deployable one (docs/model-format.md).

Stage by stage (so only one stage's PyTorch weights are resident at a time): load the reference, write fp32
graphs, check them against the reference (the numerics gate), apply the quantization recipe, check the
quantized graphs with their own tolerances, free the stage. Then the tokenizer, the copied ONNX front-end
models and the manifest. Everything is written to a hidden sibling directory that replaces the target only when
complete, so a failure never leaves a half-written model directory.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cosyvoice_cpu import __version__
from cosyvoice_cpu.errors import ConfigError, CosyVoiceCpuError, ExportError, MissingExtraError
from cosyvoice_cpu.export.common import GateResult, GraphArtifact, replace_dir
from cosyvoice_cpu.export.families import ExportFamily
from cosyvoice_cpu.export.quantize import DEFAULT_RECIPE, Recipe, parse_recipe
from cosyvoice_cpu.facts import FAMILIES
from cosyvoice_cpu.lm_files import SPECIALS
from cosyvoice_cpu.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    VOICES_DIR,
    FileEntry,
    GraphEntry,
    Manifest,
    sha256_file,
)
from cosyvoice_cpu.reference.checkpoint import load_checkpoint
from cosyvoice_cpu.workshop.export_stages import export_stage_files, wants_openvino_lm
from cosyvoice_cpu.workshop.parts import detect_family, export_family, read_model_config

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

# ONNX front-end models are copied as they are (ExportFamily.copied_onnx), with the ranks of the inputs the runtime
# feeds them (by position, as the official frontend does): campplus fbank (B, T, 80); speech tokenizer log-mel
# (1, 128, T) and its length (1,).
ONNX_RANKS = {"campplus": (3,), "speech_tokenizer": (3, 1)}


def copied_onnx(family: str) -> dict[str, str]:
    """Manifest key -> file name of the front-end ONNX models copied unchanged for ``family``."""
    return export_family(family).copied_onnx()


# Python packages the export needs beyond torch (checked up front, not after minutes of work).
EXPORT_MODULES = {"onnx": "onnx", "onnx_ir": "onnx-ir", "transformers": "transformers", "tokenizers": "tokenizers"}


@dataclass
class ExportOptions:
    """Options of :func:`export_model`.

    Attributes:
        recipe: a recipe name or spec (:func:`~cosyvoice_cpu.export.quantize.parse_recipe`).
        force: replace an existing target directory.
        verify: run the numerics gate on every graph (on by default; ``--no-verify`` skips it).
        max_len: LM KV-cache length in positions (prompt + text + speech tokens).
        seed: seed of the gate's random inputs.
        openvino: ``none``, ``bf16`` or ``int8``: also write an OpenVINO model of the whole-sentence flow
            estimator of that kind (:mod:`cosyvoice_cpu.export.openvino_graphs`; ``[openvino-export]`` extra).
        openvino_lm: with ``openvino``, the weights of the stateful OpenVINO LM also written where the family's LM
            is the Qwen2 LM (CosyVoice2, Fun-CosyVoice3; :mod:`cosyvoice_cpu.export.openvino_lm`): ``int8`` (the
            default), ``int4``, or ``none`` (not written).
    """

    recipe: str = DEFAULT_RECIPE
    force: bool = False
    verify: bool = True
    max_len: int = 2048
    seed: int = 0
    openvino: str = "none"
    openvino_lm: str = "int8"

    def validate(self) -> Recipe:
        from cosyvoice_cpu.export.openvino_graphs import VARIANTS, check_extra
        from cosyvoice_cpu.export.openvino_lm import CHOICES

        if not 64 <= self.max_len <= 32768:
            raise ConfigError(f"max_len must be in [64, 32768] positions, got {self.max_len}")
        if self.openvino not in VARIANTS:
            raise ConfigError(f"openvino must be one of {', '.join(VARIANTS)}, got {self.openvino!r}")
        if self.openvino_lm not in CHOICES:
            raise ConfigError(f"openvino_lm must be one of {', '.join(CHOICES)}, got {self.openvino_lm!r}")
        if self.openvino != "none":
            check_extra(self.openvino)
        return parse_recipe(self.recipe)


@functools.lru_cache(maxsize=1)
def export_code_digest() -> str:
    """12 hex digits of SHA-256 over the code that shapes an export (``export/`` and ``reference/`` sources),
    read once per process (:func:`export_model` reads it first, before any graph is built).

    Recorded in the manifest's ``created_by``, so a cached export written by other graph-building code is
    recognised as stale (``cosyvoice-cpu bench`` re-exports it) instead of being benchmarked as if it were current.
    """
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*(root / "export").glob("*.py"), *(root / "reference").glob("*.py")]):
        h.update(f"{f.parent.name}/{f.name}".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def free_bytes(path: Path) -> int:
    """Free disk space where ``path`` (or its nearest existing parent) lives."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _fp32_bytes(ckpt: Path) -> int:
    """The size of a checkpoint's tensors with every floating-point one widened to fp32 (the graphs' precision).

    The checkpoint is memory-mapped, so only its tensor headers are read: well under a second for 2 GB.
    """
    import torch

    state = load_checkpoint(ckpt)
    if isinstance(state.get("state_dict"), dict):  # a training checkpoint wrapping the weights
        state = state["state_dict"]
    return sum(
        t.numel() * (4 if t.is_floating_point() else t.element_size())
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def needed_bytes(src: Path, family: str = "cosyvoice2") -> int:
    """A safe estimate of the disk space an export needs, from the checkpoints' size in fp32.

    The fp32 graphs hold about the checkpoints' fp32 size and quantizing keeps a stage's fp32 graph only until
    its quantized copy is written, so 1.1x bounds the peak. Measured on the full-size CosyVoice2 fixture (3.10 GB
    in fp32, its LM stored partly in half precision): the default recipe peaks at 2.02 GB, the fp32 recipe
    writes 2.7 GB.
    """
    fp32 = sum(_fp32_bytes(src / n) for n in ("llm.pt", "flow.pt", "hift.pt"))
    copies = sum((src / f).stat().st_size for f in copied_onnx(family).values())
    return int(1.1 * fp32) + copies + (64 << 20)


def check_source(src: Path) -> Any:
    """Validate an official directory: the yaml parses, the family is supported, every required file is there."""
    if not src.is_dir():
        raise ExportError(
            f"--from {src}: no such directory; point at a released CosyVoice2-0.5B, CosyVoice-300M or "
            "Fun-CosyVoice3-0.5B directory"
        )
    family = detect_family(src)
    try:
        fam = export_family(family)
    except ExportError:
        raise ExportError(f"{src} is a {family} model; export supports {', '.join(FAMILIES)}") from None
    missing = [n for n in fam.required_files() if not (src / n).is_file()]
    if missing:
        raise ExportError(
            f"{src} is missing {', '.join(missing)}: the directory is incomplete; download the whole model "
            "(e.g. modelscope download iic/CosyVoice2-0.5B, iic/CosyVoice-300M-SFT or "
            "FunAudioLLM/Fun-CosyVoice3-0.5B-2512) or make a fixture with "
            "`cosyvoice-cpu fixture`"
        )
    cfg = read_model_config(src)  # raises ModelDirError for a wrong/unsupported family
    for key, name in fam.copied_onnx().items():
        _check_onnx(src / name, ONNX_RANKS[key], key)
    fam.check_source(src)  # e.g. CosyVoice-300M's tiktoken vocabulary: fail now, not after minutes of export
    return cfg


def _check_onnx(path: Path, ranks: tuple[int, ...], what: str) -> None:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise ExportError(f"{path} is not a readable ONNX model ({type(e).__name__}); re-download it") from e
    inits = {i.name for i in model.graph.initializer}
    have = [len(i.type.tensor_type.shape.dim) for i in model.graph.input if i.name not in inits]
    if tuple(have) != ranks:
        raise ExportError(
            f"{path} ({what}) has {len(have)} inputs of ranks {have}, expected ranks {list(ranks)}; is it the "
            "right file? re-download it"
        )


def check_extra() -> None:
    """The export's own dependencies are importable (a missing one is named with the pip command)."""
    import importlib.util

    missing = [pip for mod, pip in EXPORT_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise MissingExtraError(
            f"export needs {', '.join(missing)}: pip install 'cosyvoice-cpu[export]' (after pip install torch==2.13.0)"
        )


def _check_target(src: Path, dst: Path, force: bool) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        raise ExportError(f"--to {dst} must be outside --from {src} (and not contain it)")
    if dst.exists() and not dst.is_dir():
        raise ExportError(f"--to {dst} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()):
        if not force:
            raise ExportError(f"--to {dst} already exists and is not empty; pass --force to replace it")
        if not (dst / MANIFEST_NAME).is_file():
            raise ExportError(
                f"--to {dst} is not empty and holds no {MANIFEST_NAME}: --force only replaces a cosyvoice-cpu "
                "model directory; choose a new or empty directory"
            )


def _sweep_partials(parent: Path, name: str) -> None:
    """Remove ``.NAME.partial-PID`` directories of exports whose process is gone (killed, out of memory)."""
    for p in parent.glob(f".{name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        alive = pid.isdigit() and Path(f"/proc/{pid}").exists() and int(pid) != os.getpid()
        if not alive:
            logger.info("removing %s left by an interrupted export", p)
            shutil.rmtree(p, ignore_errors=True)


def export_model(
    src: str | Path, dst: str | Path, options: ExportOptions | None = None, progress: Progress | None = None
) -> Manifest:
    """Export ``src`` (official layout) to the model directory ``dst``; returns the written manifest.

    Raises:
        ExportError / ModelDirError: bad source, existing target, too little disk, a failed numerics gate.
        ConfigError: bad options.
    """
    options = options or ExportOptions()
    recipe = options.validate()
    src, dst = Path(src), Path(dst)
    export_code_digest()  # the code this export is built with, not what the files say when it ends
    say = progress or (lambda msg: logger.info("%s", msg))
    t0 = time.perf_counter()

    doing = ["checking the source"]

    def step(msg: str) -> None:
        doing[0] = msg
        say(f"[{time.perf_counter() - t0:6.1f}s] {msg}")

    check_extra()
    _check_target(src, dst, options.force)
    cfg = check_source(src)
    fam = export_family(cfg.family)
    if wants_openvino_lm(cfg.family, options):  # nncf for its weights: said now, not after the LM's export
        from cosyvoice_cpu.export.lm.openvino_stateful import check_extra as check_lm_extra

        check_lm_extra(options.openvino_lm)
    need, free = needed_bytes(src, cfg.family), free_bytes(dst.parent if not dst.exists() else dst)
    if free < need:
        raise ExportError(
            f"not enough disk space under {dst.parent}: the export needs about {need / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB are free; free some space or export elsewhere"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    _sweep_partials(dst.parent, dst.name)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        step(f"exporting {src} ({cfg.family}) with recipe {recipe.name!r} into {dst}")
        graphs, gates, stage_facts = export_stage_files(src, tmp, cfg, recipe, options, step)
        step("tokenizer, front-end models, manifest")
        text = fam.export_tokenizer(cfg, tmp)
        for name in fam.copied_onnx().values():
            shutil.copy2(src / name, tmp / name)
        voices = fam.export_speakers(cfg, tmp)
        for p in [*tmp.iterdir(), *voices]:  # copies keep the source's mode, np.save follows the umask: 0644
            if p.is_file():
                p.chmod(0o644)
        manifest = _manifest(src, tmp, cfg, fam, recipe, graphs, gates, text, stage_facts, voices)
        manifest.save(tmp)
        (tmp / MANIFEST_NAME).chmod(0o644)
        tmp.chmod(0o755)
        replace_dir(tmp, dst)
    except CosyVoiceCpuError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # torch/onnx/ORT/quantizer failures: one line naming the step, traceback with --debug
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(
            f"export failed while {doing[0]!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            "nothing was written. Re-run with --debug for the traceback"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        gc.collect()
    size = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    step(f"done: {dst} ({size / 1e9:.2f} GB, {len(gates)} checks passed)")
    if "lm_ov" in manifest.graphs:  # recorded, not gated: printed in the summary
        from cosyvoice_cpu.export.openvino_lm import agreement_line

        step(agreement_line(manifest.graphs["lm_ov"].attrs))
    return manifest


def _export_tokenizer(cfg: Any, out: Path) -> dict[str, Any]:
    """Write ``tokenizer.json`` (Hugging Face ``tokenizers`` format, CosyVoice specials included); CosyVoice-300M's
    Whisper tiktoken vocabulary is converted to the same format (:meth:`ExportFamily.export_tokenizer`)."""
    return export_family(cfg.family).export_tokenizer(cfg, out)


def _manifest(
    src: Path,
    out: Path,
    cfg: Any,
    fam: ExportFamily,
    recipe: Recipe,
    graphs: list[GraphArtifact],
    gates: list[GateResult],
    text: dict[str, Any],
    stage_facts: dict[str, dict[str, Any]],
    voices: list[Path] = (),
) -> Manifest:
    entries = {}
    for g in graphs:
        entries[g.key] = GraphEntry(
            FileEntry.of(out, g.file),
            [FileEntry.of(out, d) for d in g.data],
            g.precision,
            [asdict(s) for s in g.inputs],
            [asdict(s) for s in g.outputs],
            g.attrs,
        )
    arrays = {p.stem: FileEntry.of(out, p.name) for p in sorted(out.glob("*.npy"))}
    files = {"tokenizer": FileEntry.of(out, "tokenizer.json")}
    files.update({key: FileEntry.of(out, name) for key, name in fam.copied_onnx().items()})
    files.update({f"voice:{p.stem}": FileEntry.of(out, f"{VOICES_DIR}/{p.name}") for p in voices})
    lm = cfg.lm
    source_files = {
        n: {"size": (src / n).stat().st_size, "sha256": sha256_file(src / n)}
        for n in (cfg.yaml_path.name, "llm.pt", "flow.pt", "hift.pt")
    }
    return Manifest(
        format_version=FORMAT_VERSION,
        family=cfg.family,
        created_by=f"cosyvoice-cpu {__version__} (export code {export_code_digest()})",
        recipe={"name": recipe.name, "stages": recipe.stages()},
        sample_rate=cfg.sample_rate,
        token_frame_rate=cfg.token_frame_rate,
        token_mel_ratio=cfg.token_mel_ratio,
        mel=asdict(cfg.mel),
        text=text,
        lm={
            "speech_token_size": lm.speech_token_size,
            "eos_id": lm.eos_id,
            "stop_ids": list(lm.stop_ids),
            "sos_row": SPECIALS["sos"],
            "task_id_row": SPECIALS["task_id"],
            "min_token_text_ratio": lm.min_token_text_ratio,
            "max_token_text_ratio": lm.max_token_text_ratio,
            **fam.lm_facts(lm),  # v3: the official min-length mask is its sos id, the endofprompt id
            **stage_facts.get("lm", {}),
        },
        sampling=asdict(lm.sampling),
        flow={**fam.flow_facts(cfg.flow), **stage_facts.get("flow", {})},
        hift={**cfg.hift.to_dict(), **stage_facts.get("hift", {})},
        graphs=entries,
        arrays=arrays,
        files=files,
        source={"path": str(src.resolve()), "yaml": cfg.yaml_path.name, "files": source_files},
        verification=[{**asdict(g), "passed": g.passed} for g in gates],
    )
