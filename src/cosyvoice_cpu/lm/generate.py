"""The speech-token decoding loop on the exported LM: text ids + prompt -> a stream of speech tokens.

The torch-free twin of ``Qwen2LM.inference`` (:mod:`cosyvoice_cpu.reference.lm.cosyvoice2`). One request:

1. prefill embeddings ``[sos, text_emb(prompt_text ⊕ text), task_id, speech_emb(prompt_speech)]`` (T, D) into a
   KV-cache row (``T = 1 + Tp + Tt + 1 + Ts``);
2. sample with :func:`cosyvoice_cpu.lm.sampling.sample_next` (``LMFacts.min_len_masked_id`` kept out while fewer
   than ``min_len = int(Tt * min_token_text_ratio)`` tokens are out: EOS for v1/v2; for v3 the official code masks
   id 6561, its sos row, so eos 6562 and the other specials can still end a v3 request early), stop at the first
   stop id (not yielded) or after ``max_len = int(Tt * max_token_text_ratio)`` tokens, feeding each yielded token
   back (except the last one). v3 also needs ``<|endofprompt|>`` (``LMFacts.endofprompt_id``) in prompt_text ⊕ text.

The prefill's first ``1 + Tp`` positions (sos and the prompt transcript; v1: ``2 + Tp`` with the speaker row) are
prefilled in a call of their own and their KV entries kept for the next request with the same transcript (and v1
x-vector): :mod:`cosyvoice_cpu.lm.prefix`.

:class:`SpeechTokenGenerator` holds only read-only things (the shared :class:`~cosyvoice_cpu.lm.session.LMSession`, the
LM facts, the default sampling) and the thread-safe prefix cache; every mutable thing (KV cache, random source,
decoded tokens) lives in the :class:`TokenRequest` it hands out, so one generator serves concurrent requests from
several threads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.jsontypes import JsonValue
from cosyvoice_cpu.lm.cache import LMCache
from cosyvoice_cpu.lm.prefix import PrefixCache, prefix_key
from cosyvoice_cpu.lm.prompt import TextEncoder, assemble
from cosyvoice_cpu.lm.sampling import Draw, RngDraw, SamplingConfig, sample_next
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.manifest import Manifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LMFacts:
    """The manifest's ``lm`` section as the loop needs it.

    ``min_len_masked_id``: the id kept out while fewer than min_len tokens are decoded (None: ``eos_id``; v3:
    6561). ``endofprompt_id``: a text id that must occur in prompt_text ⊕ text (None: no rule; v3: 151646).
    """

    speech_token_size: int
    eos_id: int
    stop_ids: tuple[int, ...]
    min_token_text_ratio: float
    max_token_text_ratio: float
    min_len_masked_id: int | None = None
    endofprompt_id: int | None = None

    def __post_init__(self) -> None:
        if self.min_len_masked_id is None:
            object.__setattr__(self, "min_len_masked_id", self.eos_id)

    @classmethod
    def from_manifest(cls, d: Mapping[str, JsonValue]) -> LMFacts:
        """Read from the manifest's ``lm`` dict; raise ConfigError if a fact is missing or inconsistent."""
        optional = ("min_len_masked_id", "endofprompt_id")
        missing = [k for k in cls.__dataclass_fields__ if k not in d and k not in optional]
        if missing:
            raise ConfigError(f"the manifest's lm section lacks {', '.join(missing)}; re-export the model directory")
        opt = {k: int(d[k]) for k in optional if d.get(k) is not None}
        facts = cls(
            int(d["speech_token_size"]),
            int(d["eos_id"]),
            tuple(int(i) for i in d["stop_ids"]),
            float(d["min_token_text_ratio"]),
            float(d["max_token_text_ratio"]),
            **opt,
        )
        if facts.eos_id not in facts.stop_ids or not 0 <= facts.min_token_text_ratio <= facts.max_token_text_ratio:
            raise ConfigError(f"inconsistent lm facts {facts}; re-export the model directory")
        return facts

    def token_budget(self, n_text: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for ``n_text`` text tokens, rounded down as the reference does."""
        return int(n_text * self.min_token_text_ratio), int(n_text * self.max_token_text_ratio)


def token_ids(name: str, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as int64 (T,); raise ConfigError unless they are a flat sequence of integers."""
    a = np.asarray(ids)
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"{name} must be a flat sequence of integer token ids, got {a.dtype} {a.shape}")
    return a.astype(np.int64)


class SpeechTokenGenerator:
    """Runs speech-token requests on a shared :class:`LMSession`.

    Args:
        session: the loaded LM graph (shared, never mutated here).
        facts: the manifest's LM facts (stop ids, length ratios).
        sampling: the default sampling settings (a request may override them).
    """

    def __init__(
        self,
        session: LMSession,
        facts: LMFacts,
        sampling: SamplingConfig | None = None,
        text_encoder: TextEncoder | None = None,
    ) -> None:
        self.session = session
        self.text_encoder = text_encoder  # CosyVoice-300M only (see lm_prompt)
        self.facts = facts
        self.sampling = sampling or SamplingConfig()
        self.sampling.validate()
        self.prefixes = PrefixCache(session)
        vocab = session.spec.speech_vocab
        if not facts.stop_ids or max(facts.stop_ids) >= vocab or not 0 <= facts.min_len_masked_id < vocab:
            raise ConfigError(
                f"stop ids {facts.stop_ids[:4]}... or the min-length masked id {facts.min_len_masked_id} exceed the "
                f"LM head ({vocab} outputs); re-export the model directory"
            )

    @classmethod
    def from_manifest(
        cls,
        session: LMSession,
        manifest: Manifest,
        text_encoder: TextEncoder | None = None,
    ) -> SpeechTokenGenerator:
        """Build from a :class:`cosyvoice_cpu.manifest.Manifest` (its ``lm`` and ``sampling`` sections)."""
        return cls(
            session, LMFacts.from_manifest(manifest.lm), SamplingConfig.from_manifest(manifest.sampling), text_encoder
        )

    def prompt_embeddings(
        self,
        text: Sequence[int] | np.ndarray,
        prompt_text: Sequence[int] | np.ndarray = (),
        prompt_speech: Sequence[int] | np.ndarray = (),
        speaker: np.ndarray | None = None,
    ) -> np.ndarray:
        """The prefill input (T, D): ``[sos, text_emb(prompt_text ⊕ text), task_id, speech_emb(prompt_speech)]``
        (CosyVoice-300M: the text encoded, and a speaker row after sos when ``speaker`` is given; see lm_prompt)."""
        text, prompt_text = token_ids("text", text), token_ids("prompt_text", prompt_text)
        prompt_speech = token_ids("prompt_speech", prompt_speech)
        need = self.facts.endofprompt_id
        if need is not None and not (np.any(text == need) or np.any(prompt_text == need)):
            raise ConfigError(
                f"this model needs <|endofprompt|> (id {need}) in the prompt text or the text, as the official "
                "CosyVoice3 asserts: end the prompt with it, e.g. 'You are a helpful assistant.<|endofprompt|>' + "
                "the prompt transcript (zero-shot) or the instruction + '<|endofprompt|>' (instruct)"
            )
        if prompt_speech.size and (prompt_speech.min() < 0 or prompt_speech.max() >= self.facts.speech_token_size):
            raise ConfigError(
                f"prompt speech tokens must lie in [0, {self.facts.speech_token_size}), got "
                f"{prompt_speech.min()}..{prompt_speech.max()}; pass the speech tokenizer's output unchanged"
            )
        return assemble(
            self.session,
            np.concatenate([prompt_text, text]),
            prompt_speech,
            self.text_encoder,
            speaker,
            own_rows=prompt_text.size,
        )

    def request(
        self,
        text: Sequence[int] | np.ndarray,
        prompt_text: Sequence[int] | np.ndarray = (),
        prompt_speech: Sequence[int] | np.ndarray = (),
        *,
        seed: int | None = None,
        draw: Draw | None = None,
        sampling: SamplingConfig | None = None,
        cache: LMCache | None = None,
        row: int = 0,
        budget: tuple[int | None, int | None] = (None, None),
        speaker: np.ndarray | None = None,
    ) -> TokenRequest:
        """Check the inputs and the KV capacity now; return the request, whose iteration does the work.

        Args:
            text: (Tt,) text token ids to speak (not empty); prompt_text: (Tp,) the prompt's transcript ids.
            prompt_speech: (Ts,) the prompt audio's speech tokens in [0, speech_token_size).
            seed: seed of the default random source (:class:`RngDraw`); ignored if ``draw`` is given.
            draw: the random source (tests replay the reference's draws through it).
            sampling: overrides the generator's default sampling settings.
            cache, row: the KV-cache row to use (reset at prefill); default a new one-row cache made when the
                request starts. A scheduler passes neither and gives it a row with :meth:`TokenRequest.attach`.
            budget: (min, max) speech tokens overriding the model's text-length rule where not None (``min ==
                max`` forces an exact length: benchmarks on random weights). A given min also keeps every stop
                id, not only EOS, out of the first min tokens.
            speaker: (192,) x-vector the LM is conditioned on (CosyVoice-300M; None for CosyVoice2 and for v1's
                instruct mode).
        """
        text, prompt_text = token_ids("text", text), token_ids("prompt_text", prompt_text)
        if text.size == 0:
            raise ConfigError("text is empty: give at least one text token to speak")
        sampling = sampling or self.sampling
        sampling.validate()
        embeds = self.prompt_embeddings(text, prompt_text, prompt_speech, speaker)
        min_len, max_len = self.facts.token_budget(len(text))
        min_len = min_len if budget[0] is None else int(budget[0])
        max_len = max_len if budget[1] is None else int(budget[1])
        if not 0 <= min_len <= max_len or max_len < 1:
            raise ConfigError(f"speech token budget must satisfy 0 <= min <= max, max >= 1; got ({min_len}, {max_len})")
        # positions used: the prompt, then every yielded token but the last is fed back
        need, cap = len(embeds) + max(max_len - 1, 0), self.session.spec.max_len
        if need > cap:
            raise ConfigError(
                f"this request needs {need} KV-cache positions ({len(embeds)} prompt + up to {max_len} speech tokens "
                f"for {len(text)} text tokens) but the model directory was exported with max_len={cap}; shorten the "
                "text (split it into sentences), use a shorter voice prompt, or re-export with a larger --max-len"
            )
        if cache is not None:
            cache.check_row(row)
        request = TokenRequest(self, embeds, min_len, max_len, sampling, draw or RngDraw(seed), cache, row)
        request.mask_stops = budget[0] is not None
        if prompt_text.size:  # [sos, (v1: speaker,) prompt_text] is a prefix of its own
            request.prefix = prefix_key(prompt_text, speaker if self.text_encoder is not None else None)
        return request

    def generate(self, text: Sequence[int] | np.ndarray, *args: object, **kw: object) -> Iterator[int]:
        """Shorthand for ``iter(self.request(text, ...))``: speech tokens one at a time."""
        return iter(self.request(text, *args, **kw))


class TokenRequest:
    """One request's decoding state; iterate it (once) for the speech tokens.

    Attributes:
        tokens: the speech tokens yielded so far. min_len, max_len: the token budget.
        stop_reason: None while running, then ``"stop"`` (a stop id was drawn; ``stop_token`` holds it) or
            ``"max_len"``.
    """

    def __init__(
        self,
        gen: SpeechTokenGenerator,
        embeds: np.ndarray,
        min_len: int,
        max_len: int,
        sampling: SamplingConfig,
        draw: Draw,
        cache: LMCache | None,
        row: int,
    ) -> None:
        self.gen, self.embeds, self.sampling, self.draw = gen, embeds, sampling, draw
        self.min_len, self.max_len = min_len, max_len
        self.cache, self.row = cache, row
        self.tokens: list[int] = []
        self.stop_reason: str | None = None
        self.stop_token: int | None = None
        self.mask_stops = False  # keep all stop ids (not only EOS) out while below min_len
        self.prefix: tuple[bytes, int] | None = None  # (key, positions) of the cached leading positions
        self._started = False

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def attach(self, cache: LMCache, row: int) -> None:
        """Decode into ``cache`` row ``row`` (a scheduler's shared cache); before :meth:`prefill`."""
        cache.check_row(row)
        self.cache, self.row = cache, row

    def prefill(self) -> np.ndarray:
        """Reset the row and run the prompt through the LM; returns logp (V,) for the first token."""
        if self.cache is None:
            self.cache, self.row = self.gen.session.new_cache(1), 0
        if self.prefix is None:
            self.cache.reset(self.row)
            return self.gen.session.prefill(self.cache, self.row, self.embeds)
        key, n = self.prefix
        self.gen.prefixes.load(self.cache, self.row, key, self.embeds[:n])
        return self.gen.session.prefill(self.cache, self.row, self.embeds[n:])

    def advance(self, logp: np.ndarray) -> int | None:
        """Sample the next token from ``logp`` (V,); None once the request is over (``stop_reason`` set).

        After a token, the caller feeds it back (one decode step) unless the request is then ``finished``
        (it reached ``max_len``: the last token is never fed back).
        """
        facts, out = self.gen.facts, self.tokens
        i = len(out)
        if self.stop_reason is not None or i >= self.max_len:
            self.stop_reason = self.stop_reason or "max_len"
            return None
        if self.mask_stops and i < self.min_len:
            logp = np.array(logp, dtype=np.float32)
            logp[list(facts.stop_ids)] = -np.inf
        token = sample_next(logp, out, self.sampling, self.draw, facts.min_len_masked_id, ignore_eos=i < self.min_len)
        if token in facts.stop_ids:
            self.stop_reason, self.stop_token = "stop", token
            logger.debug("request stopped by %d after %d tokens", token, len(out))
            return None
        out.append(token)
        if len(out) >= self.max_len:
            self.stop_reason = "max_len"
            logger.debug("request reached max_len %d", self.max_len)
        return token

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise ConfigError("a TokenRequest can be iterated only once; make a new request to generate again")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[int]:
        """Prefill, then sample/feed until a stop id or max_len; yields speech token ids."""
        logp = self.prefill()
        while (token := self.advance(logp)) is not None:
            yield token
            if self.finished:
                return
            logp = self.gen.session.decode(self.cache, [self.row], [token])[0]
