"""Text that arrives a few characters at a time, cut into phrases that can be normalized and tokenized alone.

An LLM writes ``"The valve is at 3"`` then ``".5 bar, check"``: normalizing or tokenizing each piece as it comes
would read ``3`` and ``.5`` apart and split words across BPE tokens. :class:`PhraseCutter` holds text back until
a cut is safe and hands out whole phrases:

- before a blank that follows a word without a digit (a number keeps its unit: ``3.5 bar`` stays one phrase);
- after CJK punctuation (``，。！？；：、``), which needs no blank after it;
- when ``max_chars`` accumulate without such a place (text without blanks), at the last character but one.

A phrase keeps the blank it starts with, so ``"Hello" + " world"`` tokenizes as ``"Hello world"`` does.
:func:`ends_sentence` tells a phrase that ends a sentence (``.!?。！？`` or a line break), where a text stream may
start a new passage.
"""

from __future__ import annotations

import logging
import re

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

CJK_STOPS = "，。！？；：、"
SENTENCE_END = re.compile(r"([.!?。！？…]+[\"')\]」』”’]*|\n)\s*$")
MAX_PHRASE_CHARS = 80


def ends_sentence(phrase: str) -> bool:
    """Whether ``phrase`` ends a sentence (sentence punctuation, closing quotes after it, or a line break)."""
    return bool(SENTENCE_END.search(phrase))


class PhraseCutter:
    """Accumulates text pieces; :meth:`push` returns the phrases completed so far, :meth:`flush` the rest.

    Args:
        max_chars: the longest phrase held back without a safe cut (at least 8).
    """

    def __init__(self, max_chars: int = MAX_PHRASE_CHARS) -> None:
        if not isinstance(max_chars, int) or max_chars < 8:
            raise ConfigError(f"max_chars must be an int >= 8, got {max_chars!r}")
        self.max_chars = max_chars
        self._buf = ""

    @property
    def pending(self) -> str:
        """Text held back (not yet part of a phrase)."""
        return self._buf

    def push(self, text: str) -> list[str]:
        """Add ``text``; the phrases it completes, in order (possibly none)."""
        if not isinstance(text, str):
            raise ConfigError(f"text pieces must be str, got {type(text).__name__}")
        self._buf += text
        out = []
        while (cut := self._cut()) is not None:
            out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
        return out

    def flush(self) -> str:
        """The text held back, as the last phrase ("" if none); the cutter is empty afterwards."""
        rest, self._buf = self._buf, ""
        return rest

    def _cut(self) -> int | None:
        """The end of the first phrase in the buffer, or None: hold on."""
        buf = self._buf
        for i, ch in enumerate(buf):
            if ch in CJK_STOPS and i + 1 < len(buf):
                return i + 1
            if ch.isspace() and i > 0 and not buf[i - 1].isspace():
                word = buf[:i].split()[-1] if buf[:i].split() else ""
                if word and not any(c.isdigit() for c in word):
                    return i
        if len(buf) > self.max_chars:
            return len(buf) - 1
        return None
