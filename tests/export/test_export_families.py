"""The export's family seam (cosyvoice_cpu.export.families, read through cosyvoice_cpu.workshop.parts): one object per
family of the facts table, owning what the export does differently, so the exporter, the stage runner and the LM gate
never test a family's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cosyvoice_cpu.errors import ExportError
from cosyvoice_cpu.export.families import ExportCosyVoice, ExportCosyVoice3
from cosyvoice_cpu.facts import FAMILIES, facts
from cosyvoice_cpu.workshop.parts import PARTS, export_family

PACKAGE = Path(__file__).parents[2] / "src" / "cosyvoice_cpu"
BLANK_EN = ("CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt",
            "CosyVoice-BlankEN/tokenizer_config.json")  # fmt: skip


def test_one_export_object_per_family_of_the_facts_table() -> None:
    assert tuple(PARTS) == FAMILIES
    for name in FAMILIES:
        fam = export_family(name)
        assert fam.name == name and fam.facts is facts(name)
    assert isinstance(export_family("cosyvoice"), ExportCosyVoice)
    assert isinstance(export_family("cosyvoice3"), ExportCosyVoice3)
    with pytest.raises(ExportError, match="export supports cosyvoice2, cosyvoice, cosyvoice3"):
        export_family("cosyvoice9")


@pytest.mark.parametrize(
    ("family", "required"),
    [
        ("cosyvoice2", ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", *BLANK_EN)),
        ("cosyvoice", ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v1.onnx")),
        ("cosyvoice3", ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx", *BLANK_EN)),
    ],
)
def test_source_files_come_from_the_facts(family: str, required: tuple[str, ...]) -> None:
    fam = export_family(family)
    assert fam.required_files() == required
    assert fam.copied_onnx() == {"campplus": "campplus.onnx", "speech_tokenizer": facts(family).speech_tokenizer}


@pytest.mark.parametrize(
    ("family", "modules", "lm_graphs", "flow_graphs"),
    [
        ("cosyvoice2", ("lm.cosyvoice2", "flow.cosyvoice2", "hift.cosyvoice"), {"lm"},
         {"flow_estimator", "flow_estimator_stream", "flow_encoder"}),
        ("cosyvoice", ("lm.cosyvoice", "flow.cosyvoice", "hift.cosyvoice"), {"lm", "lm_text_encoder"},
         {"flow_estimator", "flow_encoder"}),
        ("cosyvoice3", ("lm.cosyvoice3", "flow.cosyvoice3", "hift.cosyvoice3"), {"lm"},
         {"flow_estimator", "flow_estimator_stream", "flow_encoder", "flow_time"}),
    ],
)  # fmt: skip
def test_each_family_names_its_graph_modules(family: str, modules: tuple, lm_graphs: set, flow_graphs: set) -> None:
    plans = export_family(family).plans
    assert tuple(p.graphs().__name__.removeprefix("cosyvoice_cpu.export.") for p in plans) == modules
    assert [p.ref for p in plans] == ["lm", "flow", "hift"]
    assert set(plans[0].quantized) == lm_graphs and set(plans[1].quantized) == flow_graphs
    assert plans[2].quantized == {"hift_decode": "hift"}
    for p in plans:
        module = p.graphs()
        assert callable(getattr(module, f"export_{p.ref}")) and callable(getattr(module, f"verify_{p.ref}"))


def test_each_lm_graph_module_gives_the_gate_its_family(tmp_path: Path) -> None:
    """The LM gate is told the family by the graph module (no sniffing of the reference LM's attributes)."""
    for name in FAMILIES:
        fam = export_family(name)
        gate = fam.plans[0].graphs().GATE
        assert gate.facts is facts(name)
        assert gate.text_encoder == facts(name).lm_speaker == facts(name).builtin_speakers  # CosyVoice-300M only
        if not facts(name).builtin_speakers:
            assert fam.export_speakers(None, tmp_path) == []


def test_v3_manifest_lm_facts() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(min_len_masked_id=6561, endofprompt_id=151646)
    assert export_family("cosyvoice3").lm_facts(cfg) == {"min_len_masked_id": 6561, "endofprompt_id": 151646}
    assert export_family("cosyvoice2").lm_facts(cfg) == export_family("cosyvoice").lm_facts(cfg) == {}


@pytest.mark.parametrize(
    "name",
    [
        "workshop/exporter.py",
        "workshop/export_stages.py",
        "export/lm/common.py",
        "export/lm/cosyvoice.py",
        "export/lm/cosyvoice2.py",
        "export/lm/cosyvoice3.py",
    ],
)
def test_the_export_never_tests_a_family_name(name: str) -> None:
    source = (PACKAGE / name).read_text(encoding="utf-8")
    assert not re.findall(r"family *(==|!=|in |not in)|\.family *(==|!=)|hasattr\(", source)
