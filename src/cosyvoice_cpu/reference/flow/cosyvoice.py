"""CosyVoice-300M flow (speech tokens -> 80-bin mel): the official ``MaskedDiffWithXvec``, inference only.

    [prompt tokens, tokens] --Embedding--> ConformerEncoder (full attention) --encoder_proj--> (1, T1+T2, 80)
    --InterpolateRegulator: prompt part -> mel_len1 = prompt mel frames, new part -> mel_len2 =
      int(T2 / 50 * 22050 / 256) frames (see :mod:`.length_regulator`)--> mu (1, 80, mel_len1 + mel_len2)
    x-vector (1, 192) --L2 normalise, Linear--> spks (1, 80); prompt mel --> cond (prompt frames, then zeros)
    ConditionalCFM: 10 Euler steps on the cosine schedule with CFG 0.7 (:class:`.cfm.ConditionalCFM`) over the
    :class:`.unet.UNetEstimator`, from Gaussian noise.

Unlike v2 (one fixed noise tensor), the official v1 draws fresh noise every call (``torch.randn_like(mu)``);
here the noise is an argument (or drawn from a given ``torch.Generator``; with neither, from torch's global RNG
exactly as the official call does). Streaming v1 passes a ``flow_cache`` (1, 80, n, 2) of the previous call's
noise and mu for the prompt frames and the last 34 frames, which overwrite the start of this call's noise and mu.
``FlowV1.state_dict()`` has the keys and shapes of the released ``flow.pt``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.espnet import ConformerEncoder, EncoderConfig
from cosyvoice_cpu.reference.flow.cfm import CFMConfig, ConditionalCFM, need
from cosyvoice_cpu.reference.flow.common import FlowConditions
from cosyvoice_cpu.reference.flow.encoder import valid_mask
from cosyvoice_cpu.reference.flow.length_regulator import InterpolateRegulator, frames_for_tokens
from cosyvoice_cpu.reference.flow.unet import UNetEstimator, UNetEstimatorConfig
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

CACHE_TAIL_FRAMES = 34  # the official ConditionalCFM keeps the last 34 frames (= 20 overlap tokens) for the next chunk
FLOW_ENCODER_DECODING_CHUNK = 0  # MaskedDiffWithXvec.inference calls its encoder with the default (full attention)


def _default_encoder() -> EncoderConfig:
    return EncoderConfig(input_size=512, output_size=512, attention_heads=8, linear_units=2048, num_blocks=6)


@dataclass
class LengthRegulatorConfig:
    """``InterpolateRegulator`` arguments (only the number of ``sampling_ratios`` matters at inference)."""

    channels: int = 80
    sampling_ratios: tuple[int, ...] = (1, 1, 1, 1)
    out_channels: int | None = None
    groups: int = 1

    @classmethod
    def from_yaml(cls, node: Any) -> LengthRegulatorConfig:
        if not isinstance(node, Tagged) or node.class_name != "InterpolateRegulator":
            name = node.class_name if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(f"flow config: flow.length_regulator is {name}, expected InterpolateRegulator")
        out = node.get("out_channels")
        return cls(
            channels=int(node["channels"]),
            sampling_ratios=tuple(int(r) for r in node["sampling_ratios"]),
            out_channels=None if out is None else int(out),
            groups=int(node.get("groups", 1)),
        )


@dataclass
class FlowV1Config:
    """``flow: !new:cosyvoice.flow.flow.MaskedDiffWithXvec``; defaults are the released CosyVoice-300M values."""

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 4096
    input_frame_rate: int = 50
    encoder: EncoderConfig = field(default_factory=_default_encoder)
    length_regulator: LengthRegulatorConfig = field(default_factory=LengthRegulatorConfig)
    estimator: UNetEstimatorConfig = field(default_factory=UNetEstimatorConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    def validate(self) -> None:
        for name in ("input_size", "spk_embed_dim", "vocab_size", "input_frame_rate"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.output_size == 80, "output_size", "must be 80 (the CFM solver is 80-bin)")
        need(self.encoder.input_size == self.input_size, "encoder.input_size", "must equal input_size")
        lr = self.length_regulator
        need(lr.channels == self.output_size, "length_regulator.channels", "must equal output_size")
        need(
            (lr.out_channels or lr.channels) == self.output_size, "length_regulator.out_channels", "must be output_size"
        )
        need(lr.groups > 0 and lr.channels % lr.groups == 0, "length_regulator.groups", "must divide channels")
        need(self.estimator.in_channels == 4 * self.output_size, "estimator.in_channels", "must be 4*output_size")
        need(self.estimator.out_channels == self.output_size, "estimator.out_channels", "must equal output_size")
        need(self.cfm.spk_emb_dim == self.output_size, "decoder.spk_emb_dim", "must equal output_size")
        self.encoder.validate("flow.encoder")
        self.estimator.validate()
        self.cfm.validate()

    @classmethod
    def from_yaml(cls, node: Any) -> FlowV1Config:
        """Read the ``flow:`` entry of a :func:`~cosyvoice_cpu.reference.yamlconf.load_yaml_data` result."""
        if not isinstance(node, Tagged) or node.class_name != "MaskedDiffWithXvec":
            name = node.class_name if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(f"flow config: class {name} is not MaskedDiffWithXvec (CosyVoice-300M)")
        for key in ("encoder", "length_regulator", "decoder"):
            if node.get(key) is None:
                raise ConfigError(f"flow config: MaskedDiffWithXvec needs a {key!r} entry")
        if node.get("output_type", "mel") != "mel":
            raise ConfigError(f"flow config: output_type {node.get('output_type')!r} is not supported (want 'mel')")
        decoder = node["decoder"]
        cfg = cls(
            input_size=int(node.get("input_size", 512)),
            output_size=int(node.get("output_size", 80)),
            spk_embed_dim=int(node.get("spk_embed_dim", 192)),
            vocab_size=int(node.get("vocab_size", 4096)),
            input_frame_rate=int(node.get("input_frame_rate", 50)),
            encoder=EncoderConfig.from_yaml(
                node["encoder"], "ConformerEncoder", "flow.encoder", FLOW_ENCODER_DECODING_CHUNK
            ),
            length_regulator=LengthRegulatorConfig.from_yaml(node["length_regulator"]),
            estimator=UNetEstimatorConfig.from_yaml(decoder.get("estimator") if isinstance(decoder, Tagged) else None),
            cfm=CFMConfig.from_yaml(decoder, expected="ConditionalCFM"),
        )
        cfg.validate()
        return cfg


class FlowV1(nn.Module):
    """CosyVoice-300M flow; ``state_dict`` keys/shapes equal the official ``MaskedDiffWithXvec``."""

    def __init__(self, config: FlowV1Config | None = None) -> None:
        super().__init__()
        self.config = config = config or FlowV1Config()
        config.validate()
        lr = config.length_regulator
        # registration order = the official module's
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = ConformerEncoder(config.encoder)
        self.encoder_proj = nn.Linear(config.encoder.output_size, config.output_size)
        self.decoder = ConditionalCFM(config.cfm, UNetEstimator(config.estimator))
        self.length_regulator = InterpolateRegulator(lr.channels, len(lr.sampling_ratios), lr.out_channels, lr.groups)

    @torch.inference_mode()
    def encode(
        self,
        token: torch.Tensor,
        token_len: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_token_len: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
    ) -> FlowConditions:
        """Everything before the ODE: speaker projection, token encoding, length regulation, prompt condition.

        Args:
            token: (1, T2) speech tokens to synthesise (negative ids clamped to 0); token_len (1,).
            prompt_token: (1, T1) prompt tokens; prompt_token_len (1,).
            prompt_feat: (1, mel_len1, 80) prompt mel (any length: the prompt tokens are stretched to it).
            embedding: (1, 192) speaker x-vector (L2-normalised here).
        Returns:
            :class:`~cosyvoice_cpu.reference.flow.common.FlowConditions` over mel_len1 + mel_len2 frames,
            mel_len2 = ``int(T2 / input_frame_rate * 22050 / 256)``.
        """
        if token.size(0) != 1:
            raise ValueError(f"flow inference takes batch 1, got token batch {token.size(0)}")
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        n_prompt, n_new = prompt_token.shape[1], token.shape[1]
        token = torch.cat([prompt_token, token], dim=1)
        token_len = prompt_token_len + token_len
        valid = valid_mask(token_len, token.size(1)).unsqueeze(-1).to(spks.dtype)
        xs = self.input_embedding(torch.clamp(token, min=0)) * valid
        h, _ = self.encoder(xs, token_len)
        h = self.encoder_proj(h)
        mel_len1, mel_len2 = prompt_feat.shape[1], frames_for_tokens(n_new, self.config.input_frame_rate)
        if mel_len2 <= 0:
            raise ValueError(f"{n_new} tokens give no mel frames; give at least one more token")
        h, _ = self.length_regulator.inference(
            h[:, :n_prompt], h[:, n_prompt:], mel_len1, mel_len2, self.config.input_frame_rate
        )
        return FlowConditions.of(h.transpose(1, 2).contiguous(), spks, prompt_feat)

    @staticmethod
    def start_noise(
        mu: torch.Tensor,
        flow_cache: torch.Tensor | None,
        mel_len1: int,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The official v1 noise and cache bookkeeping (``ConditionalCFM.forward`` up to the solver).

        Args:
            mu: (1, 80, T) encoder condition (not modified).
            flow_cache: (1, 80, n, 2) [noise, mu] of frames 0..n-1 from the previous chunk, or None / n = 0.
            mel_len1: prompt frames (kept in the new cache).
            noise: (1, 80, >= T) noise to start from, or None to draw ``randn`` from ``generator`` (torch's
                global RNG if None, the same draw as the official ``randn_like(mu)``).
        Returns:
            (noise (1, 80, T), mu (1, 80, T) with the cached frames put in, new cache (1, 80, mel_len1 + 34, 2)).
        """
        size = mu.size(2)
        if noise is None:
            z = torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
        elif noise.dim() != 3 or noise.shape[:2] != mu.shape[:2] or noise.size(2) < size:
            raise ValueError(f"noise must be (1, {mu.size(1)}, >= {size}), got {tuple(noise.shape)}")
        else:
            z = noise[:, :, :size].to(mu.dtype).clone()
        mu = mu.clone()
        n = 0 if flow_cache is None else flow_cache.shape[2]
        if n:
            if flow_cache.dim() != 4 or flow_cache.shape[:2] != mu.shape[:2] or flow_cache.shape[3] != 2 or n > size:
                raise ValueError(f"flow_cache must be (1, {mu.size(1)}, n <= {size}, 2), got {tuple(flow_cache.shape)}")
            z[:, :, :n] = flow_cache[..., 0]
            mu[:, :, :n] = flow_cache[..., 1]
        tail = slice(-CACHE_TAIL_FRAMES, None)
        z_cache = torch.cat([z[:, :, :mel_len1], z[:, :, tail]], dim=2)
        mu_cache = torch.cat([mu[:, :, :mel_len1], mu[:, :, tail]], dim=2)
        return z, mu, torch.stack([z_cache, mu_cache], dim=-1)

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
        flow_cache: torch.Tensor | None = None,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens -> mel, as the official ``MaskedDiffWithXvec.inference`` (``prompt_feat_len`` unused, as upstream).

        ``n_timesteps`` (default 10), ``cfg_rate`` (default 0.7) as :meth:`ConditionalCFM.forward`; ``flow_cache``,
        ``noise``, ``generator`` as :meth:`start_noise`.
        Returns:
            (mel (1, 80, mel_len2) float32 without the prompt frames, the new flow cache (1, 80, mel_len1 + 34, 2)).
        """
        c = self.encode(token, token_len, prompt_token, prompt_token_len, prompt_feat, embedding)
        z, mu, cache = self.start_noise(c.mu, flow_cache, c.mel_len1, noise, generator)
        mel = self.decoder(mu, c.mask, c.spks, c.cond, n_timesteps, cfg_rate, noise=z)
        return mel[:, :, c.mel_len1 :], cache
