"""The v1 (Whisper tiktoken) tokenizer converter on the synthetic fixture asset, the ranks parser, find_tiktoken."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

from cosyvoice_cpu.errors import ExportError
from cosyvoice_cpu.export.tokenizer import cosyvoice as tw
from cosyvoice_cpu.fixtures.tokenizer import write_fixture_tiktoken
from cosyvoice_cpu.text.tokenizer import TextTokenizer

MIXED = [
    "Hello, this is a test of the text to speech engine.",
    "我们的工厂网关会在没有网络的情况下播报报警信息。",
    "こんにちは、音声合成のテストです。",
    "안녕하세요, 감사합니다.",
    "<|zh|>三号生产线温度过高<|en|>please check the valve now.",
    "<|ja|>警報<|ko|>음성<|yue|>你好嘢<|endoftext|>",
    "Numbers 1, 25, 100 and 2026; 3.14159 — ok?",
    "  leading and   runs of   spaces\n\nnew lines\ttabs \r\n",
    "emoji 😀🎉 and ümlaut façade",
    "It's what we'll do, they've said; I'm sure you'd agree.",
    "Mixed混合text文本123数字!?",
    "<endofprompt>",
    "<|endofprompt|>",
    "<|not a tag|> <|zh| |zh|>",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, TextTokenizer]:
    """(asset, manifest text section, runtime tokenizer) for the seed-0 fixture asset."""
    d = tmp_path_factory.mktemp("whisper_tok")
    asset = d / tw.WHISPER_ASSET
    write_fixture_tiktoken(asset, seed=0)
    section = tw.write_whisper_tokenizer(asset, d)
    return asset, section, TextTokenizer.from_file(d / section["tokenizer"])


def test_fixture_asset_and_manifest_section(converted) -> None:
    asset, section, tok = converted
    ranks = tw.read_ranks(asset)
    assert 500 < len(ranks) < 1000 and ranks[b""] == len(ranks) - 1  # bytes, merges, then the placeholder
    specials = tw.special_tokens("whisper")
    assert len(specials) == 1609 and section["vocab_size"] == len(ranks) + 1609 < 51866
    assert set(section) == {"tokenizer", "kind", "vocab_size", "special_ids"} and section["kind"] == "whisper"
    n = len(ranks)
    assert section["special_ids"] == {"<|endoftext|>": n, "<|en|>": n + 2, "<|zh|>": n + 3, "<|ko|>": n + 7,
                                      "<|ja|>": n + 9, "<|yue|>": n + 101}  # fmt: skip
    assert tok.vocab_size == section["vocab_size"]
    tok.check_manifest(section["special_ids"])
    assert tok.special_id("<|0.00|>") == n + 108 and tok.special_id("<|30.00|>") == section["vocab_size"] - 1


@pytest.mark.parametrize("text", MIXED)
def test_round_trip_and_specials_in_text(converted, text: str) -> None:
    _, section, tok = converted
    ids = tok.encode(text)
    assert max(ids) < section["vocab_size"]
    assert tok.decode(ids, skip_special_tokens=False) == text
    for tag, tid in section["special_ids"].items():
        assert ids.count(tid) == text.count(tag)


def test_tags_split_text_and_markers_are_plain(converted) -> None:
    _, section, tok = converted
    sid = section["special_ids"]
    assert tok.encode("") == []
    ids = tok.encode("<|zh|>你好<|en|>hi")
    assert ids[0] == sid["<|zh|>"] and ids[ids.index(sid["<|en|>"]) + 1 :] == tok.encode("hi")
    assert ids[1 : ids.index(sid["<|en|>"])] == tok.encode("你好")
    marker = tok.encode(tw.INSTRUCT_SUFFIX)  # v1's instruct marker is ordinary text: several BPE ids
    assert len(marker) > 1 and all(i < section["vocab_size"] - 1609 for i in marker)
    assert tok.decode(tok.encode("<|en|>hello"), skip_special_tokens=True) == "hello"


def test_ids_equal_tiktoken_on_fixture_asset(converted) -> None:
    """The converter against tiktoken itself (export-time only) on the synthetic ranks, many strings."""
    tiktoken = pytest.importorskip("tiktoken")
    import random

    asset, section, tok = converted
    ranks = tw.read_ranks(asset)
    specials = tw.special_tokens("whisper")
    enc = tiktoken.Encoding(name="fixture", pat_str=tw.PATTERN, mergeable_ranks=ranks,
                            special_tokens={s: len(ranks) + i for i, s in enumerate(specials)},
                            explicit_n_vocab=section["vocab_size"])  # fmt: skip
    rng = random.Random(7)
    parts = [*MIXED, "the", " th", "ing", "报警", "テスト", "음성", "  ", "\n", "!!", "99", "<|zh|>", "<|en|>"]
    texts = MIXED + ["".join(rng.choice(parts) for _ in range(rng.randint(1, 8))) for _ in range(300)]
    for text in texts:
        assert tok.encode(text) == enc.encode(text, allowed_special="all"), text


def test_fixture_asset_seeds_and_size(tmp_path: Path) -> None:
    a, b = tmp_path / "a.tiktoken", tmp_path / "b.tiktoken"
    write_fixture_tiktoken(a, seed=0)
    write_fixture_tiktoken(b, seed=1)
    ra, rb = tw.read_ranks(a), tw.read_ranks(b)
    assert set(ra) == set(rb) and ra != rb  # same tokens, bytes shuffled differently
    assert {b"he", b" t", "的".encode()} <= set(ra)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "no tokens"),
        ("QQ== 0 extra\n", "is not"),
        ("QQ== x\n", "is not"),
        ("!!!! 0\n", "bad base64"),
        ("QQ== 0\nQQ== 1\n", "repeats"),
        ("QQ== 0\nQg== 0\n", "repeats"),
        ("QQ== 0\nQg== 5\n", "ranks are not"),
        ("QQ== 0\nQg== 1\n", "single-byte"),
    ],
)
def test_malformed_asset_raises(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_text(content, encoding="ascii")
    with pytest.raises(ExportError, match=match):
        tw.read_ranks(path)
    with pytest.raises(ExportError):
        tw.write_whisper_tokenizer(path, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()


def test_non_ascii_and_missing_files_raise(tmp_path: Path) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_bytes("你好 0\n".encode())
    with pytest.raises(ExportError, match="cannot read"):
        tw.read_ranks(path)
    with pytest.raises(ExportError, match="cannot read"):
        tw.read_ranks(tmp_path / "absent.tiktoken")


def test_special_lists_of_both_flavours() -> None:
    w, c = tw.special_tokens("whisper"), tw.special_tokens("cosyvoice-25hz")
    assert len(w) == 1609 and len(c) == 1674 and w[:102] == c[:102]
    assert w[101] == "<|yue|>" and w[102] == "<|translate|>" and c[102] == "<|ASR|>"
    assert "<|TTS/SP13|>" in c and "<|SPECIAL_TOKEN_30|>" in c and w[-1] == c[-1] == "<|30.00|>"
    assert "<|endofprompt|>" not in c and "<endofprompt>" not in c
    assert tw.flavour_of(Path(tw.COSYVOICE_25HZ_ASSET)) == "cosyvoice-25hz"
    assert tw.flavour_of(Path(tw.WHISPER_ASSET)) == "whisper"
    with pytest.raises(ExportError, match="flavour"):
        tw.special_tokens("gpt2")


def _asset(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)), encoding="ascii")
    return path


def test_find_tiktoken_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tw.TIKTOKEN_ENV, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    (src / "cosyvoice.yaml").write_text("get_tokenizer: !name:whisper.tokenizer.get_tokenizer\n", encoding="utf-8")
    env = _asset(tmp_path / "env" / "x.tiktoken")
    monkeypatch.setattr(tw, "_package_asset", lambda name: tmp_path / "pkg" / name)
    assert tw.find_tiktoken(src) == tmp_path / "pkg" / tw.WHISPER_ASSET  # last resort: an installed package
    monkeypatch.setenv(tw.TIKTOKEN_ENV, str(env))
    assert tw.find_tiktoken(src) == env  # the environment variable beats the package
    _asset(src / "a.tiktoken")
    assert tw.find_tiktoken(src) == src / "a.tiktoken"  # a single *.tiktoken in src beats the variable
    _asset(src / "b.tiktoken")
    assert tw.find_tiktoken(src) == env  # two are ambiguous: ignored
    _asset(src / tw.WHISPER_ASSET)
    assert tw.find_tiktoken(src) == src / tw.WHISPER_ASSET  # the exact name wins
    (src / "cosyvoice.yaml").write_text("get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_tokenizer\n")
    assert tw.asset_name_for(src) == tw.COSYVOICE_25HZ_ASSET
    _asset(src / tw.COSYVOICE_25HZ_ASSET)
    assert tw.find_tiktoken(src) == src / tw.COSYVOICE_25HZ_ASSET


def test_find_tiktoken_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tw.TIKTOKEN_ENV, raising=False)
    monkeypatch.setattr(tw, "_package_asset", lambda name: None)
    with pytest.raises(ExportError, match=r"multilingual\.tiktoken was not found.*openai/whisper.*COSYVOICE_TIKTOKEN"):
        tw.find_tiktoken(tmp_path)
    with pytest.raises(ExportError, match=r"FunAudioLLM/CosyVoice repository, cosyvoice/tokenizer/assets/multiling"):
        tw.find_tiktoken(tmp_path, tw.COSYVOICE_25HZ_ASSET)
    monkeypatch.setenv(tw.TIKTOKEN_ENV, str(tmp_path / "nope.tiktoken"))
    with pytest.raises(ExportError, match="not a file"):
        tw.find_tiktoken(tmp_path)


def test_package_asset_found_without_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package's assets are located with find_spec, never imported (openai-whisper would import torch)."""
    pkg = tmp_path / "site" / "whisper"
    (pkg / "__init__.py").parent.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    asset = _asset(pkg / "assets" / tw.WHISPER_ASSET)
    monkeypatch.delitem(sys.modules, "whisper", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert tw._package_asset(tw.WHISPER_ASSET) == asset
