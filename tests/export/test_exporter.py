"""``cosyvoice-cpu export`` end to end on the tiny fixture: the model directory, its manifest, its gates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.cli.main import main
from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.export.common import GateResult
from cosyvoice_cpu.export.quantize import DEFAULT_RECIPE, RECIPES
from cosyvoice_cpu.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from cosyvoice_cpu.workshop import export_stages as stages
from cosyvoice_cpu.workshop.exporter import ExportError, ExportOptions, export_model
from tests.export.onnx_nodes import nbits_accuracy


def _ops(path: Path) -> set[str]:
    import onnx

    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


GRAPHS = {"lm", "flow_encoder", "flow_estimator", "flow_estimator_stream", "hift_f0", "hift_decode"}


@pytest.fixture(scope="module")
def exported(tiny_export_dir: Path) -> Path:
    return tiny_export_dir


def test_progress_is_reported_stage_by_stage(tiny_model_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    export_model(tiny_model_dir, tmp_path / "m", ExportOptions(recipe="fp32", max_len=128), progress=lines.append)
    stages = ["LM: loading", "LM: numerics gate", "flow: writing", "HiFT: numerics gate", "tokenizer", "done:"]
    positions = [next(i for i, line in enumerate(lines) if s in line) for s in stages]
    assert positions == sorted(positions) and lines[-1].startswith("[") and "checks passed" in lines[-1]


def test_model_directory_is_complete_and_self_describing(exported: Path, tiny_model_dir: Path) -> None:
    m = Manifest.load(exported, check_hashes=True)
    assert m.family == "cosyvoice2" and m.format_version == FORMAT_VERSION == 5
    assert m.recipe["name"] == DEFAULT_RECIPE and m.recipe["stages"] == RECIPES[DEFAULT_RECIPE].stages()
    assert set(m.graphs) == GRAPHS
    assert m.graphs["lm"].precision == RECIPES[DEFAULT_RECIPE].lm
    assert m.graphs["hift_decode"].precision == "fp32"
    expected_lm_op = {"int8": "DynamicQuantizeLinear", "int8w": "MatMulNBits", "int4": "MatMulNBits"}
    assert expected_lm_op[RECIPES[DEFAULT_RECIPE].lm] in _ops(exported / "lm.onnx")
    assert "DynamicQuantizeLinear" in _ops(exported / "flow_estimator.onnx")
    assert "DynamicQuantizeLinear" in _ops(exported / "flow_estimator_stream.onnx")
    assert "MatMulNBits" in _ops(exported / "flow_encoder.onnx") and m.graphs["flow_encoder"].precision == "int8w"
    # int8 compute: accuracy level 1 (fp32) widens every weight on each streamed chunk's encoder call
    assert nbits_accuracy(exported / "flow_encoder.onnx") == {4}
    assert {"lm_text_embedding", "lm_speech_embedding", "lm_special_embedding", "flow_noise"} <= set(m.arrays)
    assert (m.sample_rate, m.token_frame_rate, m.token_mel_ratio) == (24000, 25, 2)
    assert m.lm["stop_ids"] == [6561, 6562, 6563] and m.graphs["lm"].attrs["max_len"] == 256
    assert m.flow["n_timesteps"] == 10 and m.flow["cfg_rate"] == 0.7 and m.flow["static_chunk_size"] == 25
    assert m.sampling["top_k"] == 25 and m.hift["sampling_rate"] == 24000
    assert m.source["files"]["llm.pt"]["size"] == (tiny_model_dir / "llm.pt").stat().st_size
    # every gate ran and passed: fp32 graphs, then the recipe's quantized graphs with their own tolerances
    assert m.verification and all(v["passed"] for v in m.verification)
    fp32 = {v["graph"] for v in m.verification if v["phase"] == "fp32"}
    assert fp32 == {"lm", "flow_encoder", "flow_estimator", "flow_estimator_stream", "flow", "hift_f0", "hift_source",
                    "hift_decode", "hift"}  # fmt: skip
    recipe = RECIPES[DEFAULT_RECIPE]
    quantized = {(v["graph"], v["check"]): v["tolerance"] for v in m.verification if v["phase"] != "fp32"}
    assert quantized[("lm", "decode_kl")] == stages.QUANT_TOLERANCE[f"lm:{recipe.lm}"]["decode_kl"]
    flow_key = stages.gate_key({"flow_estimator": recipe.flow_estimator, "flow_encoder": recipe.flow_encoder})
    assert flow_key == "flow_estimator:int8+flow_encoder:int8w"
    assert quantized[("flow", "mel rel err")] == stages.QUANT_TOLERANCE[flow_key]["mel"]
    assert quantized[("flow_encoder", "mu rel err")] == stages.QUANT_TOLERANCE[flow_key]["encoder"]
    # graph I/O recorded from the files themselves
    lm_inputs = {i["name"] for i in m.graphs["lm"].inputs}
    assert {"inputs_embeds", "seqlens_k", "total_sequence_length", "past_key_0"} <= lm_inputs
    est = [i["name"] for i in m.graphs["flow_estimator"].inputs]
    assert est == ["x", "mask", "mu", "t", "spks", "cond"]
    # front-end models copied byte for byte; nothing else left behind
    for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
        assert (exported / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    listed = {f.file for f in m.all_files()} | {MANIFEST_NAME}
    assert {p.name for p in exported.iterdir()} == listed
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in exported.iterdir())


def test_tokenizer_needs_no_torch_and_matches_the_reference(exported: Path, tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    from cosyvoice_cpu.reference.tokenizer import CosyVoice2Tokenizer

    m = Manifest.load(exported)
    ours = Tokenizer.from_file(str(m.path(exported, "tokenizer")))
    ref = CosyVoice2Tokenizer(tiny_model_dir / "CosyVoice-BlankEN")
    for text in ("Hello world, 你好世界!", "[laughter] it <strong>is</strong> fine<|endofprompt|>ok", "a  b\n\nc"):
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(text)
    assert m.text["special_ids"]["<|endofprompt|>"] == ref.token_id("<|endofprompt|>")
    assert m.text["vocab_size"] == len(ref) == ours.get_vocab_size()


def test_manifest_catches_missing_altered_and_foreign_directories(exported: Path, tmp_path: Path) -> None:
    d = tmp_path / "copy"
    shutil.copytree(exported, d)
    (d / "hift_f0.onnx.data").write_bytes(b"x" * (d / "hift_f0.onnx.data").stat().st_size)  # same size
    Manifest.load(d)  # sizes agree: only the hash check sees it
    with pytest.raises(ModelDirError, match=r"hift_f0\.onnx\.data does not match its sha256"):
        Manifest.load(d, check_hashes=True)
    (d / "flow_noise.npy").unlink()
    with pytest.raises(ModelDirError, match=r"flow_noise\.npy is missing.*Re-export"):
        Manifest.load(d)
    data = json.loads((d / MANIFEST_NAME).read_text())
    (d / MANIFEST_NAME).write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(ModelDirError, match="format_version 99, newer"):
        Manifest.load(d)
    (d / MANIFEST_NAME).write_text(json.dumps({**data, "format_version": 1}))
    with pytest.raises(ModelDirError, match=r"format_version 1, from an older.*export the model directory again"):
        Manifest.load(d)
    # formats 4 and 5 changed only Fun-CosyVoice3's graphs: a CosyVoice2 directory of format 3 still loads
    assert Manifest.from_json({**data, "format_version": 3}, d / MANIFEST_NAME).format_version == 3
    with pytest.raises(ModelDirError, match=r"format_version 4, from an older.*export the model directory again"):
        Manifest.from_json({**data, "family": "cosyvoice3", "format_version": 4}, d / MANIFEST_NAME)
    (d / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ModelDirError, match="not readable JSON"):
        Manifest.load(d)


def test_official_directory_is_pointed_to_export(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelDirError, match="cosyvoice-cpu export --from"):
        Manifest.load(tiny_model_dir)


def test_failed_gate_discards_the_export_and_keeps_the_old_one(
    exported: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "model"
    shutil.copytree(exported, dst)
    before = (dst / MANIFEST_NAME).read_bytes()
    import cosyvoice_cpu.export.hift.cosyvoice as hift_graph

    failing = [GateResult("hift_decode", "decode max rel err", 0.5, 1e-5)]
    monkeypatch.setattr(hift_graph, "verify_hift", lambda *a, **k: failing)
    with pytest.raises(ExportError, match=r"numerics gate failed.*hift_decode \[fp32\]: decode max rel err = 0\.5"):
        export_model(tiny_model_dir, dst, ExportOptions(recipe="fp32", force=True, max_len=256))
    assert (dst / MANIFEST_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_cli_export_with_a_recipe_spec(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "m"
    spec = "lm=int4,embedding=fp16,hift=int8w"
    assert main(["export", "--from", str(tiny_model_dir), "--to", str(dst), "--quant", spec, "--max-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "HiFT: numerics gate (int8w vs PyTorch)" in out and "done:" in out
    m = Manifest.load(dst)
    assert m.recipe["stages"] == {
        "lm": "int4",
        "flow_estimator": "fp32",
        "flow_encoder": "fp32",
        "hift": "int8w",
        "embedding": "fp16",
    }
    assert np.load(dst / "lm_text_embedding.npy", mmap_mode="r").dtype == np.float16
    assert m.graphs["hift_decode"].precision == "int8w" and m.graphs["flow_estimator"].precision == "fp32"
    # the graphs really are what the manifest says
    assert "MatMulNBits" in _ops(dst / "lm.onnx")
    import onnx  # the int4 LM asks the runtime for two rows per call (lm.LMSession's min_rows)

    meta = {p.key: p.value for p in onnx.load(str(dst / "lm.onnx"), load_external_data=False).metadata_props}
    assert meta.get("min_rows") == "2"
    assert "DequantizeLinear" in _ops(dst / "hift_decode.onnx") and "DequantizeLinear" not in _ops(dst / "hift_f0.onnx")
    assert not {"MatMulNBits", "DynamicQuantizeLinear"} & _ops(dst / "flow_estimator.onnx")
    # a second export without --force is refused, with --force it replaces the directory
    assert main(["export", "--from", str(tiny_model_dir), "--to", str(dst), "--quant", "fp32"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["export", "--from", str(tiny_model_dir), "--to", str(dst), "--quant", "fp32", "--force",
                 "--no-verify", "--max-len", "128"]) == 0  # fmt: skip
    m = Manifest.load(dst)
    assert m.recipe["name"] == "fp32" and m.verification == []


def test_lm_block_128_recipe(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``lm=int8w-b128``: the LM's MatMulNBits use blocks of 128 (the faster kernels), gated like int8w."""
    import onnx

    dst = tmp_path / "m"
    export_model(tiny_model_dir, dst, ExportOptions(recipe="lm=int8w-b128", max_len=128))
    m = Manifest.load(dst)
    assert m.graphs["lm"].precision == "int8w-b128" and all(g["passed"] for g in m.verification)
    assert "int8w-b128, fp32 embeddings" in {g["phase"] for g in m.verification}
    nodes = [n for n in onnx.load(str(dst / "lm.onnx"), load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]  # fmt: skip
    blocks = {a.i for n in nodes for a in n.attribute if a.name == "block_size"}
    assert nodes and blocks == {128}


def test_dynamic_int8_weights_have_7_bits_everywhere(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``lm=int8`` and the estimators' int8 store weights in [-64, 64] (two u8 x s8 products sum to at most
    2 * 255 * 64 = 32640, inside int16): full 8-bit weights saturate on CPUs without VNNI
    (stages.INT8_WEIGHT_BITS). The manifest records the bits; an older 8-bit LM export gets a warning on such a
    CPU."""
    import onnx
    from onnx import numpy_helper

    from cosyvoice_cpu.hardware.cpu import CpuInfo, Hardware

    dst = tmp_path / "m"
    export_model(tiny_model_dir, dst, ExportOptions(recipe="lm=int8,flow_estimator=int8", max_len=128))
    m = Manifest.load(dst)
    assert all(g["passed"] for g in m.verification)
    int8 = {k: g for k, g in m.graphs.items() if g.precision == "int8"}
    assert set(int8) == {"lm", "flow_estimator", "flow_estimator_stream"}
    for key, g in int8.items():
        model = onnx.load(str(dst / g.file.file))
        weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        b = [weights[n.input[1]] for n in model.graph.node if n.op_type == "MatMulInteger" and n.input[1] in weights]
        assert b and all(w.dtype == np.int8 and np.abs(w.astype(int)).max() <= 64 for w in b), key
        assert g.attrs["int8_weight_bits"] == stages.INT8_WEIGHT_BITS == 7
    avx2 = Hardware(CpuInfo("Zen 3", frozenset({"sse2", "avx2", "fma"}), 2, 2), 2, None, None, None, None)
    vnni = Hardware(CpuInfo("Zen 4", frozenset({"sse2", "avx2", "fma", "avx512f", "avx512_vnni"}), 2, 2), 2, None,
                    None, None, None)  # fmt: skip
    assert avx2.model_warnings(m) == [] and vnni.model_warnings(m) == []
    del m.graphs["lm"].attrs["int8_weight_bits"]  # as written before the 7-bit change
    (warning,) = avx2.model_warnings(m)
    assert warning.startswith("lm: int8 weights with 8 bits on a CPU without VNNI (Zen 3)") and "Re-export" in warning
    assert vnni.model_warnings(m) == []
