"""Launched by tests/test_oom_attached.py on 2 CPU processes (DDP over gloo): a user's own loop, unchanged but for
``vidstab.attach(..., rollback_every=100)  # its one checkpoint: the first step``, whose model runs out of memory as the ``--inject_fault`` drills say
(``oom@STEP[:RANK]`` and ``oom_batch_above@STEP=N`` in the model's forward, ``oom_in_step@STEP[:RANK][=...]``
inside ``optimizer.step()``). Two shape buckets take turns: 2 samples of 2 frames on even steps, 4 samples of 4
frames on odd ones. Then, in the same processes, the explicit form (``guard.backward`` / ``guard.step``) on a
fresh model with the ``--explicit_fault`` drills. Each rank writes ``rank{R}.json``: per step what each loop can
see, and the attached model's SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from accelerate import Accelerator

import attach_ddp  # tests/scripts: the script's own folder is on the path
import vidstab
from vidstab.faults import FaultInjector


class TinyDenoiser(attach_ddp.TinyDenoiser):
    """A user's model; its forward asks the drills whether this device has run out of memory."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = lambda samples: None

    def forward(self, sample, timestep):
        self.memory(sample.shape[0])
        return super().forward(sample, timestep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--inject_fault", action="append", default=[])
    ap.add_argument("--explicit_steps", type=int, default=6)
    ap.add_argument("--explicit_fault", action="append", default=[])
    args = ap.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = TinyDenoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    config = vidstab.GuardConfig.from_dict({"oom": {"advise_after": 2}})
    guard = vidstab.attach(accelerator, model, optimizer, config=config, run_dir=args.out, rollback_every=100)  # its one checkpoint: the first step
    rank = accelerator.process_index
    faults = FaultInjector(args.inject_fault, rank)
    accelerator.unwrap_model(model).memory = lambda samples: faults.maybe_oom(guard.global_step, samples)
    faults.arm_optimizer_step(optimizer, lambda: guard.global_step)

    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for step in range(args.steps):
        batch, frames = (4, 4) if step % 2 else (2, 2)
        latents = torch.randn(batch, 4, frames, 4, 4, generator=gen)
        noise = torch.randn(latents.shape, generator=gen)
        t = torch.randint(0, 1000, (batch,), generator=gen)
        # --- the user's loop, unchanged ---
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(latents + noise, t), noise)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        r = guard.last_result
        steps.append({"step": r.step, "applied": r.applied, "skipped": r.skipped, "rollback": r.rollback is not None,
                      "detectors": [f.detector for f in r.findings]})

    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    guard.close()
    out = {"rank": rank, "steps": steps, "finite": bool(torch.isfinite(flat).all()),
           "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "explicit": explicit(accelerator, args, gen)}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def explicit(accelerator: Accelerator, args: argparse.Namespace, gen: torch.Generator) -> list[dict]:
    """The explicit form's loop on a fresh model: what each ``guard.step`` returned."""
    model = TinyDenoiser()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = vidstab.Guard(accelerator, model, optimizer, run_dir=Path(args.out, "explicit"))
    faults = FaultInjector(args.explicit_fault, accelerator.process_index)
    faults.arm_optimizer_step(optimizer, lambda: guard.global_step)
    results = []
    for _ in range(args.explicit_steps):
        latents, noise = torch.randn(2, 4, 2, 4, 4, generator=gen), torch.randn(2, 4, 2, 4, 4, generator=gen)
        t = torch.randint(0, 1000, (2,), generator=gen)
        with accelerator.accumulate(model):
            guard.backward(torch.nn.functional.mse_loss(model(latents + noise, t), noise), batch={"latents": latents})
            r = guard.step(1.0)
        results.append({"step": r.step, "applied": r.applied, "skipped": r.skipped, "rollback": r.rollback,
                        "bad_ranks": r.bad_ranks})
    guard.close()
    return results


if __name__ == "__main__":
    main()
