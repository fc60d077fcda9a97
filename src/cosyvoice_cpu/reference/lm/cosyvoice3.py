"""Fun-CosyVoice3's speech-token language model (``CosyVoice3LM``): text + prompt -> speech tokens.

Same Qwen2 backbone, prompt assembly and decoding loop as CosyVoice2 (:mod:`.common`), different ends:

- no ``llm_embedding``: the special inputs are rows of ``speech_embedding`` (S + 200 rows, S = 6561):
  sos = S, eos = S + 1, task_id = S + 2, fill = S + 3 (bistream only);
- ``llm_decoder`` is a bias-free Linear(D, S + 200); decoding stops at the first id >= S (any of the 200);
- the prefill input is ``[speech_emb[sos], embed_tokens(prompt_text ⊕ text), speech_emb[task_id],
  speech_emb(prompt_speech)]`` (1, 1 + Tp + Tt + 1 + Ts, D);
- ``prompt_text ⊕ text`` must contain ``<|endofprompt|>`` (id 151646, hard-coded upstream): the official code
  asserts it; we raise :class:`~cosyvoice_cpu.errors.ConfigError`;
- while fewer than ``min_len`` tokens are decoded the official ``sampling_ids`` sets index S to -inf. In v3 that
  row is *sos*, not eos, so below ``min_len`` an eos (S + 1) or any other id >= S can still be drawn and stops
  decoding. We reproduce that (``QwenLMConfig.min_len_masked_id``).

After the LM, ``CosyVoice3Model.llm_job`` drops silent/breath tokens (:data:`SILENT_TOKENS`) once more than
:data:`MAX_SILENT_RUN` of them come in a row (any mix of them; any other token resets the count). The LM itself
still feeds every token back and keeps it in the RAS history; only the list handed to the flow loses them:
:class:`SilentRunFilter` / :func:`drop_long_silences`, and :meth:`CosyVoice3LM.generate` which applies it.

Parameter names match the released ``llm.pt``: ``llm.model.model.*`` (Qwen2), the tied ``llm.model.lm_head``,
``llm_decoder.weight``, ``speech_embedding.weight``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.lm.common import QwenLM, QwenLMConfig
from cosyvoice_cpu.reference.sampling import Draw, SamplingConfig

logger = logging.getLogger(__name__)

N_SPECIALS = 200  # extra rows/outputs after the S speech tokens
ENDOFPROMPT_ID = 151646  # <|endofprompt|> in the CosyVoice3 tokenizer; the official LM hard-codes it
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})  # FSQ silence / breath codes
MAX_SILENT_RUN = 5  # a run keeps its first 5 silent tokens; the rest are dropped


@dataclass
class CosyVoice3LMConfig(QwenLMConfig):
    """The ``llm: !new:cosyvoice.llm.llm.CosyVoice3LM`` entry of ``cosyvoice3.yaml`` + the Qwen2 backbone shape."""

    LM_CLASS: ClassVar[str] = "CosyVoice3LM"

    n_specials: int = N_SPECIALS
    endofprompt_id: int = ENDOFPROMPT_ID

    @property
    def sos_id(self) -> int:
        return self.speech_token_size

    @property
    def eos_id(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill_id(self) -> int:
        return self.speech_token_size + 3

    @property
    def n_outputs(self) -> int:
        return self.speech_token_size + self.n_specials

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.n_outputs))

    def validate(self) -> None:
        super().validate()
        if self.n_specials < 4:
            raise ConfigError(f"CosyVoice3LM needs >= 4 special rows (sos, eos, task_id, fill), got {self.n_specials}")
        if not 0 <= self.endofprompt_id < self.qwen.vocab_size:
            raise ConfigError(
                f"<|endofprompt|> id {self.endofprompt_id} is outside the text vocabulary ({self.qwen.vocab_size} rows "
                "in CosyVoice-BlankEN/config.json); CosyVoice3 needs the real Qwen2 vocabulary size 151936"
            )


class SilentRunFilter:
    """Streaming form of the official ``llm_job`` rule: ``keep(token)`` is False for the 6th and later silent
    token of a run of consecutive :data:`SILENT_TOKENS` (any mix of them); a non-silent token ends the run."""

    def __init__(self, silent: Iterable[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN) -> None:
        self.silent = frozenset(silent)
        self.max_run = max_run
        self.run = 0

    def keep(self, token: int) -> bool:
        if token not in self.silent:
            self.run = 0
            return True
        self.run += 1
        return self.run <= self.max_run


def drop_long_silences(tokens: Iterable[int], max_run: int = MAX_SILENT_RUN) -> list[int]:
    """The tokens the official ``CosyVoice3Model`` passes to the flow: runs of silent tokens cut to ``max_run``."""
    f = SilentRunFilter(max_run=max_run)
    return [t for t in tokens if f.keep(t)]


class CosyVoice3LM(QwenLM):
    """CosyVoice3 LM: Qwen2 backbone with KV cache, 6761-row speech embedding/head (sos and task_id among its
    rows), RAS decoding loop (:class:`~cosyvoice_cpu.reference.lm.common.QwenLM`); log-probabilities have S + 200
    entries."""

    cfg: CosyVoice3LMConfig

    def __init__(self, cfg: CosyVoice3LMConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.llm_input_size
        self._add_backbone(cfg)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.n_outputs, bias=False)
        self.speech_embedding = nn.Embedding(cfg.n_outputs, d)

    def special_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """sos and task_id: rows S and S + 2 of ``speech_embedding``."""
        w = self.speech_embedding.weight
        return w[self.cfg.sos_id], w[self.cfg.task_id]

    def check_text(self, tokens: torch.Tensor) -> None:
        """``prompt_text ⊕ text`` (1, T) must hold ``<|endofprompt|>`` (the official ``assert 151646 in text``)."""
        if not bool((tokens == self.cfg.endofprompt_id).any()):
            raise ConfigError(
                f"CosyVoice3 needs <|endofprompt|> (id {self.cfg.endofprompt_id}) in prompt_text or text, as the "
                "official model asserts: end the prompt with it, e.g. prompt text 'You are a helpful assistant."
                "<|endofprompt|>' + transcript (zero-shot) or instruction + '<|endofprompt|>' (instruct)"
            )

    def generate(
        self,
        text: torch.Tensor,
        prompt_text: torch.Tensor,
        prompt_speech_token: torch.Tensor,
        draw: Draw | None = None,
        sampling: SamplingConfig | None = None,
    ) -> list[int]:
        """The speech tokens the official ``CosyVoice3Model`` hands to the flow: :meth:`inference` then the
        silent-run filter (:func:`drop_long_silences`)."""
        return drop_long_silences(self.inference(text, prompt_text, prompt_speech_token, draw, sampling))

    def stream(
        self,
        text: torch.Tensor,
        prompt_text: torch.Tensor,
        prompt_speech_token: torch.Tensor,
        draw: Draw | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Iterator[int]:
        """:meth:`generate` as a generator (tokens appear as they are decoded, silent runs cut)."""
        f = SilentRunFilter()
        for token in self.inference(text, prompt_text, prompt_speech_token, draw, sampling):
            if f.keep(token):
                yield token
