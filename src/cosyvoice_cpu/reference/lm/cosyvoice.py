"""CosyVoice-300M's speech-token language model (official ``cosyvoice.llm.llm.TransformerLM``), inference only.

    text ids (1, Tt) --text_embedding--> ConformerEncoder (6 layers, causal) --text_encoder_affine_layer-->
    [sos, spk_embed_affine(L2norm(x-vector)) (absent if no x-vector), text, task_id, speech_embedding(prompt)]
    --> 14-layer rel-pos Transformer (``llm``, KV cache) --> llm_decoder (4096 tokens + EOS) --> log-softmax --> RAS

Decoding stops on EOS (id 4096 = ``speech_token_size``) only; EOS is impossible at the first step (the official
loop sets its log-probability to -inf there) and while fewer than ``min_token_text_ratio * Tt`` tokens are out.
Parameter names equal the released ``llm.pt`` so it loads with ``strict=True``.

Limit of the official code that we do not share: its decoder takes relative-position encodings from a table built
for 5000 positions (``EspnetRelPositionalEncoding(max_len=5000)``) and ``forward_chunk`` never extends it, so at
5001 positions (prompt + text + decoded tokens) its attention silently goes wrong and from 5002 on it raises. We
compute the encodings for any position and log a warning when a decode may go past :data:`OFFICIAL_MAX_POSITIONS`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.espnet import ConformerEncoder, EncoderConfig, TransformerStack
from cosyvoice_cpu.reference.sampling import Draw, SamplingConfig, sample_next, sampling_from_yaml, torch_draw
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

SOS, TASK_ID = 0, 1  # rows of llm_embedding (the official ``sos_eos`` and ``task_id``)
# The official LM calls its text encoder with decoding_chunk_size=1 (llm.py, TransformerLM.encode).
TEXT_ENCODER_DECODING_CHUNK = 1
OFFICIAL_MAX_POSITIONS = 5000  # the official decoder's positional table (see the module docstring)


def _default_text_encoder() -> EncoderConfig:
    return EncoderConfig(
        input_size=512, output_size=1024, attention_heads=16, linear_units=4096, num_blocks=6, chunk_size=1
    )


def _default_llm() -> EncoderConfig:
    # chunk 1 = causal: the official loop drives this stack through forward_chunk with a tril mask, whatever
    # the yaml's static_chunk_size says (the released yaml says 1 too)
    return EncoderConfig(
        input_size=1024, output_size=1024, attention_heads=16, linear_units=4096, num_blocks=14, chunk_size=1
    )


@dataclass
class TransformerLMConfig:
    """The ``llm: !new:cosyvoice.llm.llm.TransformerLM`` entry; defaults are the released CosyVoice-300M."""

    text_encoder_input_size: int = 512
    llm_input_size: int = 1024
    llm_output_size: int = 1024
    text_token_size: int = 51866
    speech_token_size: int = 4096
    spk_embed_dim: int = 192
    text_encoder: EncoderConfig = field(default_factory=_default_text_encoder)
    llm: EncoderConfig = field(default_factory=_default_llm)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    @property
    def eos_id(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.speech_token_size,)

    def validate(self) -> None:
        for name in (
            "text_encoder_input_size",
            "llm_input_size",
            "llm_output_size",
            "text_token_size",
            "speech_token_size",
            "spk_embed_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"llm.{name} must be > 0, got {getattr(self, name)}")
        self.text_encoder.validate("llm.text_encoder")
        self.llm.validate("llm.llm")
        self.sampling.validate()
        if self.text_encoder.input_size != self.text_encoder_input_size:
            raise ConfigError(
                f"llm.text_encoder.input_size ({self.text_encoder.input_size}) must equal text_encoder_input_size "
                f"({self.text_encoder_input_size})"
            )
        if (self.llm.input_size, self.llm.output_size) != (self.llm_input_size, self.llm_output_size):
            raise ConfigError(
                f"llm.llm input/output sizes ({self.llm.input_size}/{self.llm.output_size}) must equal "
                f"llm_input_size/llm_output_size ({self.llm_input_size}/{self.llm_output_size})"
            )
        if not 0 <= self.min_token_text_ratio <= self.max_token_text_ratio:
            raise ConfigError(
                f"need 0 <= min_token_text_ratio ({self.min_token_text_ratio}) <= "
                f"max_token_text_ratio ({self.max_token_text_ratio})"
            )

    @classmethod
    def from_yaml(cls, node: Any) -> TransformerLMConfig:
        """Build from the yaml's ``llm:`` node (a :class:`Tagged` from :func:`load_yaml_data`)."""
        if not isinstance(node, Tagged) or node.class_name != "TransformerLM":
            name = node.target if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(f"expected a TransformerLM llm entry, got {name}")
        for key in ("text_encoder", "llm"):
            if key not in node.args:
                raise ConfigError(f"llm: TransformerLM needs a {key!r} entry")
        sampling = sampling_from_yaml(node.get("sampling"))
        cfg = cls(
            text_encoder_input_size=int(node["text_encoder_input_size"]),
            llm_input_size=int(node["llm_input_size"]),
            llm_output_size=int(node["llm_output_size"]),
            text_token_size=int(node["text_token_size"]),
            speech_token_size=int(node["speech_token_size"]),
            spk_embed_dim=int(node.get("spk_embed_dim", 192)),
            text_encoder=EncoderConfig.from_yaml(
                node["text_encoder"], "ConformerEncoder", "llm.text_encoder", TEXT_ENCODER_DECODING_CHUNK
            ),
            llm=replace(EncoderConfig.from_yaml(node["llm"], "TransformerEncoder", "llm.llm"), chunk_size=1),
            sampling=sampling,
        )
        cfg.validate()
        return cfg


class TransformerLM(nn.Module):
    """CosyVoice-300M LM: text encoder, speaker/sos/task embeddings, 14-layer decoder with KV cache, RAS loop."""

    def __init__(self, cfg: TransformerLMConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or TransformerLMConfig()
        cfg.validate()
        self.cfg = cfg
        d = cfg.llm_input_size
        # registration order = the official module's, so state_dict() lists keys as llm.pt does
        self.text_embedding = nn.Embedding(cfg.text_token_size, cfg.text_encoder_input_size)
        self.text_encoder = ConformerEncoder(cfg.text_encoder)
        self.text_encoder_affine_layer = nn.Linear(cfg.text_encoder.output_size, d)
        self.llm_embedding = nn.Embedding(2, d)
        self.llm = TransformerStack(cfg.llm)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(cfg.speech_token_size, d)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, d)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """Text ids ``(1, T)`` -> ``(1, T, D)``: embedding, causal Conformer, affine layer."""
        x = self.text_embedding(tokens.long())
        h, _ = self.text_encoder(x, torch.tensor([tokens.shape[1]]))
        return self.text_encoder_affine_layer(h)

    def prompt_embeddings(
        self,
        text: torch.Tensor,
        prompt_text: torch.Tensor,
        prompt_speech_token: torch.Tensor,
        embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prefill input ``(1, L, D)``.

        Args:
            text: (1, Tt) ids to speak; prompt_text: (1, Tp) transcript of the prompt (may be empty).
            prompt_speech_token: (1, Ts) speech tokens of the prompt (may be empty).
            embedding: (1, 192) x-vector, or None / a (0, 192) tensor for none (v1 instruct mode).
        Returns:
            ``[sos, spk (if any), encode_text(prompt_text ⊕ text), task_id, speech_embedding(prompt)]``,
            L = 1 + (1) + Tp + Tt + 1 + Ts. The text encoder sees prompt and text as one causal sequence.
        """
        for name, t in (("text", text), ("prompt_text", prompt_text), ("prompt_speech_token", prompt_speech_token)):
            if t.dim() != 2 or t.shape[0] != 1:
                raise ConfigError(f"{name} must have shape (1, T), got {tuple(t.shape)}")
        w = self.llm_embedding.weight
        parts = [w[SOS].view(1, 1, -1)]
        if embedding is not None and embedding.shape[0] != 0:
            if embedding.shape != (1, self.cfg.spk_embed_dim):
                raise ConfigError(f"embedding must be (1, {self.cfg.spk_embed_dim}), got {tuple(embedding.shape)}")
            parts.append(self.spk_embed_affine_layer(F.normalize(embedding, dim=1)).unsqueeze(1))
        parts += [self.encode_text(torch.cat([prompt_text, text], dim=1)), w[TASK_ID].view(1, 1, -1)]
        if prompt_speech_token.shape[1]:
            parts.append(self.speech_embedding(prompt_speech_token.long()))
        return torch.cat(parts, dim=1)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Speech-token log-probabilities: hidden (..., D) -> (..., S+1)."""
        return self.llm_decoder(hidden).log_softmax(dim=-1)

    @torch.inference_mode()
    def forward_full(self, embeds: torch.Tensor) -> torch.Tensor:
        """Log-probabilities at every position of ``embeds (1, L, D)`` from a fresh cache -> (1, L, S+1)."""
        self.llm.setup_cache(embeds.shape[1])
        return self.head(self.llm(embeds, 0))

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, max_len: int) -> torch.Tensor:
        """Allocate a cache of ``max_len`` positions, run ``embeds (1, L, D)``; return logp (S+1,) at L-1."""
        self.llm.setup_cache(max_len)
        return self.head(self.llm(embeds, 0)[0, -1])

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int) -> torch.Tensor:
        """Feed speech token ``token`` at position ``pos`` (cache holds 0..pos-1); return logp (S+1,)."""
        x = self.speech_embedding.weight[token].view(1, 1, -1)
        return self.head(self.llm(x, pos)[0, -1])

    @torch.inference_mode()
    def inference(
        self,
        text: torch.Tensor,
        prompt_text: torch.Tensor,
        prompt_speech_token: torch.Tensor,
        embedding: torch.Tensor | None = None,
        draw: Draw | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Iterator[int]:
        """Generate speech tokens one at a time (a generator, as the official ``TransformerLM.inference``).

        Args: as :meth:`prompt_embeddings`; ``draw`` is the random source (default: torch's global RNG through
        ``torch.multinomial``, as the official code), ``sampling`` overrides ``cfg.sampling``.
        Yields:
            ids in [0, 4096): at least ``min_token_text_ratio * Tt`` (unless ``max`` comes first) and at most
            ``max_token_text_ratio * Tt`` of them (Tt = text tokens, prompt transcript excluded).
        """
        cfg = self.cfg
        sampling = sampling or cfg.sampling
        draw = draw or torch_draw()
        n_text = text.shape[1]
        if n_text == 0:
            raise ConfigError("text is empty: give at least one text token to speak")
        min_len = int(n_text * cfg.min_token_text_ratio)
        max_len = int(n_text * cfg.max_token_text_ratio)
        embeds = self.prompt_embeddings(text, prompt_text, prompt_speech_token, embedding)
        pos = embeds.shape[1]
        if pos + max_len > OFFICIAL_MAX_POSITIONS:
            logger.warning(
                "prompt + text + up to %d speech tokens = %d positions: past %d the official TransformerLM fails, "
                "so tokens from there on have no official counterpart; split the text",
                max_len,
                pos + max_len,
                OFFICIAL_MAX_POSITIONS,
            )
        logp = self.prefill(embeds, pos + max_len)
        out: list[int] = []
        for i in range(max_len):
            if i == 0:  # the official loop never lets the first token be EOS, whatever min_len says
                logp = logp.clone()
                logp[cfg.eos_id] = -float("inf")
            token = sample_next(logp, out, sampling, draw, cfg.eos_id, ignore_eos=i < min_len)
            if token == cfg.eos_id:
                break
            yield token
            out.append(token)
            if i + 1 < max_len:
                logp = self.decode_step(token, pos)
                pos += 1
