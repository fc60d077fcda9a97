"""Text frontend of the torch-free runtime: tokenizer, normalization and streaming sentence splitting.

Typical use::

    tok = TextTokenizer.from_dir(model_dir)
    for seg in prepare(text, tok, max_tokens=200):
        lm(seg.token_ids)  # seg.start/seg.end: the span of ``text`` it speaks
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.text.normalize import (
    TAG_PATTERN,
    Lang,
    detect_language,
    has_wetext,
    is_only_punctuation,
    normalize_text,
    number_to_words,
    spell_out_number,
)
from cosyvoice_cpu.text.split import MIN_MAX_TOKENS, TextSegment, iter_raw_pieces, iter_segments
from cosyvoice_cpu.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "TAG_PATTERN",
    "Lang",
    "TextSegment",
    "TextTokenizer",
    "detect_language",
    "has_wetext",
    "is_only_punctuation",
    "iter_raw_pieces",
    "iter_segments",
    "normalize_text",
    "number_to_words",
    "prepare",
    "spell_out_number",
]

DEFAULT_MAX_TOKENS = 200


def prepare(
    text: str,
    tokenizer: TextTokenizer,
    normalize: bool = True,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    lang: Lang | None = None,
    use_wetext: bool = True,
) -> Iterator[TextSegment]:
    """Normalize, split and tokenize ``text`` lazily into :class:`TextSegment` s for the LM.

    Args:
        text: the text to speak (any length; it is processed a sentence at a time).
        tokenizer: the model's :class:`TextTokenizer`.
        normalize: run the official CosyVoice2 text normalization (``False``: segments are exact slices).
        max_tokens: hard cap on the token count of every segment (at least 8).
        lang: ``"zh"`` or ``"en"``; detected from the whole text when None (the official rule).
        use_wetext: use the ``wetext`` TN grammars when installed.

    Raises:
        ConfigError: at once for empty text or a bad argument; while iterating, if nothing in ``text`` is
            speakable (e.g. only punctuation).
    """
    if not isinstance(text, str):
        raise ConfigError(f"text must be a str, got {type(text).__name__}; join or decode it first")
    if not text.strip():
        raise ConfigError("text is empty (or only whitespace): pass some text to speak")
    if not isinstance(max_tokens, int) or max_tokens < MIN_MAX_TOKENS:
        raise ConfigError(f"max_tokens must be an int >= {MIN_MAX_TOKENS}, got {max_tokens!r}")
    if lang is not None and lang not in ("zh", "en"):
        raise ConfigError(f"lang must be 'zh', 'en' or None (auto), got {lang!r}")
    # Official text_normalize strips the text first; segment spans stay relative to the caller's text.
    offset = len(text) - len(text.lstrip())
    body = text.strip()
    doc_lang: Lang = lang or detect_language(body)
    norm = (lambda piece: normalize_text(piece, doc_lang, True, use_wetext)) if normalize else None
    return _generate(body, offset, tokenizer, doc_lang, norm, max_tokens)


def _generate(
    body: str, offset: int, tokenizer: TextTokenizer, lang: Lang, norm: object, max_tokens: int
) -> Iterator[TextSegment]:
    """The lazy part of :func:`prepare`."""
    count = 0
    for seg in iter_segments(body, tokenizer.encode, lang, norm, max_tokens=max_tokens):  # type: ignore[arg-type]
        count += 1
        yield TextSegment(seg.text, seg.token_ids, seg.start + offset, seg.end + offset)
    if count == 0:
        raise ConfigError(
            f"nothing speakable in the text after normalization (it holds only punctuation or symbols: "
            f"{body[:40]!r}); pass words or numbers to speak"
        )
