"""The conditional flow-matching solver of CosyVoice's flow: Euler steps on a cosine time schedule around an
estimator, classifier-free guidance as one batch-2 call, and the official fixed noise (or injected noise).

Shapes: mu/cond/x (B, 80, T), mask (B, 1, T), spks (B, 80).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.yamlconf import Tagged

logger = logging.getLogger(__name__)

NOISE_SEED = 0
NOISE_FRAMES = 50 * 300  # the official CausalConditionalCFM draws randn(1, 80, 15000) once, after seed 0


def official_fixed_noise(frames: int = NOISE_FRAMES) -> torch.Tensor:
    """The official ``rand_noise``: ``torch.manual_seed(0); torch.randn(1, 80, 15000)``, first ``frames``
    columns. Drawn from a private generator, so the global RNG is left alone. -> (1, 80, frames)."""
    gen = torch.Generator().manual_seed(NOISE_SEED)
    return torch.randn(1, 80, NOISE_FRAMES, generator=gen)[:, :, :frames]


def need(ok: bool, field_name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"flow config: {field_name} {msg}")


def class_args(node: Tagged | None, expected: str, where: str) -> dict[str, Any]:
    """The arguments of a yaml ``!new:`` node of class ``expected`` ({} for None); ConfigError otherwise."""
    if node is None:
        return {}
    if not isinstance(node, Tagged) or node.class_name != expected:
        name = node.class_name if isinstance(node, Tagged) else type(node).__name__
        raise ConfigError(f"flow config: {where} is {name}, expected {expected}")
    return dict(node.args) if isinstance(node.args, dict) else {}


@dataclass
class CFMConfig:
    """``CausalConditionalCFM`` settings: ODE solver, schedule, guidance, fixed noise."""

    in_channels: int = 240
    n_spks: int = 1
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    solver: str = "euler"
    t_scheduler: str = "cosine"
    training_cfg_rate: float = 0.2
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10  # hard-coded by the official flow inference

    def validate(self) -> None:
        need(self.solver == "euler", "cfm.solver", f"= {self.solver!r} is not supported (want 'euler')")
        need(self.t_scheduler in ("cosine", "linear"), "cfm.t_scheduler", "must be 'cosine' or 'linear'")
        need(self.inference_cfg_rate >= 0, "cfm.inference_cfg_rate", "must be >= 0")
        need(self.n_timesteps >= 1, "cfm.n_timesteps", "must be >= 1")
        need(self.spk_emb_dim > 0, "cfm.spk_emb_dim", "must be > 0")

    @classmethod
    def from_yaml(cls, node: Tagged, expected: str = "CausalConditionalCFM") -> CFMConfig:
        """Read ``flow.decoder`` (v2 ``CausalConditionalCFM``; v1 passes ``expected="ConditionalCFM"``)."""
        a = class_args(node, expected, "flow.decoder")
        params = a.get("cfm_params")
        p = class_args(params, "DictConfig", "flow.decoder.cfm_params").get("content", {}) if params else {}
        return cls(
            in_channels=int(a.get("in_channels", cls.in_channels)),
            n_spks=int(a.get("n_spks", 1)),
            spk_emb_dim=int(a.get("spk_emb_dim", 64)),
            sigma_min=float(p.get("sigma_min", cls.sigma_min)),
            solver=str(p.get("solver", cls.solver)),
            t_scheduler=str(p.get("t_scheduler", cls.t_scheduler)),
            training_cfg_rate=float(p.get("training_cfg_rate", cls.training_cfg_rate)),
            inference_cfg_rate=float(p.get("inference_cfg_rate", cls.inference_cfg_rate)),
        )


class ConditionalCFM(nn.Module):
    """Euler flow-matching solver around an estimator (``decoder.*`` keys: only ``decoder.estimator.*``)."""

    def __init__(self, config: CFMConfig, estimator: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.estimator = estimator
        self._noise: torch.Tensor | None = None  # not a buffer: flow.pt does not hold it

    def fixed_noise(self, frames: int) -> torch.Tensor:
        """First ``frames`` columns of the official fixed noise: (1, 80, frames)."""
        if frames > NOISE_FRAMES:
            raise ValueError(f"{frames} mel frames exceed the official fixed noise ({NOISE_FRAMES} frames)")
        if self._noise is None:
            self._noise = official_fixed_noise()
        return self._noise[:, :, :frames]

    def time_span(self, n_timesteps: int, device=None, dtype=None) -> torch.Tensor:
        """(n_timesteps+1,) times 0..1, cosine-warped (``1 - cos(pi/2 * t)``) if ``t_scheduler='cosine'``."""
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
        if self.config.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        return t_span

    @torch.inference_mode()
    def forward(
        self,
        mu: torch.Tensor,
        mask: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        n_timesteps: int | None = None,
        cfg_rate: float | None = None,
        streaming: bool = False,
        noise: torch.Tensor | None = None,
        chunk_id: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Integrate dx/dt = v from noise (t=0) to mel (t=1) with Euler steps and CFG.

        Args:
            mu: (B, 80, T), mask: (B, 1, T) float, spks: (B, 80), cond: (B, 80, T).
            n_timesteps: Euler steps (default ``config.n_timesteps``, 10).
            cfg_rate: guidance r in ``(1+r) v_cond - r v_uncond`` (default ``config.inference_cfg_rate``).
            streaming: chunk-causal estimator attention.
            noise: (B, 80, >=T) starting noise, first T columns used; default the official fixed noise.
            chunk_id: (B, T) int chunk per frame for ``streaming`` (default the official ``i // chunk``).
        Returns:
            (B, 80, T) float32 mel.
        """
        n_timesteps = self.config.n_timesteps if n_timesteps is None else n_timesteps
        cfg_rate = self.config.inference_cfg_rate if cfg_rate is None else cfg_rate
        b, size = mu.size(0), mu.size(2)
        if noise is None:
            noise = self.fixed_noise(size).expand(b, -1, -1)
        elif noise.dim() != 3 or noise.size(1) != mu.size(1) or noise.size(2) < size:
            raise ValueError(f"noise must be (B, {mu.size(1)}, >= {size}), got {tuple(noise.shape)}")
        x = noise[:, :, :size].to(device=mu.device, dtype=mu.dtype)
        t_span = self.time_span(n_timesteps, mu.device, mu.dtype)

        # Row block 0 conditioned, row block 1 unconditioned (mu, spks, cond zeroed), as the official solver.
        mask_in = torch.cat([mask, mask])
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        # Official time bookkeeping: t accumulates dt, and each next dt is t_span[k+1] - t (not a diff of t_span).
        t, dt = t_span[0], t_span[1] - t_span[0]
        ids = None if chunk_id is None else torch.cat([chunk_id, chunk_id])
        for step in range(1, n_timesteps + 1):
            t_in = t.reshape(1).expand(2 * b)
            v = self.estimator(
                torch.cat([x, x]), mask_in, mu_in, t_in, spks_in, cond_in, streaming=streaming, chunk_id=ids
            )
            v_cond, v_uncond = v.split(b, dim=0)
            x = x + dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return x.float()
