"""What every family's reference flow shares: the conditions its CFM decoder is given (:class:`FlowConditions`) and
the yaml arguments both official U-Net decoders take (:func:`unet_args`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


def unet_args(a: dict[str, Any]) -> dict[str, Any]:
    """The arguments both official UNet decoders (v1 ``ConditionalDecoder``, v2 ``CausalConditionalDecoder``)
    share, with the official constructors' defaults where the yaml leaves them out."""
    return {
        "channels": tuple(int(c) for c in a.get("channels", (256, 256))),
        "dropout": float(a.get("dropout", 0.05)),
        "attention_head_dim": int(a.get("attention_head_dim", 64)),
        "n_blocks": int(a.get("n_blocks", 1)),
        "num_mid_blocks": int(a.get("num_mid_blocks", 2)),
        "num_heads": int(a.get("num_heads", 4)),
        "act_fn": str(a.get("act_fn", "snake")),
    }


class FlowConditions(NamedTuple):
    """Inputs of the CFM decoder for one utterance (T_mel = mel_len1 + mel_len2)."""

    mu: torch.Tensor  # (1, 80, T_mel) encoder output after encoder_proj
    spks: torch.Tensor  # (1, 80) projected speaker embedding
    cond: torch.Tensor  # (1, 80, T_mel) prompt mel then zeros
    mask: torch.Tensor  # (1, 1, T_mel) float ones
    mel_len1: int  # prompt frames
    mel_len2: int  # generated frames

    @classmethod
    def of(cls, mu: torch.Tensor, spks: torch.Tensor, prompt_feat: torch.Tensor) -> FlowConditions:
        """The conditions for ``mu`` (1, 80, T_mel) whose first frames belong to ``prompt_feat`` (1, mel_len1, 80):
        cond = the prompt mel then zeros, an all-ones mask."""
        mel_len1 = prompt_feat.size(1)
        cond = torch.zeros_like(mu)
        cond[:, :, :mel_len1] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = torch.ones(1, 1, mu.size(2), dtype=mu.dtype, device=mu.device)
        return cls(mu, spks, cond, mask, mel_len1, mu.size(2) - mel_len1)
