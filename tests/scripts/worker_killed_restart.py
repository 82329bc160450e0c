"""Launched by tests/test_host_memory.py under ``accelerate launch --max_restarts 1`` on 2 CPU processes: a user's
loop with ``vidstab.attach`` and ``guard.track_samples(loader)`` (one data-loader worker per rank) that checkpoints
with ``accelerator.save_state`` every ``--save_every`` steps and, when started again, resumes from its newest
``checkpoint-N`` (``accelerator.load_state``; the batches already taken are skipped by iterating).

In the first attempt the worker of rank 1 SIGKILLs itself (what the kernel's out-of-memory killer sends) while
loading the first sample of step ``--kill_step`` (Accelerate's loader reads one batch ahead: the error reaches the
loop as it fetches the step before). Each attempt of each rank appends one line to
``attempts-rank{R}.jsonl``: the step it resumed from and the steps it trained.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from accelerate import Accelerator

import vidstab

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Samples(torch.utils.data.Dataset):
    """``size`` samples; in the first attempt, the worker of rank 1 loading ``kill_index`` SIGKILLs itself."""

    def __init__(self, size: int, kill_index: int) -> None:
        self.size, self.kill_index = size, kill_index

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.kill_index and ATTEMPT == 0 and os.environ.get("RANK") == "1":
            time.sleep(1.0)  # the loop is back in the loader's next() when the signal's SIGCHLD reaches it
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((4,), float(i) / self.size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save_every", type=int, default=2)
    ap.add_argument("--kill_step", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)

    accelerator = Accelerator()
    world, rank, batch = accelerator.num_processes, accelerator.process_index, 2
    # Batches go to the ranks in turn (no shuffle): rank 1's batch of step s starts at sample (s * world + 1) * batch.
    data = Samples(args.steps * world * batch, (args.kill_step * world + 1) * batch)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=1, prefetch_factor=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = vidstab.attach(accelerator, model, optimizer, run_dir=out)
    loader = guard.track_samples(loader)

    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    start = saved[-1] if saved else 0
    if start:
        accelerator.load_state(str(out / f"checkpoint-{start}"))
    trained = []
    for step, x in enumerate(loader):
        if step < start:
            continue  # taken before the checkpoint
        accelerator.backward((model(x) - 1.0).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        trained.append(guard.global_step - 1)
        if (step + 1) % args.save_every == 0:
            accelerator.save_state(str(out / f"checkpoint-{step + 1}"))
        with open(out / f"attempts-rank{rank}.jsonl", "a") as f:  # per step: a killed attempt still says what it did
            f.write(json.dumps({"attempt": ATTEMPT, "resumed": start, "trained": trained,
                                "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}) + "\n")
    guard.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
