"""Lazy sentence splitting of long text, after the official ``split_paragraph`` (CosyVoice2 frontend).

Pipeline, every stage a generator (a 1 MB text never becomes a list of sentences):

1. :func:`iter_raw_pieces` cuts the *input* at sentence punctuation (the official lists: zh ``。？！；：、.?!;``,
   en ``.?!;:``; a closing ``"``/``”`` stays with its sentence; ``.``/``:`` before a digit is not a boundary
   so ``12.5``/``10:30`` reach TN whole) and at newlines; a piece longer than ``max_piece_chars`` is cut at a
   comma or blank. Each piece keeps its character span in the input.
2. Each piece is normalized on its own (the official frontend normalizes the whole text first).
3. Pieces are merged as ``split_paragraph`` does (``token_max_n=80``, ``token_min_n=60``, ``merge_len=20``;
   zh lengths in characters, en lengths in tokens; a short last sentence joins the previous one), and never
   beyond ``max_tokens`` tokens.
4. A segment still longer than ``max_tokens`` tokens is cut at commas, then blanks, then at a fixed length
   (inline tags are never cut), so the LM never receives more than ``max_tokens`` text tokens.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cosyvoice_cpu.text.normalize import TAG_PATTERN, Lang, is_only_punctuation

logger = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]

# "Dr. Smith" is one sentence: a period after a common title abbreviation is not a boundary.
_ABBREV = "".join(f"(?<!\\b{a})" for a in ("Mr", "Mrs", "Ms", "Dr", "St", "Jr", "Sr", "Prof", "vs", "etc"))
_BOUNDARY = {
    "zh": re.compile(r"(?:[。？！；：、?!;\n]|[.:](?![0-9]))+[\"”]?"),
    "en": re.compile(rf"(?:[?!;\n]|:(?![0-9])|{_ABBREV}\.(?![0-9]))+[\"”]?"),
}
_END_PUNCT = {"zh": "。？！；：、.?!;", "en": ".?!;:"}
_SOFT_CUTS = (re.compile(r"[，,、；;：:]+"), re.compile(r"\s+"))
MIN_MAX_TOKENS = 8


@dataclass(frozen=True)
class TextSegment:
    """One unit of text for the LM.

    Attributes:
        text: the (normalized) text sent to the LM.
        token_ids: its token ids (``len(token_ids) <= max_tokens``).
        start, end: the character span ``text_in[start:end]`` of the input it came from (exact for
            ``normalize=False``; at sentence granularity otherwise, approximate inside an over-long sentence).
    """

    text: str
    token_ids: tuple[int, ...]
    start: int
    end: int


@dataclass
class _Chunk:
    text: str
    start: int
    end: int


def _cut_long(text: str, start: int, end: int, max_chars: int) -> Iterator[tuple[int, int]]:
    """Cut ``text[start:end]`` into spans of at most ``max_chars``, preferring commas/blanks, never inside a tag."""
    while end - start > max_chars:
        limit = start + max_chars
        window = text[start + max_chars // 2 : limit]
        cut = max((window.rfind(c) for c in "，,、 \t"), default=-1)
        cut = start + max_chars // 2 + cut + 1 if cut >= 0 else limit
        for m in TAG_PATTERN.finditer(text, max(start, cut - 48), min(end, cut + 48)):
            if m.start() < cut < m.end():
                cut = m.start() if m.start() > start else m.end()
        yield start, cut
        start = cut
    if end > start:
        yield start, end


def iter_raw_pieces(text: str, lang: Lang, max_piece_chars: int = 2000) -> Iterator[tuple[int, int]]:
    """Spans ``(start, end)`` of sentence pieces of ``text``, covering it exactly and in order."""
    pos = 0
    for m in _BOUNDARY[lang].finditer(text):
        yield from _cut_long(text, pos, m.end(), max_piece_chars)
        pos = m.end()
    yield from _cut_long(text, pos, len(text), max_piece_chars)


class _Splitter:
    """State of one :func:`iter_segments` run."""

    def __init__(
        self, encode: Encode, lang: Lang, max_tokens: int, token_max_n: int, token_min_n: int, merge_len: int
    ) -> None:
        self.encode, self.lang, self.max_tokens = encode, lang, max_tokens
        self.token_max_n, self.token_min_n, self.merge_len = token_max_n, token_min_n, merge_len

    def length(self, text: str) -> int:
        """The official ``calc_utt_length``: characters for zh, tokens for en."""
        return len(text) if self.lang == "zh" else len(self.encode(text))

    def fits(self, text: str) -> bool:
        return len(self.encode(text)) <= self.max_tokens

    def merge(self, chunks: Iterator[_Chunk]) -> Iterator[_Chunk]:
        """The merging loop of ``split_paragraph``, holding one segment back for the final short-tail merge."""
        pending: _Chunk | None = None
        cur: _Chunk | None = None
        for utt in chunks:
            if cur is not None:
                joined = cur.text + utt.text
                official_cut = self.length(joined) > self.token_max_n and self.length(cur.text) > self.token_min_n
                if official_cut or (cur.text.strip() and not self.fits(joined)):
                    if pending is not None:
                        yield pending
                    pending, cur = cur, None
            cur = utt if cur is None else _Chunk(cur.text + utt.text, cur.start, utt.end)
        if cur is not None:
            short = self.length(cur.text) < self.merge_len
            if pending is not None and short and self.fits(pending.text + cur.text):
                pending = _Chunk(pending.text + cur.text, pending.start, cur.end)
            else:
                if pending is not None:
                    yield pending
                pending = cur
        if pending is not None:
            yield pending

    def hard_split(self, text: str, level: int = 0) -> Iterator[tuple[int, int]]:
        """Offsets ``(a, b)`` into ``text`` of parts of at most ``max_tokens`` tokens."""
        if self.fits(text):
            yield 0, len(text)
            return
        if level >= len(_SOFT_CUTS):
            yield from self._fixed_split(text)
            return
        bounds = [m.end() for m in _SOFT_CUTS[level].finditer(text) if 0 < m.end() < len(text)]
        cuts = [0, *bounds, len(text)]
        a = 0
        prev = 0
        for b in cuts[1:]:
            if prev > a and not self.fits(text[a:b]):
                yield from ((a + x, a + y) for x, y in self.hard_split(text[a:prev], level + 1))
                a = prev
            prev = b
        yield from ((a + x, a + y) for x, y in self.hard_split(text[a:], level + 1))

    def _fixed_split(self, text: str) -> Iterator[tuple[int, int]]:
        """Greedy fixed-length parts; units are characters, whole inline tags, and punctuation stays attached."""
        units: list[int] = []  # end offsets of the units
        pos = 0
        for m in [*TAG_PATTERN.finditer(text), None]:
            stop = m.start() if m is not None else len(text)
            for k in range(pos, stop):
                if units and unicodedata.category(text[k])[0] == "P" and units[-1] == k:
                    units[-1] = k + 1  # keep punctuation with the character before it
                else:
                    units.append(k + 1)
            if m is not None:
                units.append(m.end())
                pos = m.end()
        a = 0
        i = 0
        while i < len(units):
            if not self.fits(text[a : units[i]]):  # one unit too long (a long run of punctuation): by characters
                yield from ((a + x, a + x + 1) for x in range(units[i] - a))
                a = units[i]
                i += 1
                continue
            j = i
            while j + 1 < len(units) and self.fits(text[a : units[j + 1]]):
                j += 1
            yield a, units[j]
            a = units[j]
            i = j + 1


def iter_segments(
    text: str,
    encode: Encode,
    lang: Lang,
    normalize_piece: Callable[[str], str] | None = None,
    max_tokens: int = 80,
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    max_piece_chars: int = 2000,
) -> Iterator[TextSegment]:
    """Lazily split (and, with ``normalize_piece``, normalize) ``text`` into :class:`TextSegment` s.

    Segments with nothing speakable (only punctuation) are dropped, as the official frontend does. With
    ``normalize_piece`` the last segment ends in sentence punctuation (zh: a trailing ``，,、`` becomes ``。``).
    """
    sp = _Splitter(encode, lang, max_tokens, token_max_n, token_min_n, merge_len)

    def chunks() -> Iterator[_Chunk]:
        for a, b in iter_raw_pieces(text, lang, max_piece_chars):
            piece = text[a:b]
            yield _Chunk(normalize_piece(piece) if normalize_piece else piece, a, b)

    merged = sp.merge(chunks())
    prev = next(merged, None)
    while prev is not None:
        nxt = next(merged, None)
        seg = prev
        if nxt is None and normalize_piece is not None:
            seg = _finish(seg, lang)
        yield from _emit(sp, seg)
        prev = nxt


def _finish(seg: _Chunk, lang: Lang) -> _Chunk:
    """Official end-of-text rules: trailing ``，,、`` -> ``。`` (zh) and a final sentence mark if missing."""
    body = seg.text.rstrip()
    if lang == "zh":
        body = re.sub(r"[，,、]+$", "。", body)
    if body and body[-1] not in _END_PUNCT[lang] and body[-1] not in '"”':
        body += "。" if lang == "zh" else "."
    return _Chunk(body, seg.start, seg.end)


def _emit(sp: _Splitter, seg: _Chunk) -> Iterator[TextSegment]:
    """Hard-cap one merged segment and turn its parts into TextSegments (spans mapped proportionally)."""
    n_text, n_raw = len(seg.text), seg.end - seg.start
    for a, b in sp.hard_split(seg.text):
        part = seg.text[a:b]
        if is_only_punctuation(part):
            continue
        ids = sp.encode(part)
        if n_text == n_raw:
            start, end = seg.start + a, seg.start + b
        else:
            start = seg.start + a * n_raw // max(n_text, 1)
            end = seg.end if b == n_text else seg.start + b * n_raw // max(n_text, 1)
        yield TextSegment(part, tuple(ids), start, end)
