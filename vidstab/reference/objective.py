"""The training objective of the reference trainer: noise prediction on VAE latents.

Three parameterisations, all built on diffusers' own pieces rather than re-derived here:

- ``epsilon``: predict the added noise; noisy latents from ``DDPMScheduler.add_noise``.
- ``v_prediction``: predict the velocity ``DDPMScheduler.get_velocity`` (Salimans & Ho, 2022).
- ``flow_matching``: rectified flow as diffusers' SD3 / Wan training scripts do it
  (``examples/dreambooth/train_dreambooth_sd3.py``): ``u`` drawn by
  ``diffusers.training_utils.compute_density_for_timestep_sampling`` (``weighting_scheme`` logit_normal,
  mode or uniform), mapped to a timestep and its sigma through the tables of a
  ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (so the sigmas are shifted exactly as the
  scheduler shifts them at sampling time), the loss weighted per sample by
  ``compute_loss_weighting_for_sd3`` (sigma_sqrt, cosmap or uniform); target ``noise - latents``.

Randomness (timesteps and noise) comes from an explicit ``torch.Generator`` seeded from
``(seed, step, micro_step, rank)`` and living on the latents' device: the draws are made where the model
runs, with no host-to-device copy per micro-step, and a step can be regenerated exactly after a resume or
in a replay; an incident bundle also stores the tensors themselves.

The loss is computed in fp32 whatever the autocast dtype (the diffusion target has a wide numeric range)
and returned per sample, so the guard can bucket it by timestep.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from diffusers import DDPMScheduler

PREDICTION_TYPES = ("epsilon", "v_prediction", "flow_matching")
#: diffusers' SD3 weighting schemes: logit_normal / mode shape the timestep density, sigma_sqrt / cosmap the loss weight.
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")


@dataclass
class ObjectiveConfig:
    """How noisy inputs and targets are made from clean latents."""

    prediction_type: str = "epsilon"
    """``epsilon`` (noise prediction), ``v_prediction`` or ``flow_matching``."""
    num_train_timesteps: int = 1000
    """Number of diffusion timesteps; flow-matching timesteps are ``sigma * num_train_timesteps``."""
    logit_mean: float = 0.0
    """Mean of the logit-normal timestep density (flow matching, ``weighting_scheme="logit_normal"``)."""
    logit_std: float = 1.0
    """Standard deviation of the logit-normal timestep density (flow matching)."""
    weighting_scheme: str = "logit_normal"
    """Flow matching: one of :data:`WEIGHTING_SCHEMES` (diffusers' ``compute_density_for_timestep_sampling`` and
    ``compute_loss_weighting_for_sd3``)."""
    mode_scale: float = 1.29
    """Scale of the ``mode`` timestep density (flow matching)."""
    flow_shift: float = 1.0
    """Flow matching: ``FlowMatchEulerDiscreteScheduler``'s ``shift``; sigma -> shift*s / (1 + (shift-1)*s). Wan uses 3-5."""

    def __post_init__(self) -> None:
        if self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {self.prediction_type!r}")
        if self.num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be >= 1, got {self.num_train_timesteps}")
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {WEIGHTING_SCHEMES}, got {self.weighting_scheme!r}")
        if not self.flow_shift > 0:
            raise ValueError(f"flow_shift must be > 0, got {self.flow_shift}")


def step_generator(seed: int, step: int, micro_step: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` whose stream depends only on (seed, step, micro_step, rank): resumable and replayable.

    Seeding a CUDA generator sets its Philox seed on the host: no kernel, no copy, no sync.
    """
    generator = torch.Generator(device=device)
    # Large odd multipliers keep the four counters from colliding for any realistic run length.
    generator.manual_seed((seed * 1_000_003 + step * 10_007 + micro_step * 101 + rank) % (2**63 - 1))
    return generator


class DiffusionObjective:
    """Samples timesteps and noise, builds model inputs and targets, computes the fp32 loss."""

    def __init__(self, config: ObjectiveConfig | None = None) -> None:
        self.config = config or ObjectiveConfig()
        if self.config.prediction_type == "flow_matching":
            # diffusers' flow-matching pieces import scipy and every model class: only the runs that use them pay
            from diffusers import FlowMatchEulerDiscreteScheduler
            from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

            self.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.config.num_train_timesteps, shift=self.config.flow_shift)
            self._timestep_density, self._loss_weight = compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
        else:
            self.scheduler = DDPMScheduler(num_train_timesteps=self.config.num_train_timesteps)
        self._tables: dict[torch.device, torch.Tensor] = {}  # flow-matching timestep table per device, copied once

    def _timestep_table(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:
            self._tables[device] = self.scheduler.timesteps.to(device=device, dtype=torch.float32)
        return self._tables[device]

    def sample(self, latents: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Draw ``noise`` (like latents) and ``timesteps`` ([B]; long for DDPM, float in (0, T] for flow).

        Both are drawn on ``latents.device`` with ``generator``, which must live there (see
        :func:`step_generator`): a host generator would need a host-to-device copy every micro-step.
        """
        device = latents.device
        if generator.device.type != device.type:
            raise ValueError(f"the generator is on {generator.device} but the latents are on {device}: draw where the model runs")
        batch_size = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, device=device, dtype=torch.float32)
        cfg = self.config
        if cfg.prediction_type == "flow_matching":
            u = self._timestep_density(
                cfg.weighting_scheme, batch_size, cfg.logit_mean, cfg.logit_std, cfg.mode_scale, device=device, generator=generator,
            )
            # As diffusers' SD3 script: u in [0, 1) -> an index into the (shifted) scheduler's training timesteps.
            indices = (u * cfg.num_train_timesteps).long().clamp_(0, cfg.num_train_timesteps - 1)
            timesteps = self._timestep_table(device)[indices]
        else:
            timesteps = torch.randint(0, cfg.num_train_timesteps, (batch_size,), generator=generator, device=device)
        return {"noise": noise, "timesteps": timesteps}

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Flow matching: the noise level of each timestep (the scheduler's ``timesteps = sigmas * T``)."""
        return timesteps.float() / self.config.num_train_timesteps

    def inputs_and_target(
        self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noisy latents for the model and the regression target, both shaped like ``latents``."""
        if self.config.prediction_type == "flow_matching":
            sigmas = self.sigmas(timesteps).view(-1, *([1] * (latents.ndim - 1)))
            noisy = (1.0 - sigmas) * latents + sigmas * noise
            return noisy, noise - latents
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        if self.config.prediction_type == "v_prediction":
            return noisy, self.scheduler.get_velocity(latents, noise, timesteps)
        return noisy, noise

    def per_sample_loss(self, model: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Forward the model and return the fp32 (weighted, for flow matching) MSE per sample, shape [B]."""
        noisy, target = self.inputs_and_target(latents, noise, timesteps)
        prediction = model(noisy, timesteps)
        error = ((prediction.float() - target.float()) ** 2).flatten(1).mean(dim=1)
        if self.config.prediction_type == "flow_matching":
            error = error * self._loss_weight(self.config.weighting_scheme, self.sigmas(timesteps))
        return error

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
