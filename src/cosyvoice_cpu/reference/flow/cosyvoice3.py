"""Fun-CosyVoice3 flow (speech tokens -> 80-bin mel): the official ``CausalMaskedDiffWithDiT``, inference only.

    tokens (1, T_p + T) --Embedding(6561, 80)--> (1, T_tok, 80) * valid
        --PreLookaheadLayer (Conv1d k=4 over the next 3 tokens, 80->1024, LeakyReLU, causal Conv1d k=3,
          1024->80, residual)--> --repeat_interleave(2)--> mu (1, 80, T_mel)
    x-vector (1, 192) --L2 normalise, Linear--> spks (1, 80)
    prompt mel (1, T_pm, 80) --> cond (1, 80, T_mel): the prompt frames, then zeros
    CausalConditionalCFM: 10 Euler steps on the cosine schedule from the fixed noise, CFG 0.7 (one batch-2
    :class:`~cosyvoice_cpu.reference.flow.dit.DiT` call per step) --> mel (1, 80, T_mel - T_pm)

There is no conformer encoder and no ``encoder_proj``: the look-ahead layer's output *is* mu. The CFM solver,
its time bookkeeping and the fixed noise are v2's (:class:`~cosyvoice_cpu.reference.flow.cfm.ConditionalCFM`): the
v3 ``CausalConditionalCFM`` is the same class, so ``set_all_random_seed(0); randn(1, 80, 15000)`` is the same
tensor as v2's. ``finalize=False`` (a non-final streaming chunk) feeds the last ``pre_lookahead_len`` tokens to
the look-ahead conv only; ``streaming=True`` makes the DiT attention chunk-causal (50 frames).

``FlowV3.state_dict()`` has exactly the keys and shapes of the official module (``flow.pt`` loads strictly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.flow.cfm import CFMConfig, ConditionalCFM, class_args, need
from cosyvoice_cpu.reference.flow.common import FlowConditions
from cosyvoice_cpu.reference.flow.dit import DiT, DiTConfig
from cosyvoice_cpu.reference.flow.encoder import PreLookaheadLayer, valid_mask
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

FLOW_V3_CLASS = "CausalMaskedDiffWithDiT"


@dataclass
class FlowV3Config:
    """``CausalMaskedDiffWithDiT`` configuration; defaults are the released Fun-CosyVoice3-0.5B values."""

    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    input_frame_rate: int = 25
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    estimator: DiTConfig = field(default_factory=DiTConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first inconsistent field."""
        for name in ("input_size", "output_size", "spk_embed_dim", "vocab_size", "token_mel_ratio"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.pre_lookahead_len >= 1, "pre_lookahead_len", "must be >= 1 (the look-ahead conv has k = len + 1)")
        need(self.pre_lookahead_channels > 0, "pre_lookahead_layer.channels", "must be > 0")
        need(self.output_size == 80, "output_size", "must be 80 (the CFM solver and its fixed noise are 80-bin)")
        need(
            self.estimator.mu_dim == self.input_size,
            "estimator.mu_dim",
            "must equal input_size (mu is the look-ahead layer's output)",
        )
        need(self.estimator.mel_dim == self.output_size, "estimator.mel_dim", "must equal output_size")
        need(self.estimator.spk_dim in (0, self.output_size), "estimator.spk_dim", "must be 0 or output_size")
        need(self.cfm.spk_emb_dim == self.output_size, "cfm.spk_emb_dim", "must equal output_size")
        self.estimator.validate()
        self.cfm.validate()

    @classmethod
    def from_yaml(cls, node: Tagged) -> FlowV3Config:
        """Read the ``flow:`` entry (``!new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT``) of a
        :func:`~cosyvoice_cpu.reference.yamlconf.load_yaml_data` result; absent keys take the official
        constructor's defaults."""
        if not isinstance(node, Tagged) or node.class_name != FLOW_V3_CLASS:
            name = node.class_name if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(f"flow config: class {name} is not {FLOW_V3_CLASS} (use FlowConfig for CosyVoice2)")
        a: dict[str, Any] = node.args if isinstance(node.args, dict) else {}
        look = class_args(node.get("pre_lookahead_layer"), "PreLookaheadLayer", "flow.pre_lookahead_layer")
        decoder = node.get("decoder")
        if decoder is None or decoder.get("estimator") is None:
            raise ConfigError("flow config: flow.decoder.estimator is missing (a DiT is required)")
        input_size = int(a.get("input_size", 512))
        pre_len = int(a.get("pre_lookahead_len", 3))
        need(
            int(look.get("in_channels", input_size)) == input_size,
            "pre_lookahead_layer.in_channels",
            "must equal flow input_size",
        )
        need(
            int(look.get("pre_lookahead_len", 1)) == pre_len,
            "pre_lookahead_layer.pre_lookahead_len",
            "must equal flow pre_lookahead_len (the official code asserts it on every streaming chunk)",
        )
        cfg = cls(
            input_size=input_size,
            output_size=int(a.get("output_size", 80)),
            spk_embed_dim=int(a.get("spk_embed_dim", 192)),
            vocab_size=int(a.get("vocab_size", 4096)),
            input_frame_rate=int(a.get("input_frame_rate", 50)),
            token_mel_ratio=int(a.get("token_mel_ratio", 2)),
            pre_lookahead_len=pre_len,
            pre_lookahead_channels=int(look.get("channels", 1024)),
            estimator=DiTConfig.from_yaml(decoder.get("estimator")),
            cfm=CFMConfig.from_yaml(decoder),
        )
        cfg.validate()
        return cfg


class WidePreLookahead(PreLookaheadLayer):
    """v3 ``PreLookaheadLayer``: v2's layer with a hidden width (80 -> 1024 -> 80) instead of in == hidden."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int) -> None:
        nn.Module.__init__(self)
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)


class FlowV3(nn.Module):
    """Fun-CosyVoice3 flow; ``state_dict`` keys/shapes equal the official ``CausalMaskedDiffWithDiT``."""

    def __init__(self, config: FlowV3Config | None = None) -> None:
        super().__init__()
        self.config = config = config or FlowV3Config()
        config.validate()
        self.token_mel_ratio = config.token_mel_ratio
        self.pre_lookahead_len = config.pre_lookahead_len
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.pre_lookahead_layer = WidePreLookahead(
            config.input_size, config.pre_lookahead_channels, config.pre_lookahead_len
        )
        self.decoder = ConditionalCFM(config.cfm, DiT(config.estimator))

    @torch.inference_mode()
    def encode(
        self,
        token: torch.Tensor,
        token_len: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_token_len: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
        finalize: bool = True,
    ) -> FlowConditions:
        """Everything before the ODE: speaker projection, token embedding + look-ahead, prompt condition.

        Args:
            token: (1, T) speech tokens to synthesise (negative ids are clamped to 0); token_len (1,).
            prompt_token: (1, T_p) prompt tokens; prompt_token_len (1,).
            prompt_feat: (1, T_pm, 80) prompt mel (T_pm should be token_mel_ratio * T_p).
            embedding: (1, 192) speaker x-vector (L2-normalised here).
            finalize: False for a non-final streaming chunk: the last ``pre_lookahead_len`` tokens are look-ahead
                context only and produce no frames.
        Returns:
            :class:`~cosyvoice_cpu.reference.flow.common.FlowConditions`,
            T_mel = 2 * (T_p + T [- 3 if not finalize]).
        """
        if token.size(0) != 1:
            raise ValueError(f"flow inference takes batch 1, got token batch {token.size(0)}")
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        token = torch.cat([prompt_token, token], dim=1)
        token_len = prompt_token_len + token_len
        valid = valid_mask(token_len, token.size(1)).unsqueeze(-1).to(spks.dtype)
        xs = self.input_embedding(torch.clamp(token, min=0)) * valid
        if finalize:
            h = self.pre_lookahead_layer(xs)
        else:
            n = self.pre_lookahead_len
            if xs.size(1) <= n:
                raise ValueError(f"a non-final chunk needs more than {n} tokens (prompt included), got {xs.size(1)}")
            h = self.pre_lookahead_layer(xs[:, :-n], context=xs[:, -n:])
        mu = h.repeat_interleave(self.token_mel_ratio, dim=1).transpose(1, 2).contiguous()
        return FlowConditions.of(mu, spks, prompt_feat)

    @torch.inference_mode()
    def inference(
        self,
        token: torch.Tensor,
        token_len: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_token_len: torch.Tensor,
        prompt_feat: torch.Tensor,
        prompt_feat_len: torch.Tensor | None,
        embedding: torch.Tensor,
        streaming: bool = False,
        finalize: bool = True,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Tokens -> mel, as the official ``CausalMaskedDiffWithDiT.inference``.

        Arguments as :meth:`encode` (``prompt_feat_len`` is unused, as upstream); ``streaming`` selects the
        DiT's chunk-causal attention; ``n_timesteps`` (default 10), ``cfg_rate`` (default 0.7) and ``noise``
        ((1, 80, >= T_mel), default the official fixed noise) as :meth:`ConditionalCFM.forward`.
        Returns:
            (mel (1, 80, mel_len2) float32 without the prompt frames, None) — the official return shape.
        """
        c = self.encode(token, token_len, prompt_token, prompt_token_len, prompt_feat, embedding, finalize)
        if c.mel_len2 <= 0:
            raise ValueError(f"prompt_feat has {c.mel_len1} frames but the tokens give only {c.mu.size(2)}")
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, n_timesteps, cfg_rate, streaming=streaming, noise=noise)
        return mel[:, :, c.mel_len1 :], None
