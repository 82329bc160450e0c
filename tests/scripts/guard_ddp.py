"""Launched by tests/test_guard_distributed.py on 2 CPU processes (DDP over gloo).

Every rank trains a tiny denoiser on its own synthetic data with gradient accumulation; at optimizer step
``--nan_step`` rank ``--nan_rank`` alone gets a NaN micro-batch, and at ``--stop_step`` rank
``--stop_rank`` alone calls ``guard.request_stop()`` (as a SIGTERM handler on one node would). Each rank
writes ``rank{R}.json``: its StepResults, a SHA-256 of its final parameters, and whether they are finite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from accelerate import Accelerator

import vidstab


class TinyDenoiser(torch.nn.Module):
    def __init__(self, c: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(c, hidden, 1)
        self.t = torch.nn.Linear(1, hidden)
        self.out = torch.nn.Conv3d(hidden, c, 1)

    def forward(self, x, t):
        h = self.inp(x) + self.t(t.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(torch.nn.functional.silu(h))


READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
_reads = {"n": 0}


def _count_host_reads() -> None:
    """Count device->host reads (observing only: the original methods still run)."""
    for name in READS:
        fn = getattr(torch.Tensor, name)

        def inner(*a, _fn=fn, **k):
            _reads["n"] += 1
            return _fn(*a, **k)

        setattr(torch.Tensor, name, inner)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--nan_step", type=int, default=2)
    ap.add_argument("--nan_rank", type=int, default=1)
    ap.add_argument("--stop_step", type=int, default=4)
    ap.add_argument("--stop_rank", type=int, default=1)
    ap.add_argument("--error_step", type=int, default=-1)
    ap.add_argument("--error_rank", type=int, default=0)
    ap.add_argument("--spike_step", type=int, default=-1, help="this rank's latents x1e4: a gradient spike")
    ap.add_argument("--spike_rank", type=int, default=0)
    ap.add_argument("--lr_step", type=int, default=-1, help="param_groups' LR x1000 for this step (an LR bug)")
    args = ap.parse_args()

    acc = Accelerator(gradient_accumulation_steps=args.accum)
    torch.manual_seed(0)  # same init on every rank (DDP also broadcasts it)
    model = TinyDenoiser()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # AdamW would add its own CPU .item() reads
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, config=vidstab.GuardConfig(param_norm_every=2), run_dir=args.out)

    rank = acc.process_index
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    results = []
    _count_host_reads()
    for step in range(args.steps):
        reads_before = _reads["n"]
        for micro in range(args.accum):
            latents = torch.randn(2, 4, 2, 4, 4, generator=gen)
            noise = torch.randn(latents.shape, generator=gen)
            t = torch.randint(0, 1000, (2,), generator=gen)
            if step == args.nan_step and rank == args.nan_rank and micro == 0:
                latents[1] = float("nan")
            if step == args.stop_step and rank == args.stop_rank and micro == 0:
                guard.request_stop()
            if step == args.spike_step and rank == args.spike_rank:
                latents = latents * 1e4
            if step == args.lr_step and micro == 0:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 1000
            with acc.accumulate(model):
                per_sample = ((model(latents + noise, t) - noise) ** 2).flatten(1).mean(1)
                loss, error = per_sample.mean(), None
                if step == args.error_step and rank == args.error_rank and micro == 1:
                    # What the trainer does after catching an exception: a zero loss through the wrapped model
                    # keeps DDP's all-reduce in step; the guard turns the error into a lockstep verdict.
                    error, loss = RuntimeError("injected"), model(torch.zeros_like(latents), t).sum() * 0.0
                guard.backward(loss, batch={"latents": latents, "noise": noise, "timesteps": t},
                               sample_ids=[f"r{rank}-s{step}-m{micro}-{j}" for j in range(2)],
                               per_sample_loss=per_sample, timesteps=t, error=error)
                r = guard.step(max_grad_norm=1.0)
        results.append({"step": r.step, "applied": r.applied, "skipped": r.skipped, "stop": r.stop, "rollback": r.rollback,
                        "verdict": r.verdict.name, "bad_ranks": r.bad_ranks,
                        "incident": str(r.incident) if r.incident else None,
                        "was_skipped": acc.optimizer_step_was_skipped, "host_reads": _reads["n"] - reads_before})

    flat = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    out = {"rank": rank, "results": results, "finite": bool(torch.isfinite(flat).all()),
           "sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
