"""A tiny latent video denoiser trained with Accelerate + diffusers on synthetic latents.

``plain_loop.py`` is the plain loop; ``vidstab_loop.py`` is the same loop guarded by vidstab. Diff them:
about five lines change. ``--corrupt_step`` puts a NaN into one batch of latents (as a broken VAE encode
would)::

    python examples/plain_loop.py --corrupt_step 12     # the NaN silently poisons the weights
    python examples/vidstab_loop.py --corrupt_step 12   # that step is skipped (on every rank) and the batch captured
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler

import vidstab


class TinyVideoDenoiser(torch.nn.Module):
    """Predicts the noise in noisy video latents [B, C, T, H, W] given the timestep."""

    def __init__(self, channels: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(channels, hidden, 3, padding=1)
        self.time = torch.nn.Linear(1, hidden)
        self.out = torch.nn.Conv3d(hidden, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.time(t.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(F.silu(h))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="output/example")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--corrupt_step", type=int, default=-1, help="batch index whose latents get a NaN")
    args = parser.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = TinyVideoDenoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=5, num_training_steps=args.steps)
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    latents = torch.randn(8 * args.steps, 4, 4, 8, 8)  # stand-in for cached VAE latents
    dataset = torch.utils.data.TensorDataset(latents, torch.arange(len(latents)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=args.output_dir)

    for i, (latents, ids) in enumerate(loader):
        if i == args.corrupt_step:
            latents = latents.clone()
            latents[0, 0, 0, 0, 0] = float("nan")
        with accelerator.accumulate(model):
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            loss = F.mse_loss(model(noisy, timesteps).float(), noise.float())
            guard.backward(loss, batch={"latents": latents, "noise": noise, "timesteps": timesteps}, sample_ids=ids)
            guard.step(max_grad_norm=1.0)  # steps, or skips on every rank together; returns a StepResult

    finite = all(torch.isfinite(p).all() for p in model.parameters())
    accelerator.print(f"done: last loss {loss.item():.4f}, parameters finite: {finite}, skipped steps: {guard.skipped_total}")


if __name__ == "__main__":
    main()
