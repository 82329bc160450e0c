"""Launched by tests/test_guard_attach_ddp.py on 2 CPU processes (DDP over gloo): a user's own loop,
unchanged but for ``vidstab.attach``.

Rank ``--nan_rank`` gets a NaN latent at optimizer step ``--nan_step``; rank ``--slow_rank`` sleeps
``--slow_ms`` before each forward from step ``--slow_from`` on (a slow GPU or data loader); every rank sleeps a random 0..``--jitter_ms``
per micro-step (ordinary jitter). Each rank writes ``rank{R}.json``: per optimizer step what the user's loop
can see (skipped flag, scheduler epoch, the guard's result), a SHA-256 of its final weights, finiteness.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch
from accelerate import Accelerator

import vidstab


class TinyDenoiser(torch.nn.Module):
    def __init__(self, c: int = 4, hidden: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(c, hidden, 1)
        self.t = torch.nn.Linear(1, hidden)
        self.out = torch.nn.Conv3d(hidden, c, 1)

    def forward(self, sample, timestep):
        h = self.inp(sample) + self.t(timestep.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(torch.nn.functional.silu(h))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--nan_step", type=int, default=-1)
    ap.add_argument("--nan_rank", type=int, default=1)
    ap.add_argument("--slow_rank", type=int, default=-1)
    ap.add_argument("--slow_ms", type=float, default=0.0)
    ap.add_argument("--slow_from", type=int, default=0, help="first optimizer step of the slow rank")
    ap.add_argument("--jitter_ms", type=float, default=0.0)
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accum)
    torch.manual_seed(0)
    model = TinyDenoiser()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    # A short straggler window so a 20-step test run can show it (defaults: 10 slow of 20 steps); every rank's
    # metrics line every 2 steps, so that the report's rank table has a few (default: every 50).
    config = vidstab.GuardConfig.from_dict({"straggler": {"window": 6, "patience": 4, "warmup_steps": 2},
                                            "rank_log_every": 2})
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, config=config, run_dir=args.out)

    rank = accelerator.process_index
    gen = torch.Generator().manual_seed(100 + rank)
    jitter = random.Random(rank)
    steps = []
    for step in range(args.steps):
        for micro in range(args.accum):
            latents = torch.randn(2, 4, 2, 4, 4, generator=gen)
            noise = torch.randn(latents.shape, generator=gen)
            t = torch.randint(0, 1000, (2,), generator=gen)
            if step == args.nan_step and rank == args.nan_rank and micro == 0:
                latents[1] = float("nan")
            slow = rank == args.slow_rank and step >= args.slow_from
            time.sleep((args.slow_ms if slow else 0.0) / 1e3 + jitter.random() * args.jitter_ms / 1e3)
            # --- the user's loop, unchanged ---
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(latents + noise, t), noise)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        r = guard.last_result
        steps.append({"step": r.step, "applied": r.applied, "skipped": r.skipped, "bad_ranks": r.bad_ranks,
                      "detectors": [f.detector for f in r.findings], "incident": r.incident is not None,
                      "was_skipped": accelerator.optimizer_step_was_skipped,
                      "epoch": lr_scheduler.scheduler.last_epoch})

    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    out = {"rank": rank, "steps": steps, "finite": bool(torch.isfinite(flat).all()),
           "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    guard.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
