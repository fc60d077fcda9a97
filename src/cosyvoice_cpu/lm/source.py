"""Where a sentence's speech tokens come from, as a value the stream recipes are given (not a call back into the
engine): a :class:`TokenSource` is opened once, with an optional :class:`~cosyvoice_cpu.lm.hold.Hold`, and
iterated.

- :class:`SentenceTokens`: the tokens of one sentence whose text is known (``Qwen2LM.inference``);
- :class:`StreamTokens`: the tokens of a text stream's passage whose text is still arriving
  (:mod:`cosyvoice_cpu.lm.bistream`);
- :class:`EarlyTokens`: a source opened before its turn, so its LM starts while the passage before is spoken.

Both decode on the engine's LM scheduler when it has one (batched with every other request), else in the caller's
thread, and call ``check()`` after every token (it may raise to stop: a server's cancellation and timeout).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cosyvoice_cpu.lm.bistream import BistreamRequest
from cosyvoice_cpu.lm.generate import SpeechTokenGenerator
from cosyvoice_cpu.lm.hold import Hold, RelayHold
from cosyvoice_cpu.lm.sampling import Draw, SamplingConfig
from cosyvoice_cpu.lm.scheduler import LMScheduler

logger = logging.getLogger(__name__)


class TokenSource(Protocol):
    """A sentence's speech tokens, not started yet."""

    def open(self, hold: Hold | None = None) -> Iterator[int]:
        """Start decoding; ``hold`` pauses the LM after its count until released (scheduler only)."""
        ...


@dataclass
class SentenceTokens:
    """One sentence's speech tokens (arguments of :meth:`SpeechTokenGenerator.request`).

    Attributes:
        lm, scheduler: the engine's generator and its scheduler (None: decode in the caller's thread).
        text_ids: (Tt,) the sentence; prompt_text: (Tp,) ids; prompt_speech: (Ts,) tokens; speaker: (192,) or None.
        draw, sampling, budget: the request's random source, sampling settings and (min, max) token overrides.
        check: called after every token, or None.
    """

    lm: SpeechTokenGenerator
    scheduler: LMScheduler | None
    text_ids: list[int]
    prompt_text: list[int]
    prompt_speech: np.ndarray
    speaker: np.ndarray | None
    draw: Draw
    sampling: SamplingConfig
    budget: tuple[int | None, int | None] = (None, None)
    check: Callable[[], None] | None = None

    def open(self, hold: Hold | None = None) -> Iterator[int]:
        kw = {"draw": self.draw, "sampling": self.sampling, "budget": self.budget, "speaker": self.speaker}
        if self.scheduler is not None:
            tokens = self.scheduler.submit(self.text_ids, self.prompt_text, self.prompt_speech, hold=hold, **kw)
        else:
            tokens = self.lm.generate(self.text_ids, self.prompt_text, self.prompt_speech, **kw)
        return checked(tokens, self.check)


@dataclass
class StreamTokens:
    """A text-stream passage's speech tokens: ``request`` is fed text by the stream's writer while they come."""

    request: BistreamRequest
    scheduler: LMScheduler | None
    check: Callable[[], None] | None = None

    def open(self, hold: Hold | None = None) -> Iterator[int]:
        if self.scheduler is not None:
            tokens = self.scheduler.submit_stream(self.request, hold)
        else:
            tokens = iter(self.request)
        return checked(tokens, self.check)


class EarlyTokens:
    """``source`` opened now (on a scheduler, its request is queued at once) with a :class:`RelayHold` that
    pauses it after ``after`` tokens; :meth:`open` hands the reader's hold over and returns the same tokens."""

    def __init__(self, source: TokenSource, after: int) -> None:
        self._hold = RelayHold(after)
        self._tokens = source.open(self._hold)

    def open(self, hold: Hold | None = None) -> Iterator[int]:
        self._hold.hand_over(hold)
        return self._tokens

    def abandon(self) -> None:
        """Never to be read (its request was cancelled): release the hold so the scheduler's next step, which
        skips held rows, ends the request and frees its row."""
        self._hold.release()


def checked(tokens: Iterator[int], check: Callable[[], None] | None) -> Iterator[int]:
    """``tokens`` with ``check()`` after each; whatever way this ends, the source is closed (which frees a
    scheduler row at once instead of decoding for a request nobody reads)."""
    try:
        for token in tokens:
            if check is not None:
                check()
            yield token
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
