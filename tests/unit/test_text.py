"""The torch-free text frontend: tokenizer parity, normalization, lazy splitting, errors."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.text import (
    TextTokenizer,
    has_wetext,
    is_only_punctuation,
    iter_raw_pieces,
    iter_segments,
    normalize_text,
    number_to_words,
    prepare,
)
from cosyvoice_cpu.text.normalize import zh_number

VARIED = [
    "你好，世界！今天天气怎么样？",
    "Hello, world! How are you doing today?",
    "我们去 Starbucks 买一杯 latte 吧。",
    "收到好友从远方寄来的生日礼物，[laughter]那份意外的惊喜<strong>深深</strong>地打动了我。",
    "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。",
    "[breath] well [quick_breath] <laughter>really</laughter> [vocalized-noise][mn]",
    "Emoji 😀🎉 and symbols ©®™ — ok",
    "Numbers 1234567 3.14159 2024-05-03 100% $12.50",
    "  leading and trailing blanks  \n new line\ttab",
    "日本語のテキストと한국어",
]


@pytest.fixture(scope="module")
def tok(tiny_export_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_export_dir)


def test_tokenizer_matches_reference(tok: TextTokenizer, tiny_model_dir: Path) -> None:
    from cosyvoice_cpu.reference.tokenizer import CosyVoice2Tokenizer

    ref = CosyVoice2Tokenizer(tiny_model_dir / "CosyVoice-BlankEN")
    for text in VARIED:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.special_id("<|endofprompt|>") == ref.token_id("<|endofprompt|>")
    assert tok.special_id("[laughter]") == ref.token_id("[laughter]")
    assert tok.encode("[laughter]") == [tok.special_id("[laughter]")]
    assert tok.decode(tok.encode("Hello 你好")) == "Hello 你好"


def test_tokenizer_agrees_with_manifest(tok: TextTokenizer, tiny_export_dir: Path) -> None:
    from cosyvoice_cpu.manifest import Manifest

    text = Manifest.load(tiny_export_dir).text
    tok.check_manifest(text["special_ids"])
    for token, tid in text["special_ids"].items():
        assert tok.special_id(token) == tid
    assert tok.vocab_size <= text["vocab_size"]


def test_tokenizer_errors(tmp_path: Path, tok: TextTokenizer) -> None:
    with pytest.raises(ConfigError, match="missing"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a valid"):
        TextTokenizer.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="not a token"):
        tok.special_id("<|no_such_token|>")
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.decode([10**9])
    with pytest.raises(ConfigError, match="disagrees"):
        tok.check_manifest({"<|endofprompt|>": 0})


def test_number_to_words_matches_inflect() -> None:
    inflect = pytest.importorskip("inflect")
    engine = inflect.engine()
    for n in [*range(0, 1200), 2024, 10001, 1000001, 1200345, 123456789012, 10**15 + 7]:
        assert number_to_words(str(n)) == engine.number_to_words(str(n)), n


def test_zh_number_reading() -> None:
    cases = {"0": "零", "10": "十", "105": "一百零五", "10001": "一万零一", "100001000": "一亿零一千", "007": "零零七"}
    for digits, words in cases.items():
        assert zh_number(digits) == words


@pytest.mark.parametrize("use_wetext", [False, True])
def test_normalize_numbers_and_rules(use_wetext: bool) -> None:
    if use_wetext and not has_wetext():
        pytest.skip("wetext not installed")
    zh = normalize_text("气温25.5度，增长了12%（同比）。", use_wetext=use_wetext)
    assert "二十五点五" in zh and "百分之十二" in zh and "（" not in zh and not any(c.isdigit() for c in zh)
    en = normalize_text("I have 3 cats and 2.5 dogs.", use_wetext=use_wetext)
    assert en == "I have three cats and two point five dogs."
    assert "twelve" in normalize_text("It costs $12.50.", use_wetext=use_wetext)
    assert "平方" in normalize_text("面积是5m²", use_wetext=use_wetext)
    assert normalize_text("你好 世界 hello world", use_wetext=use_wetext) == "你好世界hello world"


def test_normalize_dates_with_wetext() -> None:
    if not has_wetext():
        pytest.skip("wetext not installed")
    assert normalize_text("今天是2024年5月3日") == "今天是二零二四年五月三日"
    assert "twelve" in normalize_text("The price is $12.50.")


def test_tags_survive_and_identity() -> None:
    text = "你好[laughter]世界<strong>123</strong>个<|endofprompt|>[breath]好的"
    out = normalize_text(text)
    for tag in ("[laughter]", "<strong>", "</strong>", "<|endofprompt|>", "[breath]"):
        assert tag in out
    assert "一百二十三" in out
    en = normalize_text("Hello [laughter] I have <strong>2</strong> [vocalized-noise] cats.")
    assert "[laughter]" in en and "<strong>two</strong>" in en and "[vocalized-noise]" in en
    for t in VARIED:
        assert normalize_text(t, normalize=False) == t


def test_only_punctuation() -> None:
    assert is_only_punctuation("。！?…")
    assert is_only_punctuation(" ， ")
    assert not is_only_punctuation("[laughter]")
    assert not is_only_punctuation("a.")


def _paragraph(lang: str, n: int) -> str:
    if lang == "zh":
        unit = "在这个快速发展的时代，人工智能技术正在改变我们的生活方式，包括2024年的很多新产品。"
        return "".join(unit for _ in range(n)) + "他说：“好的！”最后一句"
    unit = "Artificial intelligence is changing the way we live, work and talk to each other in 2024. "
    return "".join(unit for _ in range(n)) + 'He said "fine!" and Dr. Smith left'


@pytest.mark.parametrize("lang", ["zh", "en"])
@pytest.mark.parametrize("max_tokens", [24, 200])
def test_split_limits_and_coverage(tok: TextTokenizer, lang: str, max_tokens: int) -> None:
    text = _paragraph(lang, 20)
    raw = list(prepare(text, tok, normalize=False, max_tokens=max_tokens))
    assert "".join(s.text for s in raw) == text  # exact slices, in order, nothing lost
    pos = 0
    for seg in raw:
        assert (seg.start, seg.end) == (pos, pos + len(seg.text)) and text[seg.start : seg.end] == seg.text
        assert 0 < len(seg.token_ids) <= max_tokens and list(seg.token_ids) == tok.encode(seg.text)
        pos = seg.end
    norm = list(prepare(text, tok, max_tokens=max_tokens))
    assert all(0 < len(s.token_ids) <= max_tokens for s in norm)
    assert norm[0].start == 0 and norm[-1].end == len(text)
    assert all(a.start <= b.start and a.end <= b.end for a, b in itertools.pairwise(norm))
    assert not any(c.isdigit() for s in norm for c in s.text)
    assert norm[-1].text.rstrip()[-1] in "。."  # the official final sentence mark
    if max_tokens == 200 and lang == "zh":  # official merging: sentences joined up to 80 characters
        assert len(norm) < text.count("。") * 2 // 3


def test_hard_cap_without_punctuation(tok: TextTokenizer) -> None:
    text = "没有标点的一段很长的中文文本" * 40 + " " + "word " * 200 + "x" * 500
    segs = list(prepare(text, tok, normalize=False, max_tokens=16))
    assert all(0 < len(s.token_ids) <= 16 for s in segs)
    assert "".join(s.text for s in segs) == text
    tagged = "[laughter]" * 30 + "<|endofprompt|>" * 10
    for seg in prepare(tagged, tok, normalize=False, max_tokens=8):
        assert seg.text.count("[") == seg.text.count("]") and seg.text.count("<|") == seg.text.count("|>")


def test_raw_pieces_keep_numbers_quotes_and_tags() -> None:
    text = 'Dr. Smith met Mrs. Jones at 10:30. It cost 12.5 dollars! He said "ok." [laughter] Fine'
    pieces = [text[a:b] for a, b in iter_raw_pieces(text, "en")]
    assert "".join(pieces) == text
    assert pieces[0] == "Dr. Smith met Mrs. Jones at 10:30."
    assert pieces[2] == ' He said "ok."' and pieces[3] == " [laughter] Fine"


def test_one_megabyte_streams_lazily(tok: TextTokenizer) -> None:
    text = _paragraph("en", 12_000)  # ~1 MB
    assert len(text) > 1_000_000
    calls = {"encode": 0, "normalize": 0}

    def encode(s: str) -> list[int]:
        calls["encode"] += 1
        return tok.encode(s)

    def norm(s: str) -> str:
        calls["normalize"] += 1
        return normalize_text(s, "en")

    gen = iter_segments(text, encode, "en", norm, max_tokens=100)
    first = next(gen)
    assert first.start == 0 and len(first.token_ids) <= 100
    assert calls["normalize"] < 10 and calls["encode"] < 50  # only the first few sentences were touched
    for _ in range(5):
        next(gen)
    assert calls["normalize"] < 20
    gen.close()


def test_prepare_errors(tok: TextTokenizer) -> None:
    for bad in ("", "   \n\t "):
        with pytest.raises(ConfigError, match="text is empty"):
            prepare(bad, tok)
    with pytest.raises(ConfigError, match="nothing speakable"):
        list(prepare("。。！？……", tok))
    with pytest.raises(ConfigError, match="max_tokens"):
        prepare("hi", tok, max_tokens=2)
    with pytest.raises(ConfigError, match="lang"):
        prepare("hi", tok, lang="fr")  # type: ignore[arg-type]
    segs = list(prepare("  hello there  ", tok))
    assert segs[0].text == "hello there." and (segs[0].start, segs[0].end) == (2, 13)


def test_import_without_torch(tiny_export_dir: Path) -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from cosyvoice_cpu.text import TextTokenizer, prepare\n"
        f"tok = TextTokenizer.from_dir({str(tiny_export_dir)!r})\n"
        "segs = list(prepare('你好，世界。Hello 2 you.', tok))\n"
        "import json; print(json.dumps([len(segs), 'torch' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    n, has_torch = json.loads(out.stdout.strip().splitlines()[-1])
    assert n >= 1 and not has_torch
