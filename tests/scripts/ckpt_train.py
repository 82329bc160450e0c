"""Tiny deterministic Accelerate training loop with vidstab checkpoints, for resume / kill tests.

Run as a script (one process) or import ``train``. It resumes from ``OUT/vidstab/checkpoints/latest`` when there
is one, saves every ``--save-every`` steps, and at the end writes ``OUT/final.safetensors`` (model
weights) and ``OUT/losses.json`` (``{step: float.hex(loss)}``) so a test can compare runs bitwise.

``--kill-at KIND:N`` SIGKILLs the process at a precise point of the N-th checkpoint write (a real
kill, placed by wrapping the functions the checkpoint code calls):
``tensors`` after a safetensors file is written, ``manifest`` half-way through writing manifest.json,
``pointer`` before a pointer file replaces the old one, ``rotate`` before old checkpoints are deleted.
``--preempt`` runs under PreemptionHandler: SIGTERM -> checkpoint at the current step, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from vidstab import checkpoint as ck
from vidstab.files import statedict_io as sio
from vidstab.checkpoint import CheckpointConfig, CheckpointManager
from vidstab.run.preemption import PreemptionHandler


def build(hidden: int = 256, init_seed: int = 0, data_seed: int = 1234):
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=data_seed))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(96, 16, generator=g), torch.randn(96, 4, generator=g)
    # A generator of its own: DataLoader.__iter__ draws a base seed from it, not from the global RNG,
    # so creating the iterator on resume does not shift the RNG stream restored from the checkpoint.
    dl = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(data_seed))
    set_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    return acc, model, opt, dl, sched


def batches(acc, dl, consumed: int):
    """Endless batch stream starting after ``consumed`` batches (epoch-seeded shuffling)."""
    epoch, index = divmod(consumed, len(dl))
    while True:
        dl.set_epoch(epoch)
        yield from (acc.skip_first_batches(dl, index) if index else dl)
        epoch, index = epoch + 1, 0


def train(out: str, steps: int, save_every: int = 1, async_save: bool = False, keep: int = 3, hidden: int = 256,
          init_seed: int = 0, preempt: bool = False, verbose: bool = False, step_sleep: float = 0.0) -> dict[int, float]:
    acc, model, opt, dl, sched = build(hidden, init_seed)
    ckpt = CheckpointManager(acc, out, CheckpointConfig(keep=keep, async_save=async_save))
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    ckpt.register("lr_scheduler", sched)
    state = ckpt.load("latest")
    step = int(state["step"]) if state else 0
    consumed = int(state["batches_consumed"]) if state else 0
    if verbose:
        print(f"start step {step}", flush=True)
    data = batches(acc, dl, consumed)
    losses: dict[int, float] = {}
    handler = PreemptionHandler()
    with handler if preempt else _nullcontext():
        while step < steps:
            x, y = next(data)
            consumed += 1
            noise = 0.1 * torch.randn_like(y)  # uses the global RNG, like diffusion noise
            loss = F.mse_loss(model(x), y + noise)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            losses[step] = loss.item()
            if step_sleep:
                time.sleep(step_sleep)
            if verbose:
                print(f"step {step} loss {losses[step]!r}", flush=True)
            stop = handler.stop_requested
            if step % save_every == 0 or step == steps or stop:
                ckpt.save(step, healthy=True, trainer_state={"step": step, "batches_consumed": consumed})
            if stop:
                ckpt.wait()
                print(f"preempted at step {step}", flush=True)
                return losses
    ckpt.wait()
    if acc.is_main_process:
        # losses.json first, final.safetensors last, each via rename: final.safetensors means "finished".
        with open(os.path.join(out, "losses.json.tmp"), "w") as fh:
            json.dump({str(k): float.hex(v) for k, v in losses.items()}, fh)
        os.replace(os.path.join(out, "losses.json.tmp"), os.path.join(out, "losses.json"))
        save_file({k: v.contiguous() for k, v in acc.unwrap_model(model).state_dict().items()},
                  os.path.join(out, "final.safetensors.tmp"))
        os.replace(os.path.join(out, "final.safetensors.tmp"), os.path.join(out, "final.safetensors"))
    return losses


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def install_kill(spec: str) -> None:
    """Wrap a checkpoint internal so the process SIGKILLs itself at the N-th call (see module doc)."""
    kind, n = spec.split(":")
    left = [int(n)]

    def hit() -> bool:
        left[0] -= 1
        return left[0] <= 0

    def die() -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "tensors":
        orig = sio.write_safetensors

        def wrapped(*a, **kw):
            d = orig(*a, **kw)
            if hit():
                die()
            return d
        sio.write_safetensors = wrapped
    elif kind == "manifest":
        orig_b = sio.write_bytes

        def wrapped_b(path, data, fsync=True, **kw):
            if os.path.basename(path) == ck.MANIFEST and hit():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, data[: len(data) // 2])
                os.fsync(fd)
                die()
            return orig_b(path, data, fsync, **kw)
        sio.write_bytes = wrapped_b
    elif kind in ("pointer", "rotate"):
        attr = "_write_pointer" if kind == "pointer" else "_rotate"
        orig_m = getattr(CheckpointManager, attr)

        def wrapped_m(self, *a, **kw):
            if hit():
                die()
            return orig_m(self, *a, **kw)
        setattr(CheckpointManager, attr, wrapped_m)
    else:
        raise SystemExit(f"unknown kill point {spec}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--kill-at", default=None)
    p.add_argument("--preempt", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to give a signal time to land")
    a = p.parse_args()
    if a.kill_at:
        install_kill(a.kill_at)
    torch.set_num_threads(1)  # tiny model: threads only fight over the shared CPUs
    train(a.out, a.steps, a.save_every, a.async_save, a.keep, a.hidden, preempt=a.preempt, verbose=True,
          step_sleep=a.step_sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
