"""The final-loss figure the end-to-end benchmarks compare runs by (kept out of the recorders' cache
fingerprints: changing it re-records nothing)."""

from __future__ import annotations

import torch


def fixed_noise_loss(model, objective, data: torch.Tensor, draws: int = 4) -> float:
    """Mean loss of ``model`` on every latent of ``data`` with fixed noise and timesteps (the same draws for
    every run compared; nan when non-finite): the final-loss figure of the end-to-end benchmarks."""
    from vidstab.reference.objective import step_generator

    total = 0.0
    with torch.no_grad():
        for k in range(draws):
            d = objective.sample(data, step_generator(123_457, k, 0, 0))
            total += float(objective.per_sample_loss(model, data, d["noise"], d["timesteps"]).mean())
    return total / draws
