"""Fun-CosyVoice3's silent-token run filter, torch-free: which decoded speech tokens go on to the flow.

The official ``CosyVoice3Model.llm_job`` (``cosyvoice/cli/model.py``, commit ``ace7c47``) counts consecutive
tokens of :data:`SILENT_TOKENS` (FSQ silence/breath codes, any mix of them) and drops each one past the
:data:`MAX_SILENT_RUN`-th; any other token resets the count. It is not an LM rule: the LM still feeds every token
back and keeps it in the RAS window, only the list handed to the flow loses them. Twin of
:class:`cosyvoice_cpu.reference.lm.cosyvoice3.SilentRunFilter` (checked against it in
tests/export/test_lm_graph_cosyvoice3.py).

Data flow (v3 only; v1/v2 hand every token on)::

    LM token stream t_0, t_1, ... (ints in [0, 6561)) --push(t) -> keep?--> tokens for the flow (a subsequence)

Use one :class:`SilentRunFilter` per request (it holds the current run length), in decoding order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import V3_MAX_SILENT_RUN, V3_SILENT_TOKENS

logger = logging.getLogger(__name__)

SILENT_TOKENS = V3_SILENT_TOKENS  # the official silent_tokens
MAX_SILENT_RUN = V3_MAX_SILENT_RUN  # a run keeps its first 5 silent tokens; the 6th and later are dropped


class SilentRunFilter:
    """Streaming filter: :meth:`push` says whether a decoded token goes on to the flow.

    Args:
        silent: the silent token ids (default :data:`SILENT_TOKENS`).
        max_run: how many silent tokens of one run are kept (default :data:`MAX_SILENT_RUN`; >= 0).
    Attributes:
        run: the length of the current run of silent tokens (kept and dropped ones).
        dropped: how many tokens this filter has dropped so far.
    """

    def __init__(self, silent: Iterable[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN) -> None:
        if int(max_run) < 0:
            raise ConfigError(f"max_run must be >= 0 (the official value is {MAX_SILENT_RUN}), got {max_run}")
        self.silent = frozenset(int(t) for t in silent)
        self.max_run = int(max_run)
        self.run = 0
        self.dropped = 0

    def push(self, token: int) -> bool:
        """Account for the next decoded token; True if it goes on to the flow, False if it is dropped."""
        if int(token) not in self.silent:
            self.run = 0
            return True
        self.run += 1
        if self.run <= self.max_run:
            return True
        self.dropped += 1
        return False

    def filter(self, tokens: Iterable[int]) -> Iterator[int]:
        """The kept tokens of ``tokens`` (continuing this filter's state), lazily."""
        return (t for t in tokens if self.push(t))

    def reset(self) -> None:
        """Start a new request."""
        self.run = 0
        self.dropped = 0


def drop_long_silences(tokens: Iterable[int], max_run: int = MAX_SILENT_RUN) -> list[int]:
    """The tokens the official ``CosyVoice3Model`` hands to the flow: runs of silent tokens cut to ``max_run``."""
    return list(SilentRunFilter(max_run=max_run).filter(tokens))
