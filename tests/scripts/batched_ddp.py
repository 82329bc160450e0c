"""Launched by tests/test_guard_healthy_batch.py on 2 CPU processes (DDP over gloo): the unmodified loop after
``vidstab.attach``, with healthy steps batched (the guard as it is) or every step judged (``--judge_every_step``).

A NaN latent on rank 1 at step ``NAN_AT``, a hand-written LR x100 at ``LR_AT``, a loss spike at ``SPIKE_AT``.
The straggler detector runs (it promises and updates) but cannot fire: ``min_seconds`` is an hour, so the two
runs' different clocks cannot make their logs differ. Each rank writes ``rank{R}.json``: its results, how many
steps took the batched path, and the guard's final state.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator

import vidstab
from vidstab.detectors.straggler import StragglerConfig

STEPS, NAN_AT, LR_AT, SPIKE_AT = 240, 60, 120, 180


class TinyDenoiser(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(4, 16, 1)
        self.t = torch.nn.Linear(1, 16)
        self.out = torch.nn.Conv3d(16, 4, 1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h = self.inp(sample) + self.t(timestep.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(torch.nn.functional.silu(h))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--judge_every_step", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator()
    model = TinyDenoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    config = vidstab.GuardConfig(straggler=StragglerConfig(min_seconds=3600.0))
    guard = vidstab.attach(accelerator, model, optimizer, scheduler, config=config, run_dir=args.out)
    if args.judge_every_step:
        guard._batchable = False
    rank = accelerator.process_index
    g = torch.Generator().manual_seed(1 + rank)
    results = []
    for step in range(STEPS):
        latents = torch.randn(2, 4, 2, 4, 4, generator=g)
        noise = torch.randn(latents.shape, generator=g)
        t = torch.randint(0, 1000, (2,), generator=g)
        if step == NAN_AT and rank == 1:
            latents[0, 0, 0, 0, 0] = math.nan
        if step == LR_AT:
            optimizer.param_groups[0]["lr"] *= 100.0  # a user's bug: refused before it is applied
        target = noise * (30.0 if step == SPIKE_AT else 1.0)
        loss = torch.nn.functional.mse_loss(model(latents + noise, t), target)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        r = guard.last_result
        results.append(repr((r.step, r.applied, r.skipped, r.verdict.name, [f.detector for f in r.findings], r.loss,
                             r.grad_norm)))  # repr: a NaN loss equals itself
        if step == LR_AT:
            optimizer.param_groups[0]["lr"] /= 100.0
    state = guard.state_dict()
    guard.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(
        {"results": results, "steps_batched": guard.steps_batched, "state": state}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
