"""Quantization recipes: which precision each stage's graph is stored and run in.

A recipe is a named per-stage choice (:data:`RECIPES`), or a spec such as
``lm=int4,flow_estimator=int8,hift=fp32,embedding=fp16``. The exporter writes fp32 graphs, checks them against
the PyTorch reference, then applies the recipe stage by stage with the functions below and checks the
quantized graphs again with looser, recorded tolerances. The measured quality and speed of every recipe is in
docs/quantization.md (``bench/quant_report.py``).

Stage precisions:
* ``lm``: ``fp32``; ``int8`` (MatMul weights int8 per output channel with ``reduce_range``: 7-bit weights, like the
  estimator's; activations quantized per call and per tensor: ``DynamicQuantizeMatMul``; rows of a batch share one
  activation scale, so a row's output depends on its neighbours); ``int8w`` (weight-only ``MatMulNBits``, 8 bits,
  block 32, int8 compute: rows independent); ``int8w-b128`` (the same with blocks of 128: faster kernels, a small
  agreement cost); ``int4`` (4 bits, block 32).
* ``flow_estimator``: ``fp32`` or ``int8`` (dynamic, per channel, ``reduce_range`` on: 7-bit weights, safe on
  AVX2 machines without VNNI where u8s8 products saturate: see ``export.stages.INT8_WEIGHT_BITS``; the int8
  stream graph also takes its caches in float16: ``export.flow.common.half_cache_io``). Fun-CosyVoice3's
  time graph (``flow_time.onnx``, run once per Euler schedule) takes the same field: ``int8`` makes it
  weight-only ``MatMulNBits`` 8-bit, block 32 (164 MB on disk at full size instead of 568).
* ``flow_encoder``: ``fp32`` or ``int8w`` (weight-only ``MatMulNBits``, 8 bits, block 32, int8 compute like the
  LM's: 158 -> 62 MB at full size, and faster than fp32 on the prompt-plus-window call every streamed chunk makes).
* ``hift``: ``fp32`` or ``int8w`` (Conv weights stored int8 per output channel + ``DequantizeLinear``, fp32
  activations: a 4x smaller file, the same speed; see ``export.hift.common.quantize_hift_weights_int8``).
  Never the default.
* ``embedding``: the LM's embedding tables as ``fp32`` or ``fp16`` ``.npy`` (memory-mapped either way).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

STAGE_CHOICES = {
    "lm": ("fp32", "int8", "int8w", "int8w-b128", "int4"),
    "flow_estimator": ("fp32", "int8"),
    "flow_encoder": ("fp32", "int8w"),
    "hift": ("fp32", "int8w"),
    "embedding": ("fp32", "fp16"),
}


@dataclass(frozen=True)
class Recipe:
    """Per-stage precisions; ``name`` is the recipe's name or the spec it was parsed from."""

    name: str
    lm: str = "fp32"
    flow_estimator: str = "fp32"
    flow_encoder: str = "fp32"
    hift: str = "fp32"
    embedding: str = "fp32"

    def validate(self) -> None:
        for stage, choices in STAGE_CHOICES.items():
            value = getattr(self, stage)
            if value not in choices:
                raise ConfigError(f"recipe {self.name!r}: {stage}={value!r} is not one of {', '.join(choices)}")

    def stages(self) -> dict[str, str]:
        d = asdict(self)
        d.pop("name")
        return d


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("fp32"),
        Recipe("lm-int8", lm="int8"),
        Recipe("lm-int8w", lm="int8w"),
        Recipe("lm-int4", lm="int4"),
        Recipe("int8", lm="int8", flow_estimator="int8"),
        Recipe("int8w", lm="int8w", flow_estimator="int8", flow_encoder="int8w"),
        Recipe("int8w-b128", lm="int8w-b128", flow_estimator="int8", flow_encoder="int8w"),
        Recipe("int4", lm="int4", flow_estimator="int8", flow_encoder="int8w"),
        Recipe("int4-fp16emb", lm="int4", flow_estimator="int8", flow_encoder="int8w", embedding="fp16"),
        Recipe("hift-int8w", hift="int8w"),
    )
}
DEFAULT_RECIPE = "int8w"  # chosen from the measurements in docs/quantization.md ("Decisions")


def parse_recipe(text: str) -> Recipe:
    """A recipe by name (see :data:`RECIPES`) or a ``stage=precision,...`` spec (unnamed stages stay fp32)."""
    text = text.strip()
    if text in RECIPES:
        return RECIPES[text]
    if "=" not in text:
        raise ConfigError(
            f"unknown quantization recipe {text!r}: use one of {', '.join(RECIPES)} or a spec like "
            "'lm=int4,flow_estimator=int8,hift=fp32,embedding=fp16'"
        )
    fields: dict[str, str] = {}
    for part in text.split(","):
        stage, _, value = part.partition("=")
        stage, value = stage.strip(), value.strip()
        if stage not in STAGE_CHOICES:
            raise ConfigError(f"recipe spec {text!r}: unknown stage {stage!r} (stages: {', '.join(STAGE_CHOICES)})")
        fields[stage] = value
    recipe = Recipe(text, **fields)
    recipe.validate()
    return recipe


def _save(model: object, dst: Path) -> None:
    from cosyvoice_cpu.export.common import save_onnx

    save_onnx(model, dst)


def quantize_int8_dynamic(
    src: Path, dst: Path, reduce_range: bool = False, exclude: tuple[str, ...] = (), per_channel: bool = True
) -> None:
    """MatMul weights -> int8 per output channel, activations quantized at run time (``quantize_dynamic``)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    hush = _DropMessage("Please consider to run pre-processing")  # ORT's advice, logged on the root logger
    root.addFilter(hush)
    try:
        with tempfile.TemporaryDirectory(dir=Path(dst).parent) as tmp:
            out = Path(tmp) / "q.onnx"
            quantize_dynamic(
                str(src),
                str(out),
                op_types_to_quantize=["MatMul"],
                per_channel=per_channel,
                reduce_range=reduce_range,
                weight_type=QuantType.QInt8,
                nodes_to_exclude=list(exclude),
                use_external_data_format=True,
                extra_options={"MatMulConstBOnly": True},
            )
            model = onnx.load(str(out), load_external_data=True)
            sort_nodes(model.graph)
            _save(model, Path(dst))
    finally:
        root.removeFilter(hush)


def sort_nodes(graph: object) -> None:
    """Put the nodes of ``graph`` in topological order (in place), counting the outer-scope values an ``If``'s
    branches read as its inputs. Among ready nodes the original order wins.

    ORT's quantizer re-sorts a graph without looking into subgraphs, so an ``If`` whose branches read a value
    computed in the main graph (``fused_ops``' attention rewrites) can land before that value's producer. ORT
    orders a graph itself when loading it, but the ONNX checker refuses it.
    """
    import heapq

    nodes = list(graph.node)  # type: ignore[attr-defined]
    produced = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps: list[set[int]] = []
    for i, n in enumerate(nodes):
        names = set(n.input) | _outer_inputs(n)
        deps.append({produced[x] for x in names if x in produced and produced[x] != i})
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle; it cannot be ordered")
    del graph.node[:]  # type: ignore[attr-defined]
    graph.node.extend(nodes[i] for i in order)  # type: ignore[attr-defined]


def _outer_inputs(node: object) -> set[str]:
    """Names a node's subgraphs (``If`` branches, loop bodies) read without producing them."""
    out: set[str] = set()
    for attr in node.attribute:  # type: ignore[attr-defined]
        for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            local = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                out |= {x for x in set(n.input) | _outer_inputs(n) if x and x not in local}
                local |= set(n.output)
    return out


class _DropMessage(logging.Filter):
    """Drop log records whose message starts with a given text."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quantize_nbits(
    src: Path,
    dst: Path,
    bits: int = 4,
    block_size: int = 32,
    accuracy_level: int = 4,
    exclude: tuple[str, ...] = (),
    metadata: dict[str, str] | None = None,
) -> None:
    """Weight-only ``MatMulNBits`` (symmetric blocks of ``block_size``; accuracy 4 = int8 compute on x86);
    ``metadata`` entries are added to the written model's metadata (``metadata_props``)."""
    import onnx

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # that module calls logging.basicConfig(level=INFO) when imported: undo it, the CLI owns logging
    root.handlers[:] = handlers
    root.setLevel(level)
    model = onnx.load(str(src), load_external_data=True)
    quant = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=accuracy_level,
        nodes_to_exclude=list(exclude),
        op_types_to_quantize=("MatMul",),
    )
    quant.process()
    out = quant.model.model
    for key, value in (metadata or {}).items():
        entry = next((p for p in out.metadata_props if p.key == key), None) or out.metadata_props.add(key=key)
        entry.value = value
    _save(out, Path(dst))


def convert_embedding(src: Path, dst: Path, precision: str) -> None:
    """Write an embedding ``.npy`` in ``precision`` (``fp32`` copies, ``fp16`` halves the file)."""
    table = np.load(src, mmap_mode="r")
    dtype = {"fp32": np.float32, "fp16": np.float16}[precision]
    out = np.lib.format.open_memmap(dst, mode="w+", dtype=dtype, shape=table.shape)
    step = 1 << 14
    for i in range(0, table.shape[0], step):
        out[i : i + step] = table[i : i + step].astype(dtype)
    out.flush()
    del out
