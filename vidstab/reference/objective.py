"""The training objective of the reference trainer: noise prediction on VAE latents.

Three parameterisations, all built on diffusers' own pieces rather than re-derived here:

- ``epsilon``: predict the added noise; noisy latents from ``DDPMScheduler.add_noise``.
- ``v_prediction``: predict the velocity ``DDPMScheduler.get_velocity`` (Salimans & Ho, 2022).
- ``flow_matching``: rectified flow with logit-normal timesteps (SD3), sampled with
  ``diffusers.training_utils.compute_density_for_timestep_sampling``; target ``noise - latents``.

Randomness (timesteps and noise) comes from an explicit ``torch.Generator`` seeded from
``(seed, step, micro_step, rank)``, so a step can be regenerated exactly after a resume or in a
replay, and an incident bundle can store the tensors themselves.

The loss is computed in fp32 whatever the autocast dtype (the seed's advice: the diffusion target has
a wide numeric range) and returned per sample, so the guard can bucket it by timestep.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

PREDICTION_TYPES = ("epsilon", "v_prediction", "flow_matching")


@dataclass
class ObjectiveConfig:
    """How noisy inputs and targets are made from clean latents."""

    prediction_type: str = "epsilon"
    """``epsilon`` (the seed's noise prediction), ``v_prediction`` or ``flow_matching``."""
    num_train_timesteps: int = 1000
    """Number of diffusion timesteps; flow-matching sigmas are scaled by it for the model's embedding."""
    logit_mean: float = 0.0
    """Mean of the logit-normal timestep density (flow matching only)."""
    logit_std: float = 1.0
    """Standard deviation of the logit-normal timestep density (flow matching only)."""

    def __post_init__(self) -> None:
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {self.prediction_type!r}")
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {self.num_train_timesteps}")


def step_generator(seed: int, step: int, micro_step: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends only on (seed, step, micro_step, rank): resumable and replayable."""
    generator = torch.Generator(device=device)
    # Large odd multipliers keep the four counters from colliding for any realistic run length.
    generator.manual_seed((seed * 1_000_003 + step * 10_007 + micro_step * 101 + rank) % (2**63 - 1))
    return generator


class DiffusionObjective:
    """Samples timesteps and noise, builds model inputs and targets, computes the fp32 loss."""

    def __init__(self, config: ObjectiveConfig | None = None) -> None:
        self.config = config or ObjectiveConfig()
        self.scheduler = DDPMScheduler(num_train_timesteps=self.config.num_train_timesteps)

    def sample(self, latents: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Draw ``noise`` (like latents) and ``timesteps`` ([B]; long for DDPM, float in [0, T) for flow)."""
        batch_size = latents.shape[0]
        # Draw on the generator's device, then move: results do not depend on where the model runs.
        gen_device = generator.device
        noise = torch.randn(latents.shape, generator=generator, device=gen_device, dtype=torch.float32)
        if self.config.prediction_type == "flow_matching":
            u = compute_density_for_timestep_sampling(
                "logit_normal", batch_size, self.config.logit_mean, self.config.logit_std,
                device=gen_device, generator=generator,
            )
            timesteps = u * self.config.num_train_timesteps
        else:
            timesteps = torch.randint(0, self.config.num_train_timesteps, (batch_size,), generator=generator, device=gen_device)
        return {"noise": noise.to(latents.device), "timesteps": timesteps.to(latents.device)}

    def inputs_and_target(
        self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noisy latents for the model and the regression target, both shaped like ``latents``."""
        if self.config.prediction_type == "flow_matching":
            sigmas = (timesteps.float() / self.config.num_train_timesteps).view(-1, *([1] * (latents.ndim - 1)))
            noisy = (1.0 - sigmas) * latents + sigmas * noise
            return noisy, noise - latents
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        if self.config.prediction_type == "v_prediction":
            return noisy, self.scheduler.get_velocity(latents, noise, timesteps)
        return noisy, noise

    def per_sample_loss(self, model: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Forward the model and return the fp32 MSE per sample, shape [B]."""
        noisy, target = self.inputs_and_target(latents, noise, timesteps)
        prediction = model(noisy, timesteps)
        error = (prediction.float() - target.float()) ** 2
        return error.flatten(1).mean(dim=1)

    def to_dict(self) -> dict:
        """JSON form, recorded in incident bundles so a replay rebuilds the same objective."""
        return asdict(self.config)


def replay_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], **objective: object) -> torch.Tensor:
    """Per-sample loss of a captured micro-batch (``latents``, ``noise``, ``timesteps``).

    This is the ``loss_fn`` an incident bundle of the reference trainer names, so
    ``scripts/replay.py`` can re-run the exact forward and backward of a bad step.
    """
    obj = DiffusionObjective(ObjectiveConfig(**objective))  # type: ignore[arg-type]
    return obj.per_sample_loss(model, batch["latents"], batch["noise"], batch["timesteps"])
