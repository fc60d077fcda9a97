"""CosyVoice2 flow (speech tokens -> 80-bin mel): the official ``CausalMaskedDiffWithXvec``, inference only.

    tokens --Embedding--> FlowEncoder (x2 upsampling) --encoder_proj--> mu (1, 80, 2T)
    x-vector (1, 192) --L2 normalise, Linear--> spks (1, 80)
    prompt mel (1, T_p, 80) --> cond (1, 80, 2T): the prompt frames, then zeros
    ConditionalCFM: Euler ODE from fixed noise over a cosine time schedule, classifier-free guidance
    (a batch-2 estimator call: conditioned row, unconditioned row with mu = spks = cond = 0).

``Flow.state_dict()`` has exactly the keys and shapes of the official module, so ``flow.pt`` loads with
``strict=True``.

CosyVoice-300M's ``MaskedDiffWithXvec`` (:mod:`.cosyvoice`) and Fun-CosyVoice3's ``CausalMaskedDiffWithDiT``
(:mod:`.cosyvoice3`) are siblings: all three share :class:`.cfm.CFMConfig` and :class:`.common.FlowConditions`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.flow.causal_unet import FlowEstimator
from cosyvoice_cpu.reference.flow.cfm import CFMConfig, ConditionalCFM, class_args, need
from cosyvoice_cpu.reference.flow.common import FlowConditions, unet_args
from cosyvoice_cpu.reference.flow.encoder import FlowEncoder, valid_mask
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

SUPPORTED_FLOWS = ("CausalMaskedDiffWithXvec",)  # the other families' flows: .cosyvoice, .cosyvoice3


@dataclass
class FlowEncoderConfig:
    """``UpsampleConformerEncoder`` hyper-parameters (released CosyVoice2 values)."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4  # hard-coded in the official class
    static_chunk_size: int = 25  # tokens; the official constructor default is 0 when the yaml omits it
    upsample_stride: int = 2  # hard-coded in the official class

    def validate(self) -> None:
        for name in ("input_size", "output_size", "attention_heads", "linear_units", "num_blocks"):
            need(getattr(self, name) > 0, f"encoder.{name}", "must be > 0")
        need(self.output_size % self.attention_heads == 0, "encoder.attention_heads", "must divide output_size")
        need(self.num_up_blocks >= 0, "encoder.num_up_blocks", "must be >= 0")
        need(self.static_chunk_size >= 0, "encoder.static_chunk_size", "must be >= 0")
        need(self.upsample_stride >= 1, "encoder.upsample_stride", "must be >= 1")

    @classmethod
    def from_yaml(cls, node: Tagged) -> FlowEncoderConfig:
        a = class_args(node, "UpsampleConformerEncoder", "flow.encoder")
        unsupported = {
            "input_layer": "linear",
            "pos_enc_layer_type": "rel_pos_espnet",
            "selfattention_layer_type": "rel_selfattn",
            "normalize_before": True,
            "use_cnn_module": False,
            "macaron_style": False,
        }
        for key, want in unsupported.items():
            need(a.get(key, want) == want, f"encoder.{key}", f"= {a.get(key)!r} is not supported (want {want!r})")
        return cls(
            input_size=int(a.get("input_size", cls.input_size)),
            output_size=int(a.get("output_size", 256)),
            attention_heads=int(a.get("attention_heads", 4)),
            linear_units=int(a.get("linear_units", 2048)),
            num_blocks=int(a.get("num_blocks", 6)),
            static_chunk_size=int(a.get("static_chunk_size", 0)),  # honour the yaml / official default
        )


@dataclass
class FlowEstimatorConfig:
    """``CausalConditionalDecoder`` hyper-parameters (released CosyVoice2 values)."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    dropout: float = 0.0
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50  # frames
    num_decoding_left_chunks: int = -1  # read from the yaml, but the official mask ignores it (all left)

    def validate(self) -> None:
        need(len(self.channels) == 1, "estimator.channels", "must have one entry (single-resolution UNet)")
        for name in ("in_channels", "out_channels", "attention_head_dim", "n_blocks", "num_heads"):
            need(getattr(self, name) > 0, f"estimator.{name}", "must be > 0")
        need(self.channels[0] > 0, "estimator.channels", "must be > 0")
        need(self.num_mid_blocks >= 0, "estimator.num_mid_blocks", "must be >= 0")
        need(self.act_fn == "gelu", "estimator.act_fn", f"= {self.act_fn!r} is not supported (want 'gelu')")
        need(self.static_chunk_size > 0, "estimator.static_chunk_size", "must be > 0")

    @classmethod
    def from_yaml(cls, node: Tagged) -> FlowEstimatorConfig:
        a = class_args(node, "CausalConditionalDecoder", "flow.decoder.estimator")
        return cls(
            in_channels=int(a.get("in_channels", cls.in_channels)),
            out_channels=int(a.get("out_channels", cls.out_channels)),
            **unet_args(a),
            static_chunk_size=int(a.get("static_chunk_size", 50)),
            num_decoding_left_chunks=int(a.get("num_decoding_left_chunks", 2)),
        )


@dataclass
class FlowConfig:
    """``CausalMaskedDiffWithXvec`` configuration; defaults are the released CosyVoice2 values."""

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    input_frame_rate: int = 25
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: FlowEncoderConfig = field(default_factory=FlowEncoderConfig)
    estimator: FlowEstimatorConfig = field(default_factory=FlowEstimatorConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    def validate(self) -> None:
        for name in ("input_size", "output_size", "spk_embed_dim", "vocab_size", "token_mel_ratio"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.pre_lookahead_len >= 0, "pre_lookahead_len", "must be >= 0")
        need(self.output_size == 80, "output_size", "must be 80 (the CFM solver is 80-bin)")
        need(self.encoder.input_size == self.input_size, "encoder.input_size", "must equal input_size")
        need(
            self.token_mel_ratio == self.encoder.upsample_stride,
            "token_mel_ratio",
            "must equal the encoder upsampling stride (2)",
        )
        need(self.cfm.spk_emb_dim == self.output_size, "cfm.spk_emb_dim", "must equal output_size")
        need(self.estimator.in_channels == 4 * self.output_size, "estimator.in_channels", "must be 4*output_size")
        need(self.estimator.out_channels == self.output_size, "estimator.out_channels", "must equal output_size")
        self.encoder.validate()
        self.estimator.validate()
        self.cfm.validate()

    @classmethod
    def from_yaml(cls, node: Tagged) -> FlowConfig:
        """Read the ``flow:`` entry of a :func:`~cosyvoice_cpu.reference.yamlconf.load_yaml_data` result."""
        if not isinstance(node, Tagged) or node.class_name not in SUPPORTED_FLOWS:
            name = node.class_name if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(f"flow config: class {name} is not supported yet (supported: {SUPPORTED_FLOWS})")
        a = node.args
        decoder = node.get("decoder")
        cfg = cls(
            input_size=int(a.get("input_size", 512)),
            output_size=int(a.get("output_size", 80)),
            spk_embed_dim=int(a.get("spk_embed_dim", 192)),
            vocab_size=int(a.get("vocab_size", 4096)),
            input_frame_rate=int(a.get("input_frame_rate", 50)),
            token_mel_ratio=int(a.get("token_mel_ratio", 2)),
            pre_lookahead_len=int(a.get("pre_lookahead_len", 3)),
            encoder=FlowEncoderConfig.from_yaml(node.get("encoder")),
            estimator=FlowEstimatorConfig.from_yaml(decoder.get("estimator") if decoder else None),
            cfm=CFMConfig.from_yaml(decoder),
        )
        cfg.validate()
        return cfg


class Flow(nn.Module):
    """CosyVoice2 flow; ``state_dict`` keys/shapes equal the official ``CausalMaskedDiffWithXvec``."""

    def __init__(self, config: FlowConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or FlowConfig()
        config.validate()
        enc, est = config.encoder, config.estimator
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = FlowEncoder(
            input_size=enc.input_size,
            output_size=enc.output_size,
            attention_heads=enc.attention_heads,
            linear_units=enc.linear_units,
            num_blocks=enc.num_blocks,
            num_up_blocks=enc.num_up_blocks,
            static_chunk_size=enc.static_chunk_size,
            pre_lookahead_len=config.pre_lookahead_len,
            upsample_stride=enc.upsample_stride,
        )
        self.encoder_proj = nn.Linear(enc.output_size, config.output_size)
        estimator = FlowEstimator(
            in_channels=est.in_channels,
            out_channels=est.out_channels,
            channels=est.channels[0],
            attention_head_dim=est.attention_head_dim,
            n_blocks=est.n_blocks,
            num_mid_blocks=est.num_mid_blocks,
            num_heads=est.num_heads,
            static_chunk_size=est.static_chunk_size,
            num_decoding_left_chunks=est.num_decoding_left_chunks,
        )
        self.decoder = ConditionalCFM(config.cfm, estimator)

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
        streaming: bool = False,
    ) -> FlowConditions:
        """Everything before the ODE: speaker projection, token encoding, prompt condition.

        Args:
            token: (1, T) speech tokens to synthesise (negative ids are clamped to 0); token_len (1,).
            prompt_token: (1, T_p) prompt tokens; prompt_token_len (1,).
            prompt_feat: (1, T_pm, 80) prompt mel (T_pm should be token_mel_ratio * T_p).
            embedding: (1, 192) speaker x-vector (L2-normalised here).
            finalize: False for a non-final streaming chunk: the last ``pre_lookahead_len`` tokens only feed
                the look-ahead layer and produce no frames.
            streaming: chunk-causal attention in the encoder.
        Returns:
            :class:`FlowConditions` with T_mel = 2 * (T_p + T [- pre_lookahead_len if not finalize]).
        """
        if token.size(0) != 1:
            raise ValueError(f"flow inference takes batch 1, got token batch {token.size(0)}")
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        token = torch.cat([prompt_token, token], dim=1)
        token_len = prompt_token_len + token_len
        valid = valid_mask(token_len, token.size(1)).unsqueeze(-1).to(spks.dtype)
        xs = self.input_embedding(torch.clamp(token, min=0)) * valid
        context = None
        if not finalize and self.config.pre_lookahead_len > 0:
            n = self.config.pre_lookahead_len
            if xs.size(1) <= n:
                raise ValueError(f"a non-final chunk needs more than {n} tokens, got {xs.size(1)}")
            xs, context = xs[:, :-n], xs[:, -n:]
        h, _ = self.encoder(xs, token_len, context=context, streaming=streaming)
        return FlowConditions.of(self.encoder_proj(h).transpose(1, 2).contiguous(), spks, prompt_feat)

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
        """Tokens -> mel, as the official ``CausalMaskedDiffWithXvec.inference``.

        Arguments as :meth:`encode` (``prompt_feat_len`` is unused, as upstream); ``n_timesteps`` (default
        10), ``cfg_rate`` (default 0.7) and ``noise`` ((1, 80, >= T_mel), default the official fixed noise)
        as :meth:`ConditionalCFM.forward`.
        Returns:
            (mel (1, 80, mel_len2) float32 without the prompt frames, None): the second slot is the flow
            cache of older upstream versions, kept for signature parity.
        """
        c = self.encode(token, token_len, prompt_token, prompt_token_len, prompt_feat, embedding, finalize, streaming)
        if c.mel_len2 <= 0:
            raise ValueError(f"prompt_feat has {c.mel_len1} frames but the tokens give only {c.mu.size(2)}")
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, n_timesteps, cfg_rate, streaming=streaming, noise=noise)
        return mel[:, :, c.mel_len1 :], None
