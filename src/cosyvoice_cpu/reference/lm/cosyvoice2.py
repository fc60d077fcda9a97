"""CosyVoice2's speech-token language model (``Qwen2LM``): text + prompt -> speech tokens.

The input sequence is ``[sos, embed_tokens(prompt_text ⊕ text), task_id, speech_embedding(prompt_speech)]``;
the Qwen2 backbone runs it once (prefill), then one position per decoded token. The last hidden state goes
through ``llm_decoder`` (a 6564-way head: 6561 speech tokens + EOS 6561 + two more stop ids) and a log-softmax,
then Repetition-Aware Sampling (the loop, the backbone and the prompt assembly: :mod:`.common`, shared with
Fun-CosyVoice3).

Parameter names match the released ``llm.pt`` (``llm.model.model.layers.N...``, the tied ``llm.model.lm_head``,
``llm_decoder``, ``speech_embedding``, ``llm_embedding``). Its siblings: CosyVoice-300M's ``TransformerLM``
(:mod:`.cosyvoice`) and Fun-CosyVoice3's ``CosyVoice3LM`` (:mod:`.cosyvoice3`: no ``llm_embedding``, specials
inside ``speech_embedding``, a bias-free head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from cosyvoice_cpu.reference.lm.common import QwenLM, QwenLMConfig

logger = logging.getLogger(__name__)

SOS, TASK_ID = 0, 1  # rows of llm_embedding


@dataclass
class LMConfig(QwenLMConfig):
    """The ``llm:`` entry of ``cosyvoice2.yaml`` plus the Qwen2 backbone shape from ``CosyVoice-BlankEN``."""

    LM_CLASS: ClassVar[str] = "Qwen2LM"

    @property
    def eos_id(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.speech_token_size + i for i in range(3))


class Qwen2LM(QwenLM):
    """CosyVoice2 LM: ``llm_embedding`` (sos, task_id), Qwen2 backbone, 6564-way speech head and embedding."""

    cfg: LMConfig

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d, s = cfg.llm_input_size, cfg.speech_token_size
        self.llm_embedding = nn.Embedding(2, d)
        self._add_backbone(cfg)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, s + 3)
        self.speech_embedding = nn.Embedding(s + 3, d)

    def special_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """sos and task_id: rows 0 and 1 of ``llm_embedding``."""
        w = self.llm_embedding.weight
        return w[SOS], w[TASK_ID]
