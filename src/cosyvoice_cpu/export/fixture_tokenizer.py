"""Small stand-in text tokenizers for fixtures: a Qwen2-format BPE (v2) and a tiktoken asset (v1).

The real Qwen2 vocabulary cannot be downloaded here, so fixtures carry a BPE trained on a few built-in English
and Chinese sentences: the same files (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``), the same
byte-level pre-tokenization and the same special tokens, so ``AutoTokenizer.from_pretrained`` and the official
``QwenTokenizer`` load it unchanged. Its ids are compact: the three Qwen specials follow the learned vocabulary
(the real ones sit at 151643-151645), which is why every consumer must read special ids from the tokenizer.

:func:`write_fixture_tiktoken` writes a small ``.tiktoken`` file in the format of Whisper's ``multilingual.tiktoken``
(all 256 bytes, a few hundred merges learned from the same sentences plus Japanese and Korean ones, and the
trailing ``=`` placeholder); with Whisper's 1609 specials its ids stay far below the v1 LM's 51866.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import re
from collections import Counter
from pathlib import Path

logger = logging.getLogger(__name__)

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# A tiny bilingual corpus: enough merges to make real words multi-byte tokens.
_CORPUS = [
    "Hello, this is a test of the CosyVoice text to speech engine running on a CPU.",
    "The alarm on line three is active; please check the pressure valve now.",
    "Speech synthesis turns text into natural sounding audio, one sentence at a time.",
    "Numbers like 1, 2, 3, 10, 25, 100 and 2026 appear in announcements every day.",
    "Warning: the temperature is too high. Shut down the machine and call maintenance.",
    "Good morning everyone, welcome to the factory floor. Safety first!",
    "我们的工厂网关会在没有网络的情况下播报报警信息。",
    "欢迎使用语音合成系统，这是一段用于测试的中文句子。",
    "三号生产线温度过高，请立即检查冷却系统。",
    "今天天气很好，我们一起去公园散步吧。",
    "收到请回复，谢谢大家的配合。",
]


def write_qwen_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Train and write the BPE files into ``out_dir``; return the number of ids it uses (incl. specials).

    Args:
        out_dir: the ``CosyVoice-BlankEN`` directory (created if needed).
        vocab_size: target size of the learned vocabulary (byte alphabet included), before the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.model.save(str(out_dir))  # vocab.json + merges.txt
    n = tok.get_vocab_size()
    added = {
        str(n + i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(QWEN_SPECIALS)
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    logger.debug("fixture BPE: %d learned ids + %d specials", n, len(QWEN_SPECIALS))
    return n + len(QWEN_SPECIALS)


_MORE = [
    "こんにちは、音声合成のテストです。今日はいい天気ですね。",
    "警報が鳴りました。すぐに確認してください。",
    "안녕하세요, 음성 합성 테스트입니다. 감사합니다.",
]
_WORDS = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+")


def write_fixture_tiktoken(path: Path, seed: int = 0, merges: int = 400) -> int:
    """Write a small valid ``.tiktoken`` file to ``path``; return its number of ranks (placeholder included).

    Ranks 0..255 are the single bytes in a ``seed``-shuffled order (so ids differ from byte values), then up to
    ``merges`` byte pairs merged greedily by frequency over the built-in sentences (English letter pairs, CJK
    UTF-8 byte pairs), then the empty placeholder ``=`` that the real assets end with.
    """
    import numpy as np

    order = np.random.default_rng(seed).permutation(256)
    ranks: list[bytes] = [bytes([int(b)]) for b in order]
    known = set(ranks)
    words: Counter[tuple[bytes, ...]] = Counter()
    for line in _CORPUS + _MORE:
        for w in _WORDS.findall(line):
            words[tuple(bytes([b]) for b in w.encode("utf-8"))] += 1
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, n in words.items():
            for a, b in itertools.pairwise(w):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties by bytes: deterministic
        joined = best[0] + best[1]
        if joined not in known:
            ranks.append(joined)
            known.add(joined)
        words = Counter({_merge(w, best, joined): n for w, n in words.items()})
    lines = [f"{base64.b64encode(t).decode('ascii')} {r}" for r, t in enumerate(ranks)]
    lines.append(f"= {len(ranks)}")
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    logger.debug("fixture tiktoken: %d ranks (%d merged) to %s", len(ranks) + 1, len(ranks) - 256, path)
    return len(ranks) + 1


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes], joined: bytes) -> tuple[bytes, ...]:
    """``word`` with every non-overlapping occurrence of ``pair`` (left to right) replaced by ``joined``."""
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)
