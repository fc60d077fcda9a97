"""The deployable model directory's manifest, ``cosyvoice_cpu.json`` (schema in docs/model-format.md).

Written by ``cosyvoice-cpu export``; read by the runtime before any graph is loaded. Torch-free: NumPy and the
standard library only. Loading checks the format version, the family, that every referenced file exists and
(optionally, slow for GB-sized files) that each file's sha256 matches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.facts import FAMILIES, facts
from cosyvoice_cpu.jsontypes import JsonObject
from cosyvoice_cpu.lm_files import EMBEDDING_FILES

logger = logging.getLogger(__name__)

MANIFEST_NAME = "cosyvoice_cpu.json"
VOICES_DIR = "voices"  # built-in speakers (CosyVoice-300M-SFT/-Instruct spk2info.pt) as voice files
FORMAT_VERSION = 5  # 2: flow_estimator_stream.onnx (streamed chunks on cached activations) replaces _chunk;
# 3: its keep_frames input (the v2 stream graph also runs whole sentences: one estimator in memory);
# 4: the same for Fun-CosyVoice3 (its stream DiT takes chunk_frames, 0 = full attention, and keep_frames);
# 5: Fun-CosyVoice3's stream DiT takes its time table (modulation) from flow_time.onnx instead of t
STAGE_SECTIONS = ("text", "lm", "sampling", "flow", "hift")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class FileEntry:
    """A file of the model directory: path relative to the directory, size in bytes, sha256."""

    file: str
    size: int
    sha256: str

    @classmethod
    def of(cls, model_dir: Path, rel: str) -> FileEntry:
        path = model_dir / rel
        return cls(rel, path.stat().st_size, sha256_file(path))


@dataclass
class GraphEntry:
    """An ONNX graph: the ``.onnx`` file, its external-data files, precision and I/O contract.

    ``inputs``/``outputs`` are lists of ``{"name", "dtype", "shape"}`` (string shape entries are dynamic axes);
    ``attrs`` holds the stage facts the runtime needs (e.g. the LM's ``max_len``).
    """

    file: FileEntry
    data: list[FileEntry]
    precision: str
    inputs: list[JsonObject]
    outputs: list[JsonObject]
    attrs: JsonObject = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: JsonObject) -> GraphEntry:
        return cls(
            FileEntry(**d["file"]),
            [FileEntry(**x) for x in d.get("data", [])],
            d["precision"],
            d.get("inputs", []),
            d.get("outputs", []),
            d.get("attrs", {}),
        )

    def files(self) -> list[FileEntry]:
        return [self.file, *self.data]


@dataclass
class Manifest:
    """Everything the runtime needs to know about a model directory besides the graphs themselves.

    Attributes:
        format_version: :data:`FORMAT_VERSION` of the writer; a newer version is refused.
        family: ``cosyvoice2``, ``cosyvoice`` (CosyVoice-300M) or ``cosyvoice3`` (Fun-CosyVoice3).
        recipe: ``{"name": ..., "stages": {"lm": "int8", ...}}`` the quantization recipe used.
        sample_rate, token_frame_rate, token_mel_ratio: audio/token rates (24000, 25, 2 for CosyVoice2; 22050, 50,
            0 for CosyVoice-300M, whose length regulator has no fixed ratio).
        mel: the prompt-mel parameters (n_fft, num_mels, hop_size, win_size, fmin, fmax, sampling_rate).
        text, lm, sampling, flow, hift: per-stage facts and defaults (documented in docs/model-format.md).
        graphs: graph key -> :class:`GraphEntry` (``lm``, ``flow_encoder``, ``flow_estimator``, ...).
        arrays: array key -> :class:`FileEntry` for ``.npy`` files (embeddings, the flow noise table).
        files: other files (``tokenizer``, ``campplus``, ``speech_tokenizer``).
        source: where the export came from (path, yaml, checkpoint sizes and hashes).
        verification: the numerics-gate results of the export (graph, check, value, tolerance).
    """

    format_version: int
    family: str
    created_by: str
    recipe: JsonObject
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    mel: JsonObject
    text: JsonObject
    lm: JsonObject
    sampling: JsonObject
    flow: JsonObject
    hift: JsonObject
    graphs: dict[str, GraphEntry]
    arrays: dict[str, FileEntry]
    files: dict[str, FileEntry]
    source: JsonObject
    verification: list[JsonObject] = field(default_factory=list)

    # ------------------------------------------------------------------ io

    def to_json(self) -> JsonObject:
        return asdict(self)

    def save(self, model_dir: str | Path) -> Path:
        """Write ``cosyvoice_cpu.json`` atomically (temp file + rename)."""
        path = Path(model_dir) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, d: JsonObject, where: Path) -> Manifest:
        version = d.get("format_version")
        if not isinstance(version, int):
            raise ModelDirError(f"{where}: 'format_version' is missing; is this a cosyvoice-cpu model directory?")
        if version > FORMAT_VERSION:
            raise ModelDirError(
                f"{where} has format_version {version}, newer than this cosyvoice-cpu understands "
                f"({FORMAT_VERSION}): upgrade cosyvoice-cpu or re-export the model with this version"
            )
        if d.get("family") not in FAMILIES:
            raise ModelDirError(f"{where}: family {d.get('family')!r} is not supported (supported: {FAMILIES})")
        if version < facts(d["family"]).oldest_readable:
            raise ModelDirError(
                f"{where} has format_version {version}, from an older cosyvoice-cpu (this one writes "
                f"{FORMAT_VERSION}): export the model directory again with `cosyvoice-cpu export`"
            )
        try:
            return cls(
                format_version=version,
                family=d["family"],
                created_by=d.get("created_by", ""),
                recipe=d["recipe"],
                sample_rate=int(d["sample_rate"]),
                token_frame_rate=int(d["token_frame_rate"]),
                token_mel_ratio=int(d["token_mel_ratio"]),
                mel=d["mel"],
                **{k: d[k] for k in STAGE_SECTIONS},
                graphs={k: GraphEntry.from_json(v) for k, v in d["graphs"].items()},
                arrays={k: FileEntry(**v) for k, v in d["arrays"].items()},
                files={k: FileEntry(**v) for k, v in d["files"].items()},
                source=d.get("source", {}),
                verification=d.get("verification", []),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelDirError(f"{where} is malformed ({type(e).__name__}: {e}); re-export the model") from e

    @classmethod
    def load(cls, model_dir: str | Path, check_hashes: bool = False) -> Manifest:
        """Read and validate the manifest of ``model_dir``.

        Args:
            model_dir: a directory written by ``cosyvoice-cpu export``.
            check_hashes: also recompute every file's sha256 (reads every byte: seconds per GB).
        Raises:
            ModelDirError: missing/malformed manifest, unsupported version or family, missing or altered files.
        """
        model_dir = Path(model_dir)
        path = model_dir / MANIFEST_NAME
        if not path.is_file():
            hint = ""
            if any(model_dir.glob("*.yaml")) and (model_dir / "llm.pt").exists():
                hint = f" It looks like an official CosyVoice directory: run `cosyvoice-cpu export --from {model_dir}"
                hint += " --to MODEL_DIR` first."
            raise ModelDirError(f"{path} not found: {model_dir} is not a cosyvoice-cpu model directory.{hint}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelDirError(f"{path} is not readable JSON ({e}); re-export the model") from e
        if not isinstance(data, dict):
            raise ModelDirError(f"{path} must hold a JSON object; re-export the model")
        manifest = cls.from_json(data, path)
        manifest.check_files(model_dir, check_hashes)
        return manifest

    # ------------------------------------------------------------------ checks

    def all_files(self) -> list[FileEntry]:
        out = [f for g in self.graphs.values() for f in g.files()]
        return out + list(self.arrays.values()) + list(self.files.values())

    def resident_bytes(self, streaming_estimator: bool = True) -> int:
        """Bytes of the files a synthesizing engine keeps in memory (what the memory warnings weigh): all of them
        but the speech tokenizer (opened only to make voices), the text and speech embedding tables (read row by
        row, never mapped: ``row_table``; 544 and 23 MB at full size) and, on CosyVoice2 and Fun-CosyVoice3 with
        the stream graph loaded, ``flow_estimator.onnx`` (whole sentences run on the stream graph; it opens only
        for padded batches; 94 / 344 MB at full size int8) and Fun-CosyVoice3's ``flow_time.onnx`` (opened once
        per Euler schedule and closed, :meth:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow.time_table`). OpenVINO
        models (``*_ov``) are not counted: an engine runs a graph on one backend, and a compiled model's size is
        not its file's (``EngineConfig.compiled_shapes``)."""

        skip = {EMBEDDING_FILES["text"], EMBEDDING_FILES["speech"]}
        for key, graph in self.graphs.items():
            if key.endswith("_ov"):
                skip.update(f.file for f in graph.files())
        if streaming_estimator and "flow_estimator_stream" in self.graphs:  # whole sentences run on it too
            skip.update(f.file for f in self.graphs["flow_estimator"].files())
        if "flow_time" in self.graphs:
            skip.update(f.file for f in self.graphs["flow_time"].files())
        return sum(f.size for f in self.all_files() if f.file not in skip and not f.file.startswith("speech_tokenizer"))

    def check_files(self, model_dir: Path, check_hashes: bool = False) -> None:
        """Every referenced file exists with the recorded size (and sha256 when ``check_hashes``)."""
        problems = []
        for entry in self.all_files():
            path = model_dir / entry.file
            if not path.is_file():
                problems.append(f"{entry.file} is missing")
            elif path.stat().st_size != entry.size:
                problems.append(f"{entry.file} has {path.stat().st_size} bytes, the manifest says {entry.size}")
            elif check_hashes and sha256_file(path) != entry.sha256:
                problems.append(f"{entry.file} does not match its sha256 in the manifest")
        if problems:
            raise ModelDirError(
                f"{model_dir} is incomplete or altered: " + "; ".join(problems) + ". Re-export the model directory."
            )

    def path(self, model_dir: str | Path, key: str) -> Path:
        """Absolute path of graph ``key``'s ``.onnx`` file, array ``key``, or file ``key``."""
        for table in (self.graphs, self.arrays, self.files):
            if key in table:
                entry = table[key]
                return Path(model_dir) / (entry.file.file if isinstance(entry, GraphEntry) else entry.file)
        raise ModelDirError(f"the manifest has no graph, array or file named {key!r}")
