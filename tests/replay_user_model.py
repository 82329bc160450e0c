"""A user's own model and loss, as a user would write them: no diffusers, no vidstab.reference.

Incident bundles name these by import path (``replay_user_model:make_model``,
``replay_user_model:video_mse``), so ``vidstab replay`` must rebuild them from the bundle alone.
The tests put ``tests/`` on ``sys.path`` (or ``PYTHONPATH`` for the subprocess).
"""

from __future__ import annotations

import torch
from torch import nn


class Blowup(nn.Module):
    """Multiplies by ``factor``: at 1e39 every fp32 value above ~0.34 in magnitude becomes inf."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class SqrtAbs(nn.Module):
    """sqrt(|x|): finite forward, infinite derivative at exactly 0 (a backward-only NaN source)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().sqrt()


class TinyVideoNet(nn.Module):
    """Per-token MLP over video latents [B, C, F, H, W] conditioned on a timestep [B]."""

    def __init__(self, channels: int = 4, hidden: int = 16, blowup: float | None = None, sqrt: bool = False):
        super().__init__()
        self.encoder = nn.Linear(channels, hidden)
        self.t_proj = nn.Linear(1, hidden)
        self.act = nn.SiLU()
        self.blowup = Blowup(blowup) if blowup else nn.Identity()
        self.sqrt = SqrtAbs() if sqrt else nn.Identity()
        self.decoder = nn.Linear(hidden, channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = x.movedim(1, -1)  # [B, F, H, W, C]
        h = self.encoder(h) + self.t_proj(t.float().view(-1, 1, 1, 1, 1) / 1000.0)
        h = self.sqrt(self.blowup(self.act(h)))
        return self.decoder(h).movedim(-1, 1)


def make_model(channels: int = 4, hidden: int = 16, blowup: float | None = None, sqrt: bool = False) -> TinyVideoNet:
    """The factory a bundle names: ``{"factory": "replay_user_model:make_model", "kwargs": {...}}``."""
    return TinyVideoNet(channels, hidden, blowup, sqrt)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A`` (``B`` starts at zero), as PEFT's LoRA."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T


def make_lora_model(channels: int = 4, hidden: int = 16, rank: int = 2, base_seed: int = 1234) -> TinyVideoNet:
    """A LoRA fine-tune's model: the base (its "pretrained" weights: drawn from ``base_seed``) frozen, LoRA
    adapters on the encoder and decoder trainable. A checkpoint of it holds only the adapters."""
    with torch.random.fork_rng():
        torch.manual_seed(base_seed)
        model = TinyVideoNet(channels, hidden)
    for p in model.parameters():
        p.requires_grad_(False)
    model.encoder = LoRALinear(model.encoder, rank)
    model.decoder = LoRALinear(model.decoder, rank)
    return model


def video_mse(model: nn.Module, batch: dict[str, torch.Tensor], noise_scale: float = 1.0,
              max_abs: float | None = None) -> torch.Tensor:
    """Per-sample denoising MSE: predict ``noise`` from ``latents + noise_scale * noise``.

    With ``max_abs``, raises ``ValueError`` on latents beyond it (a loss that validates its inputs).
    """
    if max_abs is not None and bool((batch["latents"].abs() > max_abs).any()):
        raise ValueError(f"latents exceed {max_abs}")
    noisy = batch["latents"] + noise_scale * batch["noise"]
    pred = model(noisy, batch["timesteps"])
    return ((pred.float() - batch["noise"].float()) ** 2).flatten(1).mean(1)


def make_batch(batch_size: int = 3, channels: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small deterministic micro-batch with the reference trainer's keys."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch_size, channels, 2, 4, 4)
    return {
        "latents": torch.randn(shape, generator=g),
        "noise": torch.randn(shape, generator=g),
        "timesteps": torch.randint(0, 1000, (batch_size,), generator=g),
    }
