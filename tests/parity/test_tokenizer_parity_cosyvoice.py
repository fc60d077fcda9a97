"""Parity: the converted REAL v1 tiktoken assets give the official ids, through the runtime TextTokenizer.

The released CosyVoice-300M/-SFT/-Instruct name ``whisper.tokenizer.get_tokenizer`` (openai-whisper,
``multilingual.tiktoken``) in their ``cosyvoice.yaml``; the CosyVoice-300M-25Hz recipe names the official
``cosyvoice.tokenizer.tokenizer.get_tokenizer`` (``multilingual_zh_ja_yue_char_del.tiktoken``). Both are built as the
yaml does (multilingual, 100 languages, en, transcribe) and called as the v1 frontend does:
``encode(text, allowed_special="all")``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cosyvoice_cpu.export.tokenizer import cosyvoice as tw
from cosyvoice_cpu.text.tokenizer import TextTokenizer
from tests.parity.official import official

ZH = ["你好，世界！", "三号生产线温度过高，请立即检查冷却系统。", "收到请回复，谢谢大家的配合。",
      "在面对挑战时，他展现了非凡的勇气与智慧。"]  # fmt: skip
EN = ["Hello world.", "It's what we'll do; they've said I'm sure you'd agree.", "The QUICK brown fox", "don't",
      "e-mail"]  # fmt: skip
JA = ["こんにちは、音声合成のテストです。", "東京タワーへ行きましょう！", "ｶﾀｶﾅ ﾃｽﾄ"]
KO = ["안녕하세요, 감사합니다.", "음성 합성 테스트입니다."]
YUE = ["你食咗飯未呀？", "佢哋喺度傾偈。", "唔該晒！"]
DIGITS = ["0", "12", "2026", "3.14159", "1,000,000", "１２３", "٣٤٥", "10%", "No.7"]
PUNCT = ["!", "?!", "...", "——", "“quoted”", "(x)", "[laughter]", "<strong>", "</strong>", "#@$%^&*", "、", "～"]
EMOJI = ["😀", "🎉🎉", "👍🏽", "👨‍👩‍👧", "🇨🇳", "❤️"]
SPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u3000", "\u00a0", "  \t\n  "]
TAGS = ["<|zh|>", "<|en|>", "<|ja|>", "<|yue|>", "<|ko|>", "<|endoftext|>", "<|startoftranscript|>", "<|0.00|>",
        "<|transcribe|>", "<|Laughter|>", "<|TTS/B|>", "<endofprompt>", "<|endofprompt|>", "<|zh", "zh|>"]  # fmt: skip
FIXED = ["", "a", " a", "a ", "aaaaaaaaaaaaaaaaaaaaaaaa", "ababababababab", "'s'S's", "x\u0301", "\ufeffBOM", "\ufffd",
         "希望你以后能够做的比我还好呦。<endofprompt>",
         "<|zh|>你好<|en|>hello<|ja|>やあ<|ko|>안녕<|yue|>你好嘢"]  # fmt: skip
POOLS = [ZH, EN, JA, KO, YUE, DIGITS, PUNCT, EMOJI, SPACE, TAGS]


def _random_unicode(rng: random.Random) -> str:
    """Code points from all planes, surrogates excluded (a Python str with one cannot be UTF-8 encoded)."""
    out = []
    for _ in range(rng.randint(1, 24)):
        lo, hi = rng.choice([(0x20, 0x7E), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)])
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _texts() -> list[str]:
    rng = random.Random(2024)
    texts = FIXED + [s for pool in POOLS for s in pool]
    texts += ["".join(rng.choice(rng.choice(POOLS)) for _ in range(rng.randint(2, 8))) for _ in range(250)]
    texts += [_random_unicode(rng) for _ in range(100)]
    return texts


TEXTS = _texts()


def _official_tokenizer(flavour: str):
    if flavour == "whisper":
        module = official("whisper.tokenizer")
        asset = Path(module.__file__).parent / "assets" / tw.WHISPER_ASSET
    else:
        module = official("cosyvoice.tokenizer.tokenizer")
        asset = Path(module.__file__).parent / "assets" / tw.COSYVOICE_25HZ_ASSET
    return module.get_tokenizer(multilingual=True, num_languages=100, language="en", task="transcribe"), asset


@pytest.fixture(scope="module", params=["whisper", "cosyvoice-25hz"])
def pair(request, tmp_path_factory: pytest.TempPathFactory):
    """(official tokenizer, our runtime TextTokenizer, manifest section, tokenizer.json path) for one asset."""
    theirs, asset = _official_tokenizer(request.param)
    out = tmp_path_factory.mktemp(f"tok-{request.param}")
    section = tw.write_whisper_tokenizer(asset, out)
    return theirs, TextTokenizer.from_file(out / section["tokenizer"]), section, out / section["tokenizer"]


def test_vocab_and_special_ids(pair) -> None:
    theirs, ours, section, _ = pair
    enc = theirs.encoding
    assert section["vocab_size"] == enc.n_vocab == ours.vocab_size
    assert section["vocab_size"] == (51866 if enc.name == tw.WHISPER_ASSET else 60510)  # 51866: v1 text_token_size
    for token, tid in enc._special_tokens.items():
        assert ours.special_id(token) == tid
    assert section["special_ids"] == {t: enc._special_tokens[t] for t in section["special_ids"]}
    ours.check_manifest(section["special_ids"])


def test_ids_identical_to_official(pair) -> None:
    theirs, ours, _, _ = pair
    assert len(TEXTS) >= 400
    wrong = [t for t in TEXTS if ours.encode(t) != theirs.encode(t, allowed_special="all")]
    assert not wrong, f"{len(wrong)}/{len(TEXTS)} strings differ, e.g. {wrong[:3]!r}"


def test_decode_round_trips(pair) -> None:
    theirs, ours, _, _ = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert theirs.encoding.decode(ids) == text


def test_every_token_decodes_like_official(pair) -> None:
    """Every id alone (ranks, the empty placeholder, specials) decodes to the official text, lossy bytes included."""
    from tokenizers import Tokenizer

    theirs, ours, section, path = pair
    ids = list(range(section["vocab_size"]))
    raw = Tokenizer.from_file(str(path)).decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert raw == theirs.encoding.decode_batch([[i] for i in ids])
    assert all(ours.decode([i], skip_special_tokens=False) == raw[i] for i in ids[::97])


def test_runtime_needs_no_torch(pair) -> None:
    """In a fresh interpreter with torch (and tiktoken) blocked, TextTokenizer.from_file gives the official ids."""
    theirs, _, _, path = pair
    texts = TEXTS[:: len(TEXTS) // 40]
    code = (
        "import json, sys\n"
        "sys.modules['torch'] = None; sys.modules['tiktoken'] = None\n"
        "from cosyvoice_cpu.text.tokenizer import TextTokenizer\n"
        "tok = TextTokenizer.from_file(sys.argv[1])\n"
        "print(json.dumps([tok.encode(t) for t in json.loads(sys.stdin.read())]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], input=json.dumps(texts), capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert json.loads(run.stdout) == [theirs.encode(t, allowed_special="all") for t in texts]
