"""Text normalization as the official CosyVoice2 frontend does it (``CosyVoiceFrontEnd.text_normalize``).

The language is Chinese when the text holds a CJK ideograph, else English (the official rule). Both paths run
the WeTextProcessing TN grammars through the optional ``wetext`` package (``pip install cosyvoice-cpu[text]``)
when it is installed, then the official pure-Python rules, re-implemented here:

* zh: drop newlines, ``replace_blank`` (keep a blank only between two ASCII non-blanks), ``²``/``³`` ->
  ``平方``/``立方``, ``.`` -> ``。``, `` - `` -> ``，``, drop ``（）【】``/backticks, ``——`` -> blank,
  trailing ``，,、`` -> ``。`` (that last rule is applied to the final segment by :mod:`.split`).
* en: spell out remaining digit runs as ``inflect.number_to_words`` does (re-implemented, no inflect needed).

Without ``wetext`` a small fallback reads integers, decimals, percentages and ``$`` amounts so digits are never left
for the LM; dates, money and units are then read less well. Inline tags (``[laughter]``, ``<strong>``,
``<|endofprompt|>``) are cut out before TN and put back verbatim.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from functools import lru_cache
from typing import Literal, Protocol

logger = logging.getLogger(__name__)

Lang = Literal["zh", "en"]

CHINESE_CHAR = re.compile(r"[\u4e00-\u9fff]")
# CosyVoice2 inline tags: [breath], [laughter], [vocalized-noise], <strong>, </laughter>, <|endofprompt|> ...
TAG_PATTERN = re.compile(r"<\|[^|<>\s]{1,40}\|>|\[[a-z][a-z_\-]{0,30}\]|</?[a-z][a-z_]{0,30}>")

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = (
    "",
    "thousand",
    "million",
    "billion",
    "trillion",
    "quadrillion",
    "quintillion",
    "sextillion",
    "septillion",
    "octillion",
    "nonillion",
    "decillion",
)
_ZH_DIGITS = "零一二三四五六七八九"


def detect_language(text: str) -> Lang:
    """``"zh"`` if ``text`` holds a CJK ideograph (U+4E00..U+9FFF), else ``"en"`` (the official rule)."""
    return "zh" if CHINESE_CHAR.search(text) else "en"


def is_only_punctuation(text: str) -> bool:
    """True if ``text`` holds nothing speakable: only punctuation, symbols and blanks (or nothing)."""
    return all(unicodedata.category(c)[0] in "PSZ" or c.isspace() for c in text)


def replace_blank(text: str) -> str:
    """Drop blanks unless both neighbours are ASCII non-blanks (blanks inside English words are kept)."""
    out = []
    n = len(text)
    for i, c in enumerate(text):
        if c == " ":
            prev = text[i - 1] if i > 0 else " "
            nxt = text[i + 1] if i + 1 < n else " "
            if not (prev.isascii() and prev != " " and nxt.isascii() and nxt != " "):
                continue
        out.append(c)
    return "".join(out)


def replace_corner_mark(text: str) -> str:
    """``²`` -> ``平方``, ``³`` -> ``立方``."""
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    """Drop full-width round/lenticular brackets and backticks; ``——`` becomes a blank."""
    for c in ("（", "）", "【", "】", "`"):
        text = text.replace(c, "")
    return text.replace("——", " ")


def _en_under_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = []
    if hundreds:
        words.append(f"{_ONES[hundreds]} hundred")
    if rest:
        if rest < 20:
            tail = _ONES[rest]
        else:
            tens, ones = divmod(rest, 10)
            tail = _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
        words.append(("and " if hundreds else "") + tail)
    return " ".join(words)


def number_to_words(digits: str) -> str:
    """English words of a digit string, in ``inflect.engine().number_to_words`` style (British ``and``)."""
    n = int(digits)
    if n == 0:
        return "zero"
    groups = []
    scale = 0
    while n:
        n, g = divmod(n, 1000)
        groups.append((scale, g))
        scale += 1
    if scale > len(_SCALES):
        return " ".join(_ONES[int(d)] for d in digits)
    parts = [(g, _en_under_1000(g) + (f" {_SCALES[s]}" if s else "")) for s, g in reversed(groups) if g]
    out = parts[0][1]
    for i, (g, words) in enumerate(parts[1:], start=1):
        last = i == len(parts) - 1
        out += (" and " if last and g < 100 and groups[0][1] == g else ", ") + words
    return out


def spell_out_number(text: str) -> str:
    """Replace every run of ASCII digits by its English words (the official ``spell_out_number``)."""
    return re.sub(r"[0-9]+", lambda m: number_to_words(m.group()), text)


def _zh_under_10000(n: int, leading: bool) -> str:
    out = ""
    zero = False
    for unit_value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d, n = divmod(n, unit_value)
        if d:
            if zero or (not leading and not out and unit_value < 1000):
                out += "零"
            out += ("" if (d == 1 and unit == "十" and not out and leading) else _ZH_DIGITS[d]) + unit
            zero = False
        elif out:
            zero = True
    return out


def zh_number(digits: str) -> str:
    """Chinese reading of an integer digit string (``2024`` -> ``两千零二十四`` style, without 两)."""
    n = int(digits)
    if n == 0:
        return "零"
    if len(digits) > 16 or (len(digits) > 1 and digits[0] == "0"):
        return "".join(_ZH_DIGITS[int(d)] for d in digits)
    out = ""
    skipped = False  # a zero 4-digit group between non-zero ones is read as one 零
    for i, unit in enumerate(("亿亿", "万亿", "亿", "万", "")):
        group = (n // 10 ** (4 * (4 - i))) % 10000
        if group:
            if out and skipped and group >= 1000:
                out += "零"
            out += _zh_under_10000(group, leading=not out) + unit
            skipped = False
        elif out:
            skipped = True
    return out


def _fallback_zh(text: str) -> str:
    def num(m: re.Match[str]) -> str:
        cur, whole, frac, pct = m.group(1), m.group(2), m.group(3), m.group(4)
        words = zh_number(whole) + ("点" + "".join(_ZH_DIGITS[int(d)] for d in frac) if frac else "")
        return ("百分之" + words if pct else words) + ("美元" if cur else "")

    return re.sub(r"(\$)?([0-9]+)(?:\.([0-9]+))?(%)?", num, text)


def _fallback_en(text: str) -> str:
    def num(m: re.Match[str]) -> str:
        cur, whole, frac, pct = m.group(1), m.group(2), m.group(3), m.group(4)
        words = number_to_words(whole) + (" point " + " ".join(_ONES[int(d)] for d in frac) if frac else "")
        return words + (" percent" if pct else "") + (" dollars" if cur else "")

    return re.sub(r"(\$)?([0-9]+)(?:\.([0-9]+))?(%)?", num, text)


class TextNormalizer(Protocol):
    """What is used of ``wetext.Normalizer``: text in, normalized text out."""

    def normalize(self, text: str) -> str: ...


@lru_cache(maxsize=4)
def _wetext_normalizer(lang: Lang) -> TextNormalizer | None:
    """The ``wetext`` TN normalizer for ``lang``, or None (logged once) when ``wetext`` is not installed."""
    try:
        from wetext import Normalizer
    except ImportError:
        logger.info("wetext is not installed: numbers are read by simple rules (pip install 'cosyvoice-cpu[text]')")
        return None
    if lang == "zh":
        return Normalizer(lang="zh", operator="tn", remove_erhua=False)
    return Normalizer(lang="en", operator="tn")


def has_wetext() -> bool:
    """True if the optional ``wetext`` package can be used."""
    return _wetext_normalizer("zh") is not None


def _tn(text: str, lang: Lang, use_wetext: bool) -> str:
    """Run TN (wetext or the fallback) on tag-free text."""
    if not text.strip():
        return text
    norm = _wetext_normalizer(lang) if use_wetext else None
    if norm is not None:
        lead = text[: len(text) - len(text.lstrip())]
        trail = text[len(text.rstrip()) :]
        return lead + norm.normalize(text) + trail  # wetext strips; keep the blanks next to tags
    return _fallback_zh(text) if lang == "zh" else _fallback_en(text)


def normalize_text(text: str, lang: Lang | None = None, normalize: bool = True, use_wetext: bool = True) -> str:
    """Normalize one piece of text as the official CosyVoice2 frontend (see the module docstring).

    ``lang`` defaults to :func:`detect_language` of ``text``; pass the document's language when normalizing
    pieces of a longer text. ``normalize=False`` returns ``text`` unchanged. Inline tags survive untouched.
    """
    if not normalize or not text:
        return text
    lang = lang or detect_language(text)
    pieces = []
    pos = 0
    for m in TAG_PATTERN.finditer(text):
        pieces.append(_normalize_plain(text[pos : m.start()], lang, use_wetext))
        pieces.append(m.group())
        pos = m.end()
    pieces.append(_normalize_plain(text[pos:], lang, use_wetext))
    out = "".join(pieces)
    if lang == "zh":
        out = replace_blank(out)  # on the joined text: blanks next to tags follow the same rule
    return out


def _normalize_plain(text: str, lang: Lang, use_wetext: bool) -> str:
    """Normalize a tag-free piece."""
    if not text:
        return text
    text = _tn(text, lang, use_wetext)
    if lang == "zh":
        text = text.replace("\n", "")
        text = replace_corner_mark(text)
        text = text.replace(".", "。").replace(" - ", "，")
        return remove_bracket(text)
    return spell_out_number(text)
