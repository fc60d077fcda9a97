"""``cosyvoice-cpu export``: an official CosyVoice2 directory -> a deployable model directory (DESIGN.md §3).

Stage by stage (so only one stage's PyTorch weights are resident at a time): load the reference, write fp32
graphs, check them against the reference (the numerics gate), apply the quantization recipe, check the
quantized graphs with their own tolerances, free the stage. Then the tokenizer, the copied ONNX front-end
models and the manifest. Everything is written to a hidden sibling directory that replaces the target only when
complete, so a failure never leaves a half-written model directory.
"""

from __future__ import annotations

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
from cosyvoice_cpu.export.quantize import DEFAULT_RECIPE, Recipe, parse_recipe
from cosyvoice_cpu.export.stages import export_stage_files
from cosyvoice_cpu.lm import SPECIALS
from cosyvoice_cpu.manifest import FORMAT_VERSION, MANIFEST_NAME, FileEntry, GraphEntry, Manifest, sha256_file

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

# Files a released CosyVoice2-0.5B directory must hold (relative paths).
REQUIRED = (
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/config.json",
    "CosyVoice-BlankEN/vocab.json",
    "CosyVoice-BlankEN/merges.txt",
    "CosyVoice-BlankEN/tokenizer_config.json",
)
# ONNX front-end models copied as they are, with the ranks of the inputs the runtime feeds them (by position, as
# the official frontend does): campplus fbank (B, T, 80); speech tokenizer log-mel (1, 128, T) and its length (1,).
COPIED_ONNX = {"campplus": ("campplus.onnx", (3,)), "speech_tokenizer": ("speech_tokenizer_v2.onnx", (3, 1))}
# Families the ONNX export and the runtime implement (the PyTorch reference also reads CosyVoice-300M).
EXPORTABLE = ("cosyvoice2",)
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
    """

    recipe: str = DEFAULT_RECIPE
    force: bool = False
    verify: bool = True
    max_len: int = 2048
    seed: int = 0

    def validate(self) -> Recipe:
        if not 64 <= self.max_len <= 32768:
            raise ConfigError(f"max_len must be in [64, 32768] positions, got {self.max_len}")
        return parse_recipe(self.recipe)


def free_bytes(path: Path) -> int:
    """Free disk space where ``path`` (or its nearest existing parent) lives."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def needed_bytes(src: Path) -> int:
    """A safe estimate of the space an export needs: fp32 graphs + embeddings + quantization scratch + copies.

    Checkpoints may be stored in half precision while graphs are fp32, and quantizing keeps the fp32 graph of a
    stage until its quantized copy is written: 2.5x the checkpoints bounds both.
    """
    ckpt = sum((src / n).stat().st_size for n in ("llm.pt", "flow.pt", "hift.pt"))
    copies = sum((src / f).stat().st_size for f, _ in COPIED_ONNX.values())
    return int(2.5 * ckpt) + copies + (64 << 20)


def check_source(src: Path) -> Any:
    """Validate an official directory: the yaml parses, the family is supported, every required file is there."""
    from cosyvoice_cpu.reference.model_dir import detect_family, read_model_config

    if not src.is_dir():
        raise ExportError(f"--from {src}: no such directory; point at a released CosyVoice2-0.5B directory")
    family = detect_family(src)
    if family not in EXPORTABLE:
        raise ExportError(
            f"{src} is a {family} model; export supports {', '.join(EXPORTABLE)} so far (the CosyVoice-300M "
            "reference exists, its ONNX export and runtime are tracked as their own issue)"
        )
    missing = [n for n in REQUIRED if not (src / n).is_file()]
    if missing:
        raise ExportError(
            f"{src} is missing {', '.join(missing)}: the directory is incomplete; download the whole model "
            "(e.g. modelscope download iic/CosyVoice2-0.5B) or make a fixture with `cosyvoice-cpu fixture`"
        )
    cfg = read_model_config(src)  # raises ModelDirError for a wrong/unsupported family
    for key, (name, ranks) in COPIED_ONNX.items():
        _check_onnx(src / name, ranks, key)
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
    say = progress or (lambda msg: logger.info("%s", msg))
    t0 = time.perf_counter()

    doing = ["checking the source"]

    def step(msg: str) -> None:
        doing[0] = msg
        say(f"[{time.perf_counter() - t0:6.1f}s] {msg}")

    check_extra()
    _check_target(src, dst, options.force)
    cfg = check_source(src)
    need, free = needed_bytes(src), free_bytes(dst.parent if not dst.exists() else dst)
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
        text = _export_tokenizer(cfg, tmp)
        for name, _ in COPIED_ONNX.values():
            shutil.copy2(src / name, tmp / name)
        for p in tmp.iterdir():  # copies keep the source's mode, np.save follows the umask: a shared model is 0644
            p.chmod(0o644)
        manifest = _manifest(src, tmp, cfg, recipe, graphs, gates, text, stage_facts)
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
    return manifest


def _export_tokenizer(cfg: Any, out: Path) -> dict[str, Any]:
    """Write ``tokenizer.json`` (Hugging Face ``tokenizers`` format, CosyVoice specials included)."""
    from cosyvoice_cpu.reference.tokenizer import COSYVOICE2_SPECIALS, CosyVoice2Tokenizer

    tok = CosyVoice2Tokenizer(cfg.blank_en_dir)
    tok._tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    specials = {t: tok.token_id(t) for t in ("<|endoftext|>", *COSYVOICE2_SPECIALS)}
    return {"tokenizer": "tokenizer.json", "vocab_size": len(tok), "special_ids": specials}


def _manifest(
    src: Path,
    out: Path,
    cfg: Any,
    recipe: Recipe,
    graphs: list[GraphArtifact],
    gates: list[GateResult],
    text: dict[str, Any],
    stage_facts: dict[str, dict[str, Any]],
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
    files.update({key: FileEntry.of(out, name) for key, (name, _) in COPIED_ONNX.items()})
    lm = cfg.lm
    source_files = {
        n: {"size": (src / n).stat().st_size, "sha256": sha256_file(src / n)}
        for n in (cfg.yaml_path.name, "llm.pt", "flow.pt", "hift.pt")
    }
    return Manifest(
        format_version=FORMAT_VERSION,
        family=cfg.family,
        created_by=f"cosyvoice-cpu {__version__}",
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
            **stage_facts.get("lm", {}),
        },
        sampling=asdict(lm.sampling),
        flow={
            "n_timesteps": cfg.flow.cfm.n_timesteps,
            "cfg_rate": cfg.flow.cfm.inference_cfg_rate,
            "t_scheduler": cfg.flow.cfm.t_scheduler,
            "pre_lookahead_len": cfg.flow.pre_lookahead_len,
            "token_mel_ratio": cfg.flow.token_mel_ratio,
            "static_chunk_size": cfg.flow.encoder.static_chunk_size,  # encoder, tokens (streaming)
            "spk_embed_dim": cfg.flow.spk_embed_dim,
            **stage_facts.get("flow", {}),
        },
        hift={**cfg.hift.to_dict(), **stage_facts.get("hift", {})},
        graphs=entries,
        arrays=arrays,
        files=files,
        source={"path": str(src.resolve()), "yaml": cfg.yaml_path.name, "files": source_files},
        verification=[{**asdict(g), "passed": g.passed} for g in gates],
    )
