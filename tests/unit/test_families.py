"""The family seam: one table of facts, one class per family, and no code outside them testing a family's name."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import cosyvoice_cpu
from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.facts import FACTS, FAMILIES, facts
from cosyvoice_cpu.families.registry import CLASSES, family_for
from cosyvoice_cpu.voices.voice import Voice

PACKAGE = Path(cosyvoice_cpu.__file__).parent


def test_every_family_in_the_table_has_one_runtime_class() -> None:
    assert set(CLASSES) == set(FAMILIES) and len(FAMILIES) == len(FACTS) == 3
    for name, cls in CLASSES.items():
        assert cls.facts is facts(name)
    with pytest.raises(ModelDirError, match=r"not supported .*cosyvoice2, cosyvoice, cosyvoice3"):
        facts("cosyvoice4")


def _name_tests(path: Path) -> list[str]:
    """``x == "cosyvoice2"``, ``x in ("cosyvoice", ...)``, ``{"cosyvoice3": ...}[x]``-style uses of a family name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        strings: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            strings = [node.left, *node.comparators]
            strings += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts]
        elif isinstance(node, ast.Dict):
            strings = [k for k in node.keys if k is not None]
        if any(isinstance(s, ast.Constant) and s.value in FAMILIES for s in strings):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_no_runtime_code_outside_the_families_tests_a_family_name() -> None:
    """The engine, stages, server and CLI ask the family object or the facts table; only ``families/`` (and the
    PyTorch side: reference, export, fixtures) may name a family."""
    skip = ("families/", "reference/", "export/", "fixtures/", "demo_model/")
    modules = [p for p in PACKAGE.rglob("*.py") if not str(p.relative_to(PACKAGE)).startswith(skip)]
    assert len(modules) > 40
    found = [hit for p in modules for hit in _name_tests(p)]
    assert not found, "family names tested outside cosyvoice_cpu.families:\n" + "\n".join(found)


def test_the_check_sees_a_name_test(tmp_path: Path) -> None:
    bad = PACKAGE / "_probe_family_check.py"
    try:
        bad.write_text('def f(m):\n    return m.family == "cosyvoice3" or {"cosyvoice": 1}\n')
        assert _name_tests(bad) == ["_probe_family_check.py:2", "_probe_family_check.py:2"]
    finally:
        bad.unlink()


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class _Manifest:
    def __init__(self, family: str) -> None:
        self.family = family


def _voice(family: str, text: str = "Hello.", builtin: bool = False) -> Voice:
    f = facts(family)
    tokens = np.zeros(0 if builtin else 10, np.int32)
    frames = 0 if builtin else (f.mel_per_token or 3) * 10
    return Voice("v", "" if builtin else text, tokens, np.zeros((frames, 80), np.float32),
                 np.ones(192, np.float32), family=family, sample_rate=f.sample_rate)  # fmt: skip


@pytest.mark.parametrize("name", FAMILIES)
def test_lm_prompt_rules_come_from_the_facts(name: str) -> None:
    f, family, tok = facts(name), family_for(_Manifest(name)), _Tokenizer()  # type: ignore[arg-type]
    voice = _voice(name)
    zero_shot = family.lm_prompt(tok, voice, None, normalize=False)
    system = (f.system_prompt + f.end_of_prompt) if f.system_prompt else ""
    assert "".join(map(chr, zero_shot.text_ids)) == system + "Hello."
    assert len(zero_shot.speech) == 10 and (zero_shot.speaker is voice.embedding) == f.lm_speaker
    instruct = family.lm_prompt(tok, voice, "Speak slowly.")
    want = (f"{f.system_prompt} Speak slowly." if f.system_prompt else "Speak slowly.") + f.end_of_prompt
    assert "".join(map(chr, instruct.text_ids)) == want and instruct.speaker is None and not len(instruct.speech)
    marked = family.lm_prompt(tok, voice, "Speak slowly." + f.end_of_prompt)
    assert "".join(map(chr, marked.text_ids)) == "Speak slowly." + f.end_of_prompt  # the marker is not doubled
    with pytest.raises(ConfigError, match="non-empty instruction"):
        family.lm_prompt(tok, voice, "  ")
    if f.builtin_speakers:
        sft = family.lm_prompt(tok, _voice(name, builtin=True), None)
        assert sft.text_ids == [] and sft.speaker is not None


def test_only_the_families_with_silent_tokens_filter_them() -> None:
    run = [1] * 9 + [7]
    for name in FAMILIES:
        family = family_for(_Manifest(name))  # type: ignore[arg-type]
        kept = family.keep_tokens(run)
        assert kept == (run if not facts(name).silent_tokens else [1] * facts(name).max_silent_run + [7])
