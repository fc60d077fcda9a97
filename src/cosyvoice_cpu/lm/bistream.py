"""Speech tokens while the text is still arriving: the official ``Qwen2LM.inference_bistream``, torch-free.

CosyVoice2 and Fun-CosyVoice3 were trained on text and speech interleaved in groups (``mix_ratio`` 5:15, the
facts' :attr:`~cosyvoice_cpu.facts.FamilyFacts.mix_ratio`). A :class:`BistreamRequest` follows the official
algorithm (FunAudioLLM/CosyVoice ``cosyvoice/llm/llm.py`` at ace7c47) event by event:

1. the input starts as ``[sos]`` (Fun-CosyVoice3: ``[sos, text_emb(prompt text up to <|endofprompt|>)]``); the
   rest of the prompt transcript is the start of the text cache;
2. each text piece (:meth:`feed`) joins the text cache; while prompt speech tokens remain, groups of 5 text + 15
   prompt speech embeddings are appended to the input (a piece that leaves fewer than 5 text tokens waits);
3. once the prompt speech is used up, the LM decodes: speech tokens are sampled with EOS masked until the LM
   emits its fill token (or one is forced 16 positions after the previous fill), which asks for the next group of
   5 text tokens. A piece is one event: after a fill the next group is taken when the next piece arrives;
4. after the last piece (:meth:`end`), the input is ``[the last input, the text cache, task_id]`` and the LM decodes
   until EOS. (The official code re-feeds its last input here when it stopped at a fill; kept for parity.)

Where the official code raises (a special token other than the fill or EOS sampled), the request ends its speech
there with a warning. The official loop has no length limit; here the speech ends at the KV cache's capacity or at
``max_token_text_ratio`` times the text fed (a degenerate LM), with a warning. Benchmarks of random weights, which
seldom sample EOS and often other special ids, set ``forced_ratio``: every special id but the fill is masked and,
after the text's end, the speech ends at ``forced_ratio`` times the text fed (the prompt transcript excluded), or
at once when the 15 per 5 text tokens decoded before were more.

The scheduler drives the request (:mod:`cosyvoice_cpu.lm.scheduler`): :meth:`next_input` gives the positions to
feed next (None: waiting for text), :meth:`advance` samples after them. Iterating the request runs it alone,
blocking while text is awaited.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.lm.cache import LMCache
from cosyvoice_cpu.lm.generate import SpeechTokenGenerator, token_ids
from cosyvoice_cpu.lm.sampling import Draw, RngDraw, SamplingConfig, ras_sample

logger = logging.getLogger(__name__)

_END = None  # the end-of-text event in the piece queue


class BistreamRequest:
    """One text stream's speech tokens (see the module docstring).

    Args:
        gen: the engine's generator (session, LM facts, default sampling).
        prompt_text: (Tp,) the prompt transcript's ids (Fun-CosyVoice3: must hold ``<|endofprompt|>``).
        prompt_speech: (Ts,) the prompt audio's speech tokens.
        mix_ratio: (text, speech) tokens per group; fill_token: the id that asks for more text.
        draw, sampling: the random source and sampling settings (default: the generator's, a fresh RngDraw).
        forced_ratio: benchmarks only (see the module docstring): speech tokens per text token; None = official.

    Attributes:
        tokens: the speech tokens yielded so far; history: every sampled id, fill tokens included (what the
            repetition-aware sampling sees, as in the official code); text_fed: text ids taken in.
        stop_reason: None while running, then ``"stop"`` (EOS), ``"max_len"``, ``"unexpected"`` or ``"cancelled"``.
    """

    def __init__(
        self,
        gen: SpeechTokenGenerator,
        prompt_text: Sequence[int] | np.ndarray,
        prompt_speech: Sequence[int] | np.ndarray,
        mix_ratio: tuple[int, int],
        fill_token: int,
        *,
        draw: Draw | None = None,
        sampling: SamplingConfig | None = None,
        forced_ratio: float | None = None,
    ) -> None:
        if gen.text_encoder is not None:
            raise ConfigError("this model's LM was not trained on a text stream; speak its text a sentence at a time")
        self.gen, self.session, self.facts = gen, gen.session, gen.facts
        self.mix = mix_ratio
        self.fill = int(fill_token)
        self.draw = draw or RngDraw()
        self.sampling = sampling or gen.sampling
        self.sampling.validate()
        prompt_text = token_ids("prompt_text", prompt_text)
        speech = token_ids("prompt_speech", prompt_speech)
        if speech.size and (speech.min() < 0 or speech.max() >= self.facts.speech_token_size):
            raise ConfigError(f"prompt speech tokens must lie in [0, {self.facts.speech_token_size})")
        s = self.session
        head = [s.special("sos")[None]]
        eop = self.facts.endofprompt_id
        if eop is not None:  # Fun-CosyVoice3: sos, then the prompt text through <|endofprompt|>, go in first
            hits = np.flatnonzero(prompt_text == eop)
            if not hits.size:
                raise ConfigError(
                    f"this model needs <|endofprompt|> (id {eop}) in the prompt text of a text stream, as the "
                    "official CosyVoice3 asserts: e.g. 'You are a helpful assistant.<|endofprompt|>' + transcript"
                )
            head.append(s.embed_text(prompt_text[: hits[0] + 1]))
            prompt_text = prompt_text[hits[0] + 1 :]
        self._input: list[np.ndarray] = head  # the positions to feed next, as official lm_input
        self._text: list[int] = [int(i) for i in prompt_text]  # the text cache
        self._forced = forced_ratio
        self._prompt_text = len(self._text)  # transcript ids in the text cache: not counted by forced_ratio
        self._speech: list[int] = [int(i) for i in speech]  # prompt speech tokens not yet in the input
        ts, group = len(self._speech), mix_ratio[1]
        self._next_fill = (ts // group + 1) * group - ts  # the official first forced fill position
        self.tokens: list[int] = []
        self.history: list[int] = []
        self.text_fed = 0
        self.stop_reason: str | None = None
        self._final = False  # the text has ended and its remainder is in: decode to EOS
        self._ready: np.ndarray | None = None  # the next input, once computed
        self._awaiting = True  # between decode runs: the next input comes from the next event
        self._events: deque[list[int] | None] = deque()
        self._lock = threading.Condition()
        self.wake: Callable[[], None] | None = None  # set by a scheduler: called when text arrives
        self.cache: LMCache | None = None
        self.row = 0
        self._started = False

    # ---- the text side (any thread) ---------------------------------------------------------------------------

    def feed(self, ids: Sequence[int] | np.ndarray) -> None:
        """One text piece's token ids (a piece is one event of the official loop; an empty piece is skipped)."""
        ids = [int(i) for i in token_ids("text", ids)]
        if ids:
            self._push(ids)

    def end(self) -> None:
        """No more text: the LM speaks what is left and decodes until EOS."""
        self._push(_END)

    def cancel(self) -> None:
        """Stop now (a cancelled text stream): no more tokens; a scheduler frees the row at its next step."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = "cancelled"
            self._lock.notify_all()
        if self.wake is not None:
            self.wake()

    def _push(self, event: list[int] | None) -> None:
        with self._lock:
            if self._events and self._events[-1] is _END:
                raise ConfigError("this text stream has ended; open a new one to speak more")
            self._events.append(event)
            self._lock.notify_all()
        if self.wake is not None:
            self.wake()

    # ---- the LM side (one thread) -----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def attach(self, cache: LMCache, row: int) -> None:
        """Decode into ``cache`` row ``row`` (reset now)."""
        cache.check_row(row)
        self.cache, self.row = cache, row
        cache.reset(row)

    def next_input(self) -> np.ndarray | None:
        """The positions (T, D) to feed before the next :meth:`advance`, or None while text is awaited. Only
        between decode runs (at the start, after a fill token): consumes text events."""
        if self._ready is None and self._awaiting and not self.finished:
            with self._lock:
                events = list(self._events)
                self._events.clear()
            for i, event in enumerate(events):
                if self._take(event):
                    with self._lock:  # the events after the one that started a run wait for the next fill
                        self._events.extendleft(reversed(events[i + 1 :]))
                    break
        return self._ready

    def _take(self, event: list[int] | None) -> bool:
        """Apply one event; True when it starts a decode run (``_ready`` set)."""
        a, b = self.mix
        s = self.session
        if event is _END:
            rest = [s.embed_text(self._text)] if self._text else []
            self._ready = np.concatenate([*self._input, *rest, s.special("task_id")[None]])
            self.text_fed += len(self._text)
            self._text, self._final = [], True
            return True
        self._text.extend(event)
        while self._speech and len(self._text) >= a:
            self._input += [s.embed_text(self._text[:a]), s.embed_speech(self._speech[:b])]
            self.text_fed += a
            self._text, self._speech = self._text[a:], self._speech[b:]
        if self._speech:
            return False
        after_fill = bool(self.history) and self.history[-1] == self.fill
        if after_fill or (not self.history and sum(len(x) for x in self._input) == 1):
            if len(self._text) < a:
                return False
            group = s.embed_text(self._text[:a])
            self._input = [group] if after_fill else [*self._input, group]
            self.text_fed += a
            self._text = self._text[a:]
        self._ready = np.concatenate(self._input)
        return True

    def fed(self, embeds: np.ndarray) -> None:
        """The scheduler fed ``embeds`` (from :meth:`next_input`): the request now samples."""
        self._input, self._ready, self._awaiting = [embeds], None, False

    def advance(self, logp: np.ndarray) -> int | None:
        """Sample after the last fed position; returns a speech token to yield and feed back, or None: either
        the request is :attr:`finished`, or it emitted a fill token and awaits text (:meth:`next_input`)."""
        if self.finished:
            return None
        f, h = self.facts, self.history
        if self._forced is not None:  # benchmarks: no special id but the fill (before the text's end)
            logp = np.array(logp, dtype=np.float32)
            fill = logp[self.fill] if self.fill < len(logp) else None
            logp[f.speech_token_size :] = -np.inf
            if fill is not None and not self._final:
                logp[self.fill] = fill
        if not self._final:
            if len(h) == self._next_fill:
                token = self.fill
                self._next_fill += self.mix[1] + 1
            else:
                logp = np.array(logp, dtype=np.float32)
                logp[f.speech_token_size] = -np.inf  # the official sampling_ids(ignore_eos=True) masks id S
                token = ras_sample(logp, h, self.sampling, self.draw)
            if token == self.fill:
                self._next_fill = len(h) + self.mix[1] + 1
        else:
            token = ras_sample(logp, h, self.sampling, self.draw)
        h.append(token)
        if token >= f.speech_token_size:
            if token == self.fill and not self._final:
                self._awaiting = True
                return None
            expected = token == f.eos_id and self._final
            if not expected:
                logger.warning("the LM emitted special token %d in a text stream; its speech ends here", token)
            self.stop_reason = "stop" if expected else "unexpected"
            return None
        if self._full():
            return None
        self.tokens.append(token)
        self._input = [self.session.embed_speech([token])]  # as official: the last input, fed back next
        return token

    def _full(self) -> bool:
        """End the speech when the KV cache or the text's token budget is used up (a warning says which)."""
        room = self.cache is None or self.cache.lengths[self.row] + 1 < self.session.spec.max_len
        if self._forced is not None and room:  # benchmarks: the forced length, once all the text is in
            forced = max(1, round(self._forced * (self.text_fed - self._prompt_text)))
            if not self._final or len(self.tokens) < forced:
                return False
            self.stop_reason = "stop"
            return True
        budget = max(self.text_fed + len(self._text), 1) * self.facts.max_token_text_ratio
        if room and len(self.tokens) < budget:
            return False
        logger.warning(
            "text stream stopped after %d speech tokens: %s",
            len(self.tokens),
            "KV cache full" if not room else "more than max_token_text_ratio times its text",
        )
        self.stop_reason = "max_len"
        return True

    def room_for(self, embeds: np.ndarray) -> bool:
        """Whether ``embeds`` fit the row's KV cache (else the request ends: ``stop_reason`` ``"max_len"``)."""
        assert self.cache is not None
        if self.cache.lengths[self.row] + len(embeds) < self.session.spec.max_len:
            return True
        logger.warning("text stream stopped: its next %d positions do not fit the KV cache", len(embeds))
        self.stop_reason = "max_len"
        return False

    # ---- alone (no scheduler) ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise ConfigError("a BistreamRequest can be iterated only once")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[int]:
        if self.cache is None:
            self.attach(self.session.new_cache(1), 0)
        token: int | None = None
        while not self.finished:
            if token is None:
                embeds = self.wait_input()
                if embeds is None or not self.room_for(embeds):
                    return
                self.fed(embeds)
                logp = self.session.prefill(self.cache, self.row, embeds)
            else:
                logp = self.session.decode(self.cache, [self.row], [token])[0]
            token = self.advance(logp)
            if token is not None:
                yield token

    def wait_input(self) -> np.ndarray | None:
        """Block until :meth:`next_input` has positions to feed (None: the request was cancelled)."""
        while (embeds := self.next_input()) is None and not self.finished:
            with self._lock:
                if not self._events and not self.finished:
                    self._lock.wait()
        return embeds
