"""A tiny latent video denoiser trained with Accelerate + diffusers on synthetic latents, diffusers-style:
``global_step`` counted from 1, ``--checkpointing_steps``, ``--resume_from_checkpoint latest``, a cosine
schedule and gradient accumulation.

``plain_loop.py`` is the plain loop; ``vidstab_loop.py`` is the same loop guarded by vidstab, with vidstab's
checkpoints, rollback and replay (``diff examples/plain_loop.py examples/vidstab_loop.py``). Two drills put
faults into the user's own data and loop::

    python examples/plain_loop.py --nan_step 6       # a NaN sample silently poisons the weights
    python examples/plain_loop.py --lr_blowup_step 14  # a param_groups bug: LR x10^4 for one step; the run is ruined

FSDP2: ``--fsdp`` (CPU: the script applies ``fully_shard`` per block; GPU: ``accelerate launch --use_fsdp --fsdp_version 2``).
Two processes: ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/plain_loop.py``.
"""

import argparse
import hashlib
import math
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler


class TinyVideoDenoiser(torch.nn.Module):
    """Predicts the noise in noisy video latents [B, C, T, H, W] given the timestep."""

    def __init__(self, channels: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(channels, hidden, 3, padding=1)
        self.time = torch.nn.Linear(1, hidden)
        self.out = torch.nn.Conv3d(hidden, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.time(t.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(F.silu(h))


def denoise_loss(model: torch.nn.Module, batch: dict, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Epsilon-prediction MSE per sample of ``{"latents", "noise", "timesteps"}``."""
    noise_scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps)
    noisy = noise_scheduler.add_noise(batch["latents"], batch["noise"], batch["timesteps"])
    return F.mse_loss(model(noisy, batch["timesteps"]).float(), batch["noise"].float(), reduction="none").mean(dim=(1, 2, 3, 4))


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="output/example")
    parser.add_argument("--max_train_steps", type=int, default=30)
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--resume_from_checkpoint", default=None, help='"latest" or a checkpoint folder')
    parser.add_argument("--nan_step", type=int, default=-1, help="global step whose batch gets a NaN sample (drill)")
    parser.add_argument("--nan_rank", type=int, default=0, help="the rank whose batch gets it")
    parser.add_argument("--lr_blowup_step", type=int, default=-1, help="global step whose LR is x10^4 (drill)")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (GPU: accelerate launch --use_fsdp --fsdp_version 2)")
    return parser.parse_args()


def weights_digest(model: torch.nn.Module) -> tuple[bool, str]:
    # FSDP2 parameters are DTensors holding this rank's shard: full_tensor() gathers them (every rank calls it).
    params = [getattr(p, "full_tensor", p.detach)().detach().cpu().contiguous() for p in model.parameters()]
    return all(bool(torch.isfinite(p).all()) for p in params), hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()[:16]


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    model = TinyVideoDenoiser()
    # Accelerate refuses FSDP on CPU: there --fsdp applies FSDP2 per block itself (before the optimizer is built:
    # sharding turns the parameters into DTensors) and leaves the model out of prepare (DDP must not wrap it), so
    # Accelerate's save_state does not hold that model; vidstab's CheckpointManager does, as sharded files.
    shard_by_hand = args.fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU
    if args.fsdp and accelerator.num_processes > 1 and not (shard_by_hand or accelerator.is_fsdp2):
        raise SystemExit("--fsdp on GPU needs Accelerate's FSDP2: accelerate launch --use_fsdp --fsdp_version 2")
    if shard_by_hand:
        from torch.distributed.fsdp import fully_shard

        for module in [*model.children(), model]:
            fully_shard(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=5 * accelerator.num_processes,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
    latents = torch.randn(64, 4, 2, 8, 8, generator=torch.Generator().manual_seed(0))  # stand-in for cached VAE latents
    dataset = torch.utils.data.TensorDataset(latents, torch.arange(len(latents)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    if shard_by_hand:
        optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    else:  # FSDP2 through Accelerate needs the model and its optimizer in the same prepare call
        model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)

    num_train_epochs = math.ceil(args.max_train_steps / math.ceil(len(loader) / accelerator.gradient_accumulation_steps))
    global_step = 0
    if args.resume_from_checkpoint:
        dirs = sorted((d for d in os.listdir(args.output_dir) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1])) if os.path.isdir(args.output_dir) else []
        path = os.path.join(args.output_dir, dirs[-1]) if args.resume_from_checkpoint == "latest" and dirs else args.resume_from_checkpoint
        if path != "latest":
            accelerator.load_state(path)
            global_step = int(os.path.basename(path).split("-")[1])
    fired = set()

    for epoch in range(num_train_epochs):
        for latents, ids in loader:
            if global_step + 1 == args.nan_step and accelerator.process_index == args.nan_rank and "nan" not in fired:
                fired.add("nan")
                latents = latents.clone()
                latents[0, 0, 0, 0, 0] = float("nan")  # a broken sample, as a bad VAE encode would give
            if global_step + 1 == args.lr_blowup_step and "lr" not in fired:
                fired.add("lr")
                for group in optimizer.param_groups:
                    group["lr"] *= 1e4  # a bug in the user's loop; lr_scheduler.step() recomputes it afterwards
            with accelerator.accumulate(model):
                noise = torch.randn_like(latents)
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
                batch = {"latents": latents, "noise": noise, "timesteps": timesteps}
                loss = denoise_loss(model, batch).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % args.checkpointing_steps == 0 and (accelerator.is_main_process or accelerator.is_fsdp2):
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))
            if global_step >= args.max_train_steps:
                break
        if global_step >= args.max_train_steps:
            break

    finite, digest = weights_digest(accelerator.unwrap_model(model))
    print(f"rank {accelerator.process_index}: done at step {global_step}/{args.max_train_steps}, last loss {loss.item():.4f}, "
          f"weights finite: {finite}, sha256 {digest}\n", end="", flush=True)  # one write: ranks share the pipe


if __name__ == "__main__":
    main()
