"""Launched by tests/test_log_durability.py: a user's loop (attached guard, CheckpointManager) that resumes from
``latest`` and saves every ``--save-every`` steps. ``--kill-after-latest N`` SIGKILLs the process right after the
N-th save of this launch has moved the ``latest`` pointer (a real kill, placed by wrapping the manager's pointer
write), so nothing the process still held in memory survives it."""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointManager


def kill_after_latest(n: int) -> None:
    left = [n]
    write_pointer = CheckpointManager._write_pointer

    def wrapped(self, pointer, *a, **kw):
        write_pointer(self, pointer, *a, **kw)
        if pointer == "latest":
            left[0] -= 1
            if left[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    CheckpointManager._write_pointer = wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--kill-after-latest", type=int, default=0)
    args = ap.parse_args()
    if args.kill_after_latest:
        kill_after_latest(args.kill_after_latest)
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    guard = vidstab.attach(acc, model, optimizer, run_dir=args.out)
    ckpt = CheckpointManager(acc, args.out, CheckpointConfig(async_save=args.async_save, keep=2))
    for name, obj in (("model", model), ("optimizer", optimizer), ("vidstab", guard)):
        ckpt.register(name, obj)
    state = ckpt.load("latest")
    step = int(state["step"]) if state else 0
    guard.global_step = step
    print(f"start step {step}", flush=True)
    while step < args.steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x).pow(2).mean()
        guard.backward(loss, batch={"x": x})
        guard.step(1.0)
        step += 1
        if step % args.save_every == 0:
            ckpt.save(step, healthy=guard.healthy, trainer_state={"step": step})
    ckpt.wait()
    guard.close()


if __name__ == "__main__":
    main()
