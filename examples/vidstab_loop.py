"""A tiny latent video denoiser trained with Accelerate + diffusers on synthetic latents, diffusers-style:
``global_step`` counted from 1, ``--checkpointing_steps``, ``--resume_from_checkpoint latest``, a cosine
schedule and gradient accumulation.

``plain_loop.py`` is the plain loop; ``vidstab_loop.py`` is the same loop guarded by vidstab, with vidstab's
checkpoints, rollback and replay (``diff examples/plain_loop.py examples/vidstab_loop.py``). Two drills put
faults into the user's own data and loop::

    python examples/vidstab_loop.py --nan_step 6       # skipped on every rank, the NaN sample captured
    python examples/vidstab_loop.py --lr_blowup_step 14  # that step refused; the schedule's LR again from the next

FSDP2: ``--fsdp`` (CPU: the script applies ``fully_shard`` per block; GPU: ``accelerate launch --use_fsdp --fsdp_version 2``).
Two processes: ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/vidstab_loop.py``.
Replay a bundle: ``PYTHONPATH=examples vidstab replay output/example/vidstab/incidents/<bundle>``.
"""

import argparse
import hashlib

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler

import vidstab


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
    parser.add_argument("--overwrite_output_dir", action="store_true", help="start over in a folder that holds a run")
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
    vidstab.claim_run_dir(accelerator, args.output_dir, resume=args.resume_from_checkpoint, overwrite=args.overwrite_output_dir)
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
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=args.output_dir, seed=0,
                           model_spec={"factory": "vidstab_loop:TinyVideoDenoiser", "kwargs": {}, "loss_fn": "vidstab_loop:denoise_loss"})
    ckpt = vidstab.CheckpointManager(accelerator, args.output_dir)
    for name, obj in {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "vidstab": guard}.items():
        ckpt.register(name, obj)
    guard.checkpoint_fn = ckpt.latest_path_str  # bundles name the checkpoint to replay on
    recovery = vidstab.Recovery(accelerator, ckpt, guard)

    global_step = 0
    if args.resume_from_checkpoint:
        state = recovery.resume(args.resume_from_checkpoint)  # None on a fresh run
        if state is not None:
            global_step = state["step"]
    fired = set()
    loss = None  # a run resumed after its last step trains nothing

    while global_step < args.max_train_steps:  # not `for epoch in range(num_train_epochs)`: a rollback costs steps
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
                guard.backward(loss, batch=batch, sample_ids=ids)
                result = guard.step(max_grad_norm=1.0)  # steps, or skips on every rank together
            if result.micro:
                continue
            state = recovery.after_step(result, global_step + 1)
            if state is not None:  # rolled back: weights, optimizer, LR schedule and guard are the last good checkpoint's;
                global_step = state["step"]  # the data goes on where it was (the bad batches are not replayed)
                continue
            global_step += 1
            if global_step % args.checkpointing_steps == 0:
                ckpt.save(global_step, healthy=guard.healthy, trainer_state={"step": global_step})
            if global_step >= args.max_train_steps:
                break
    ckpt.wait()

    finite, digest = weights_digest(accelerator.unwrap_model(model))
    last = "none (nothing left to train)" if loss is None else f"{loss.item():.4f}"
    print(f"rank {accelerator.process_index}: done at step {global_step}/{args.max_train_steps}, last loss {last}, "
          f"weights finite: {finite}, sha256 {digest}\n", end="", flush=True)  # one write: ranks share the pipe


if __name__ == "__main__":
    main()
