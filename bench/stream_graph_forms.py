"""The CosyVoice2 stream estimator on ONNX Runtime: the shipped graph form against three others, per call.

    python bench/stream_graph_forms.py --from OFFICIAL_DIR --work WORK [--forms fused-kv,plain,kv-cache] \
        [--threads 1,2] [--runs 12] [--prompt 150]

A first streamed chunk spends about half its time on the prompt frames every call attends to (the keys/values
projection, ``MultiHeadAttention`` and the caches' ``Concat``/``Cast``: ``bench/ort_profile.py`` with and without
``--dim prompt_frames=150``; figures in docs/streaming.md, "Graph forms measured and not taken"). This traces the stream
graph of a full-size official CosyVoice2 directory in four forms, each quantized as the ``int8w`` export does
(``quantize_int8_dynamic`` with 7-bit weights, float16 caches):

- ``default``: the shipped form (the caches hold each block's ``norm1`` outputs; keys and values are two
  ``MatMul``; attention is one ``com.microsoft.MultiHeadAttention``);
- ``fused-kv``: keys and values as one ``MatMul`` on the concatenated weights, split after (per-channel weights
  and one activation scale per input: the int8 graph's outputs are bit-identical to ``default``'s);
- ``plain``: attention as ``MatMul -> Softmax -> MatMul`` (the whole-sentence OpenVINO form);
- ``kv-cache``: the prompt cache holds each block's keys and values instead of ``norm1`` (4x its memory), so a call
  projects only the context and the chunk.

The forms take turns on random feeds at the default chunk plan's shapes (20 new frames on the prompt alone, then
40/60/100 after 50 frames of context), per ``--threads``: 1 thread with one row (a call of the engine's split rows,
``EngineConfig.split_rows``) and 2 threads with both CFG rows (one call). Prints per shape the median ms of each
form, its ratio to ``default`` (> 1: faster) and, for the exact forms, the largest output difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

FORMS = ("default", "fused-kv", "plain", "kv-cache")
EXACT = ("fused-kv",)  # same arithmetic as default in int8 (fp32: up to GEMM rounding)
SHAPES = ((20, 0), (40, 50), (60, 50), (100, 50))  # (new frames, context frames) of the default chunk plan


def _attention(form: str) -> Any:
    """The ``fused_ops.self_attention`` replacement of ``form`` (None: the shipped one)."""
    import torch

    from cosyvoice_cpu.export.fused_ops import attention

    def fused(a: Any, x: Any, keys: Any, key_mask: Any = None) -> Any:
        a = getattr(a, "inner", a)
        k, v = torch.nn.functional.linear(keys, torch.cat([a.to_k.weight, a.to_v.weight])).chunk(2, dim=-1)
        scale = (a.to_q.out_features // a.heads) ** -0.5
        return a.to_out[0](attention(a.to_q(x), k, v, a.heads, scale, key_mask=key_mask))

    def plain(a: Any, x: Any, keys: Any, key_mask: Any = None) -> Any:
        a = getattr(a, "inner", a)
        q, k, v = a.to_q(x), a.to_k(keys), a.to_v(keys)
        b, t, c = q.shape
        d = c // a.heads
        q = q.reshape(b, t, a.heads, d).transpose(1, 2) * d**-0.5
        k = k.reshape(b, -1, a.heads, d).permute(0, 2, 3, 1)
        v = v.reshape(b, -1, a.heads, d).transpose(1, 2)
        return a.to_out[0]((torch.softmax(q @ k, dim=-1) @ v).transpose(1, 2).reshape(b, t, c))

    return {"fused-kv": fused, "plain": plain}.get(form)


def _kv_cache_graph(est: Any) -> Any:
    """The stream graph whose ``prompt_h`` input is (L, B, P, 2 * inner): each block's prompt keys|values."""
    import torch

    from cosyvoice_cpu.export.flow import cosyvoice2_stream as cs
    from cosyvoice_cpu.export.fused_ops import attention

    class Run(cs._Run):
        def __init__(self, prompt_kv: Any, context: Any, conv_state: Any, keep: Any) -> None:
            super().__init__(context, conv_state, keep)
            self.prompt_kv = prompt_kv

        def transformer(self, block: Any, x: Any) -> Any:
            n = block.norm1(x)
            self.new_h.append(n.index_select(1, self.keep))
            keys = torch.cat([self.past[self.block], n], dim=1)
            pk, pv = self.prompt_kv[self.block].chunk(2, dim=-1)
            self.block += 1
            a = getattr(block.attn1, "inner", block.attn1)
            k, v = torch.cat([pk, a.to_k(keys)], 1), torch.cat([pv, a.to_v(keys)], 1)
            x = x + a.to_out[0](attention(a.to_q(n), k, v, a.heads, (a.to_q.out_features // a.heads) ** -0.5))
            h = block.norm3(x)
            for layer in block.ff.net:
                h = layer(h)
            return x + h

    class Graph(cs.StreamEstimatorGraph):
        def forward(self, x, mu, t, spks, cond, prompt_h, context_h, conv_state, keep_frames):  # type: ignore[no-untyped-def]
            run = Run(prompt_h, context_h, conv_state, cs.kept_frames(x, keep_frames))
            return self.estimate(run, x, mu, t, spks, cond)

    return Graph(est)


def _inner(est: Any) -> int:
    """The width of one block's keys (heads x head size)."""
    block = next(m for m in est.modules() if hasattr(m, "attn1"))
    return int(getattr(block.attn1, "inner", block.attn1).to_k.out_features)


def export(src: Path, work: Path, forms: list[str]) -> None:
    """Trace, quantize (int8w's estimator recipe) and give float16 caches to each form: ``WORK/FORM/s.onnx``."""
    import torch

    from cosyvoice_cpu.export import fused_ops
    from cosyvoice_cpu.export.flow import cosyvoice2_stream as cs
    from cosyvoice_cpu.export.flow.common import cache_io, half_cache_io
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic
    from cosyvoice_cpu.reference.loaders import COSYVOICE2

    model = COSYVOICE2.load(src, stages=("flow",))
    shipped = fused_ops.self_attention
    for form in forms:
        dst = work / form / "s.onnx"
        if dst.is_file():
            continue
        fp32 = work / f"{form}-fp32" / "s.onnx"
        fp32.parent.mkdir(parents=True, exist_ok=True)
        dst.parent.mkdir(parents=True, exist_ok=True)
        fused_ops.self_attention = _attention(form) or shipped
        try:
            with torch.no_grad(), fused_ops.export_forms(model.flow.decoder.estimator) as est:
                if form == "kv-cache":
                    feeds = cs.example_inputs(est, np.random.default_rng(0), 2, 19, 11, 7)
                    width = 2 * _inner(est)
                    feeds["prompt_h"] = np.zeros((*feeds["prompt_h"].shape[:3], width), np.float32)
                    feeds["keep_frames"] = np.array(6, np.int64)
                    args = tuple(torch.from_numpy(feeds[k]) for k in cs.INPUTS)
                    cs.torch_export(
                        _kv_cache_graph(est), args, fp32, input_names=cs.INPUTS, output_names=cs.OUTPUTS,
                        dynamic_axes=cs.DYNAMIC_AXES,
                    )  # fmt: skip
                else:
                    cs.export_stream_estimator(est, fp32)
        finally:
            fused_ops.self_attention = shipped
        quantize_int8_dynamic(fp32, dst, reduce_range=True)
        half_cache_io(dst, *cache_io(set(cs.INPUTS)))  # type: ignore[misc]


def _feeds(path: Path, rows: int, size: int, prompt: int, context: int) -> dict[str, np.ndarray]:
    """Random feeds for the graph at ``path`` in its own input types and static widths (``kv-cache``'s
    ``prompt_h`` is 2 x inner wide)."""
    import onnx

    rng = np.random.default_rng(0)
    feeds = {}
    for value in onnx.load(str(path), load_external_data=False).graph.input:
        named = {"batch": rows, "prompt_frames": prompt, "context_frames": context}
        dims = [
            d.dim_value if not d.dim_param else named.get(d.dim_param, size) for d in value.type.tensor_type.shape.dim
        ]
        kind = value.type.tensor_type.elem_type
        if kind == onnx.TensorProto.INT64:
            feeds[value.name] = np.array(size, np.int64)
        else:
            dtype = np.float16 if kind == onnx.TensorProto.FLOAT16 else np.float32
            feeds[value.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def speed(work: Path, forms: list[str], threads: list[int], runs: int, prompt: int) -> None:
    import onnxruntime as ort

    for n in threads:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = n, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the engine opens them
        sessions = {f: ort.InferenceSession(str(work / f / "s.onnx"), options) for f in forms}
        rows = 1 if n == 1 else 2
        for size, context in SHAPES:
            feeds = {f: _feeds(work / f / "s.onnx", rows, size, prompt, context) for f in forms}
            outs = {f: s.run(None, feeds[f]) for f, s in sessions.items()}
            times: dict[str, list[float]] = {f: [] for f in forms}
            for _ in range(runs):
                for f, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(None, feeds[f])
                    times[f].append(time.perf_counter() - t0)
            base = statistics.median(times["default"])
            cells = []
            for f in forms:
                med = statistics.median(times[f])
                cell = f"{f} {med * 1000:.1f} ms ({base / med:.2f}x)"
                if f in EXACT:
                    diff = max(float(np.abs(a.astype(np.float32) - b).max()) for a, b in zip(outs[f], outs["default"]))
                    cell += f" max diff {diff:.1e}"
                cells.append(cell)
            print(f"{n} thread(s), {rows} row(s), {size} new frames after {prompt} + {context}: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", type=Path, required=True, help="a full-size official CosyVoice2 directory")
    ap.add_argument("--work", type=Path, required=True, help="where the forms' graphs go (kept between runs)")
    ap.add_argument("--forms", default="fused-kv,plain,kv-cache")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=150, help="prompt frames (150: a 3 s voice)")
    args = ap.parse_args()
    forms = ["default", *[f for f in args.forms.split(",") if f and f != "default"]]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        ap.error(f"--forms takes {', '.join(FORMS[1:])}, not {', '.join(unknown)}")
    export(args.src, args.work, forms)
    speed(args.work, forms, [int(t) for t in args.threads.split(",")], args.runs, args.prompt)


if __name__ == "__main__":
    main()
