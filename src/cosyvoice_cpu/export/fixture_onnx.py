"""Stand-ins for the two ONNX models a CosyVoice directory ships, with the official graph contracts.

- ``campplus.onnx``: input ``input`` float32 (B, T, 80) mean-normalised Kaldi fbank at 16 kHz -> output
  ``output`` float32 (B, 192) speaker embedding. The stand-in is mean-pooling + a random projection, so
  different voices still give different embeddings.
- ``speech_tokenizer_v2.onnx``: inputs ``feats`` float32 (1, 128, T) Whisper log-mel at 100 frames/s and
  ``feats_length`` int32 (1,) -> output ``indices`` int32 (1, T // 4) at 25 tokens/s. The stand-in is a
  stride-4 convolution to 8 dimensions, each rounded to 3 levels: a finite scalar quantiser with 3^8 = 6561
  codes, the same code space as the real FSQ tokenizer.

- ``speech_tokenizer_v1.onnx`` (CosyVoice-300M): same inputs -> ``indices`` int32 (1, T // 2) at 50 tokens/s in
  [0, 4096). The stand-in is a stride-2 convolution to 12 dimensions, each reduced to its sign: 2^12 = 4096 codes.

The official frontend feeds both by position, so only order, dtypes and ranks have to match; the names are
those of the released files. Built with ``onnx.helper`` (no torch needed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _save(graph, path: Path) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="cosyvoice-cpu")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_campplus_standin(path: Path, rng: np.random.Generator) -> None:
    """Write a stand-in ``campplus.onnx`` (see module docstring for the contract)."""
    from onnx import TensorProto, helper, numpy_helper

    w = (rng.standard_normal((80, 192)) / np.sqrt(80)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input", "axes"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "proj"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 192])],
        initializer=[
            numpy_helper.from_array(w, "proj"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    _save(graph, path)


def write_speech_tokenizer_standin(path: Path, rng: np.random.Generator) -> None:
    """Write a stand-in ``speech_tokenizer_v2.onnx`` (see module docstring for the contract)."""
    from onnx import TensorProto, helper, numpy_helper

    w = (rng.standard_normal((8, 128, 4)) * 0.15).astype(np.float32)
    powers = (3 ** np.arange(8, dtype=np.float32)).reshape(1, 8, 1)
    init = {
        "w": w,
        "one": np.array(1.0, dtype=np.float32),
        "zero": np.array(0.0, dtype=np.float32),
        "two": np.array(2.0, dtype=np.float32),
        "powers": powers,
        "sum_axes": np.array([1], dtype=np.int64),
        "four": np.array([4], dtype=np.int32),
        "start": np.array([0], dtype=np.int64),
        "axis1": np.array([1], dtype=np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["feats", "w"], ["h"], kernel_shape=[4], strides=[4]),
        helper.make_node("Tanh", ["h"], ["ht"]),
        helper.make_node("Round", ["ht"], ["hr"]),  # -1, 0, 1
        helper.make_node("Add", ["hr", "one"], ["level"]),  # 0, 1, 2
        helper.make_node("Clip", ["level", "zero", "two"], ["lc"]),
        helper.make_node("Mul", ["lc", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "sum_axes"], ["code_f"], keepdims=0),
        helper.make_node("Cast", ["code_f"], ["code"], to=TensorProto.INT32),
        helper.make_node("Div", ["feats_length", "four"], ["n_tok32"]),
        helper.make_node("Cast", ["n_tok32"], ["n_tok"], to=TensorProto.INT64),
        helper.make_node("Slice", ["code", "start", "n_tok", "axis1"], ["indices"]),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_v2_standin",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "N"])],
        initializer=[numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    _save(graph, path)


def write_speech_tokenizer_v1_standin(path: Path, rng: np.random.Generator) -> None:
    """Write a stand-in ``speech_tokenizer_v1.onnx`` (see module docstring for the contract)."""
    from onnx import TensorProto, helper, numpy_helper

    w = (rng.standard_normal((12, 128, 2)) * 0.15).astype(np.float32)
    init = {
        "w": w,
        "zero": np.array(0.0, dtype=np.float32),
        "powers": (2 ** np.arange(12, dtype=np.float32)).reshape(1, 12, 1),
        "sum_axes": np.array([1], dtype=np.int64),
        "two": np.array([2], dtype=np.int32),
        "start": np.array([0], dtype=np.int64),
        "axis1": np.array([1], dtype=np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["feats", "w"], ["h"], kernel_shape=[2], strides=[2]),
        helper.make_node("Greater", ["h", "zero"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["bit"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["bit", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "sum_axes"], ["code_f"], keepdims=0),
        helper.make_node("Cast", ["code_f"], ["code"], to=TensorProto.INT32),
        helper.make_node("Div", ["feats_length", "two"], ["n_tok32"]),
        helper.make_node("Cast", ["n_tok32"], ["n_tok"], to=TensorProto.INT64),
        helper.make_node("Slice", ["code", "start", "n_tok", "axis1"], ["indices"]),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_v1_standin",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "N"])],
        initializer=[numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    _save(graph, path)
