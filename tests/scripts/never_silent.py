"""Launched by tests/test_never_silent.py on 2 CPU processes (DDP over gloo): a user's own loop, unchanged but for
``vidstab.attach(..., rollback_every=N)``, and faults it does not handle.

Rank ``--nan_rank`` gets a NaN input at step ``--nan_step`` (a skip, and an incident bundle on that rank only); a
bug writes the LR x10^4 before every step from ``--bad_lr_from`` on (refused updates, in-place rollbacks, then the
abort); ``--corrupt_at S``: before step S the main process flips bytes in every rollback checkpoint, so the next
rollback finds none that passes validation. The script itself prints nothing: every line is vidstab's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator

import vidstab


def corrupt_rollback_checkpoints(guard, out: Path) -> None:
    """Every rollback checkpoint's tensors, one byte flipped mid-file (the sizes stay: only validation sees it)."""
    guard.auto_rollback.ckpt.wait()
    guard.accelerator.wait_for_everyone()
    if guard.accelerator.is_main_process:
        for f in sorted((out / "vidstab" / "rollback").glob("step_*/*.safetensors")):
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
    guard.accelerator.wait_for_everyone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nan_step", type=int, default=-1)
    ap.add_argument("--nan_rank", type=int, default=1)
    ap.add_argument("--bad_lr_from", type=int, default=10**9)
    ap.add_argument("--corrupt_at", type=int, default=-1)
    args = ap.parse_args()
    out = Path(args.out)

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    loader = torch.utils.data.DataLoader([{"x": torch.randn(4)} for _ in range(4 * args.steps)], batch_size=2)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=out, rollback_every=4,
                           # the drill damages the files: without the host copy a rollback must read them
                           rollback_memory_budget_bytes=0 if args.corrupt_at >= 0 else None)

    global_step = 0
    for batch in loader:
        if global_step == args.corrupt_at:
            corrupt_rollback_checkpoints(guard, out)
        if global_step >= args.bad_lr_from:
            for group in optimizer.param_groups:
                group["lr"] = lr_scheduler.get_last_lr()[0] * 1e4
        x = batch["x"]
        if global_step == args.nan_step and accelerator.process_index == args.nan_rank:
            x = x * float("nan")
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        global_step += 1
        if global_step >= args.steps:
            break
    guard.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
