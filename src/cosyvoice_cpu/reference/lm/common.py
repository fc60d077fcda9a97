"""What the Qwen2 speech-token LMs of CosyVoice2 (:mod:`.cosyvoice2`) and Fun-CosyVoice3 (:mod:`.cosyvoice3`) share:
the yaml's ``llm:`` entry read into a config (:class:`QwenLMConfig`) and the module (:class:`QwenLM`): the Qwen2
backbone with its KV cache under the released ``llm.model.model`` keys, the speech head, the prompt assembly
``[sos, embed_tokens(prompt_text ⊕ text), task_id, speech_embedding(prompt_speech)]`` and the RAS decoding loop.

Each family's subclass says where its special rows live, how many outputs its head has and which ids stop decoding.
Unlike the official code we never compute the 151,936-way text logits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.lm.qwen2 import Qwen2Config, Qwen2Model
from cosyvoice_cpu.reference.sampling import Draw, SamplingConfig, sample_next, sampling_from_yaml, torch_draw
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)


@dataclass
class QwenLMConfig:
    """The ``llm:`` entry of a Qwen2-LM yaml plus the Qwen2 backbone shape from ``CosyVoice-BlankEN``; a family's
    subclass names its yaml class (:attr:`LM_CLASS`) and its stop ids."""

    LM_CLASS: ClassVar[str] = ""

    qwen: Qwen2Config = field(default_factory=Qwen2Config)
    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    @property
    def eos_id(self) -> int:
        raise NotImplementedError

    @property
    def stop_ids(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def min_len_masked_id(self) -> int:
        """The id masked while fewer than ``min_len`` tokens are decoded: the official ``sampling_ids`` masks
        index ``speech_token_size`` (CosyVoice2: EOS; Fun-CosyVoice3: its sos row, see :mod:`.cosyvoice3`)."""
        return self.speech_token_size

    def validate(self) -> None:
        self.qwen.validate()
        self.sampling.validate()
        if self.llm_input_size != self.qwen.hidden_size or self.llm_output_size != self.qwen.hidden_size:
            raise ConfigError(
                f"llm_input_size/llm_output_size ({self.llm_input_size}/{self.llm_output_size}) must equal "
                f"the Qwen2 hidden_size {self.qwen.hidden_size} of CosyVoice-BlankEN/config.json"
            )
        if self.speech_token_size <= 0:
            raise ConfigError(f"speech_token_size must be positive, got {self.speech_token_size}")
        if not 0 <= self.min_token_text_ratio <= self.max_token_text_ratio:
            raise ConfigError(
                f"need 0 <= min_token_text_ratio ({self.min_token_text_ratio}) <= "
                f"max_token_text_ratio ({self.max_token_text_ratio})"
            )

    @classmethod
    def from_yaml(cls, node: Tagged, qwen: Qwen2Config) -> QwenLMConfig:
        """Build from the yaml's ``llm: !new:cosyvoice.llm.llm.<LM_CLASS>`` node and the backbone config."""
        if node.class_name != cls.LM_CLASS:
            raise ConfigError(f"expected a {cls.LM_CLASS} llm entry, got {node.target}")
        cfg = cls(
            qwen=qwen,
            llm_input_size=int(node.get("llm_input_size", 896)),
            llm_output_size=int(node.get("llm_output_size", 896)),
            speech_token_size=int(node.get("speech_token_size", 6561)),
            sampling=sampling_from_yaml(node.get("sampling")),
        )
        cfg.validate()
        return cfg


class _Scope(nn.Module):
    """An empty module used only to reproduce the checkpoint's key nesting (``llm.model.model``)."""


class QwenLM(nn.Module):
    """A Qwen2 speech-token LM: embeddings, Qwen2 backbone with KV cache, speech head, RAS decoding loop.

    A family's subclass registers its modules in ``__init__`` (in the released order: random initialisation
    draws in that order) and gives :meth:`special_rows`.
    """

    cfg: QwenLMConfig
    speech_embedding: nn.Embedding
    llm_decoder: nn.Linear

    def _add_backbone(self, cfg: QwenLMConfig) -> None:
        """Register ``llm.model.model`` (Qwen2) and ``llm.model.lm_head``, the keys of the released ``llm.pt``.
        The checkpoint carries Qwen's tied text head; it is loaded, never computed."""
        self.llm = _Scope()
        self.llm.model = _Scope()
        self.llm.model.model = Qwen2Model(cfg.qwen)
        self.llm.model.lm_head = nn.Linear(cfg.llm_input_size, cfg.qwen.vocab_size, bias=False)
        if cfg.qwen.tie_word_embeddings:
            self.llm.model.lm_head.weight = self.backbone.embed_tokens.weight

    @property
    def backbone(self) -> Qwen2Model:
        return self.llm.model.model

    def special_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings (D,) of sos and task_id."""
        raise NotImplementedError

    def prompt_embeddings(
        self, text: torch.Tensor, prompt_text: torch.Tensor, prompt_speech_token: torch.Tensor
    ) -> torch.Tensor:
        """The prefill input: text (1, Tt), prompt_text (1, Tp), prompt_speech_token (1, Ts) int -> (1, T, D).

        T = 1 + Tp + Tt + 1 + Ts.
        """
        for name, t in (("text", text), ("prompt_text", prompt_text), ("prompt_speech_token", prompt_speech_token)):
            if t.dim() != 2 or t.shape[0] != 1:
                raise ConfigError(f"{name} must have shape (1, T), got {tuple(t.shape)}")
        sos, task = self.special_rows()
        toks = torch.cat([prompt_text, text], dim=1).long()
        parts = [sos.view(1, 1, -1), self.backbone.embed_tokens(toks), task.view(1, 1, -1)]
        if prompt_speech_token.shape[1]:
            parts.append(self.speech_embedding(prompt_speech_token.long()))
        return torch.cat(parts, dim=1)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Speech-token log-probabilities: hidden (..., D) -> (..., V) (V: the head's outputs)."""
        return self.llm_decoder(hidden).log_softmax(dim=-1)

    @torch.inference_mode()
    def forward_full(self, embeds: torch.Tensor) -> torch.Tensor:
        """Log-probabilities at every position of embeds (1, T, D) without a cache -> (1, T, V)."""
        pos = torch.arange(embeds.shape[1])
        return self.head(self.backbone(embeds, pos, use_cache=False))

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, max_len: int) -> torch.Tensor:
        """Allocate a cache of ``max_len`` positions, run embeds (1, T, D); return logp (V,) at T-1."""
        self.backbone.setup_cache(1, max_len)
        pos = torch.arange(embeds.shape[1])
        return self.head(self.backbone(embeds, pos)[0, -1])

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        """Feed speech token ``token`` at position ``pos`` (cache holds 0..pos-1); return logp (V,)."""
        x = self.speech_embedding.weight[token].view(1, 1, -1)
        return self.head(self.backbone(x, torch.tensor([pos]))[0, -1])

    def check_text(self, tokens: torch.Tensor) -> None:
        """Validate ``prompt_text ⊕ text`` (1, T) before decoding (any ids pass unless the family says otherwise)."""

    @torch.inference_mode()
    def inference(
        self,
        text: torch.Tensor,
        prompt_text: torch.Tensor,
        prompt_speech_token: torch.Tensor,
        draw: Draw | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Iterator[int]:
        """Generate speech tokens one at a time (a generator, as the official ``Qwen2LM.inference``).

        Args:
            text: (1, Tt) text token ids to speak; prompt_text: (1, Tp) transcript of the prompt (may be empty).
            prompt_speech_token: (1, Ts) speech tokens of the prompt audio (may be empty).
            draw: random source for sampling (default: torch's global RNG through ``torch.multinomial``).
            sampling: overrides ``cfg.sampling``.
        Yields:
            speech token ids in [0, speech_token_size); between ``min_token_text_ratio`` and
            ``max_token_text_ratio`` times Tt tokens, ending at the first stop id.
        """
        cfg = self.cfg
        sampling = sampling or cfg.sampling
        draw = draw or torch_draw()
        n_text = text.shape[1]
        if n_text == 0:
            raise ConfigError("text is empty: give at least one text token to speak")
        self.check_text(torch.cat([prompt_text, text], dim=1))
        min_len = int(n_text * cfg.min_token_text_ratio)
        max_len = int(n_text * cfg.max_token_text_ratio)
        embeds = self.prompt_embeddings(text, prompt_text, prompt_speech_token)
        pos = embeds.shape[1]
        logp = self.prefill(embeds, pos + max_len)
        out: list[int] = []
        for i in range(max_len):
            token = sample_next(logp, out, sampling, draw, cfg.min_len_masked_id, ignore_eos=i < min_len)
            if token in cfg.stop_ids:
                break
            yield token
            out.append(token)
            if i + 1 < max_len:
                logp = self.decode_step(token, pos)
                pos += 1
