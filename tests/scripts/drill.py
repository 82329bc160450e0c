"""Run a training script no one changed for a drill, with faults injected from outside it.

    python tests/scripts/drill.py [--fault SPEC]... SCRIPT [SCRIPT ARGS]...   (no fault: the script as it is)
    accelerate launch ... tests/scripts/drill.py --fault nan@4:1 SCRIPT ...

The script runs as ``__main__`` (``runpy``). Faults, at the loop's optimizer step ``STEP`` (the attached
guard's ``global_step``: restored by the script's own resume), on rank ``RANK`` (default: every rank):

- ``nan@STEP[:RANK]``: sample 1 of the step's first micro-batch becomes NaN (its first floating tensor
  of two or more dimensions: the images or latents), once per process;
- ``lr@STEP[:RANK][+N]=FACTOR``: before each of the steps ``STEP .. STEP+N-1`` (no ``+N``: every step from
  ``STEP`` on) every param group's LR is written as ``FACTOR`` x what the schedule set, as a bug in the
  loop would; the schedule itself is untouched;
- ``kill@STEP[:RANK]``: the process SIGKILLs itself when it fetches the step's first micro-batch;
- ``nanweight@STEP[:RANK]``: the optimizer step of ``STEP`` leaves one weight NaN (the first element of the
  model's first parameter, written right after the loop's ``optimizer.step()``: what the script does next, e.g.
  its EMA's step, sees it, as after a bad update).

No fault fires again in a torch-elastic restart of the job (``TORCHELASTIC_RESTART_COUNT > 0``), as vidstab's own.

Every random number generator is seeded with 0 first (the script seeds none). Without torchvision installed, the script's image transforms come from tests/shims/torchvision.
The batches go through Accelerate's ``DataLoaderShard`` (also after ``skip_first_batches``), so the hooks
sit on that class and on ``Accelerator.prepare``; nothing in the script is edited.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import runpy
import signal
import sys

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard

SPEC = re.compile(r"^(?P<kind>nan|lr|kill|nanweight)@(?P<step>\d+)(?::(?P<rank>\d+))?(?:\+(?P<count>\d+))?(?:=(?P<arg>.+))?$")


class Drill:
    def __init__(self, specs: list[str]) -> None:
        self.faults = []
        for spec in specs:
            m = SPEC.match(spec)
            if m is None:
                raise SystemExit(f"drill.py: bad --fault {spec!r}")
            self.faults.append({"kind": m["kind"], "step": int(m["step"]), "rank": None if m["rank"] is None else int(m["rank"]),
                                "count": None if m["count"] is None else int(m["count"]), "arg": m["arg"], "fired": False})
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:  # a restart: the drill was done
            for f in self.faults:
                f["fired"] = True
                f["count"] = 0 if f["kind"] == "lr" else f["count"]
        self.prepared: list = []
        self.last_step = None

    def _guard(self):
        for obj in self.prepared:
            guard = getattr(obj, "_vidstab_guard", None)
            if guard is not None:
                return guard
        return None

    def on_batch(self, batch):
        guard = self._guard()
        if guard is None:
            return batch
        step, rank = guard.global_step, guard.rank
        first = step != self.last_step  # the step's first micro-batch
        self.last_step = step
        for f in self.faults:
            if f["rank"] is not None and f["rank"] != rank:
                continue
            if f["kind"] == "lr":
                end = float("inf") if f["count"] is None else f["step"] + f["count"]
                if f["step"] <= step < end:
                    self._write_lr(guard, float(f["arg"]))
            elif first and not f["fired"] and step == f["step"]:
                f["fired"] = True
                if f["kind"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if f["kind"] == "nanweight":
                    _nan_after_step(guard)
                    continue
                batch = _nan_sample(batch)
                print(f"drill: sample 1 of step {step}'s batch on rank {rank} is NaN", flush=True)
        return batch

    @staticmethod
    def _write_lr(guard, factor: float) -> None:
        scheduler = getattr(guard.lr_scheduler, "scheduler", guard.lr_scheduler)
        for group, lr in zip(guard.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr * factor


def _nan_after_step(guard) -> None:
    """The next ``optimizer.step()`` of the loop leaves the model's first weight NaN (once)."""
    optimizer, step = guard.optimizer, guard.optimizer.step

    def step_then_nan(*args, **kwargs):
        out = step(*args, **kwargs)
        if guard.accelerator.sync_gradients:
            with torch.no_grad():
                next(guard.model.parameters()).view(-1)[0] = float("nan")
            optimizer.step = step
            print(f"drill: a weight is NaN after step {guard.global_step - 1} on rank {guard.rank}", flush=True)
        return out

    optimizer.step = step_then_nan


def _nan_sample(batch):
    if isinstance(batch, dict):
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2:
                value = value.clone()
                value[1] = float("nan")
                return {**batch, key: value}
    raise SystemExit("drill.py: the batch has no floating tensor of two or more dimensions to corrupt")


def _torchvision_shim() -> None:
    """The image transforms of tests/shims/torchvision for the script, without transformers (imported by
    diffusers' pipelines) taking the shim for a whole torchvision: it decides that once, before the shim is
    on the path."""
    try:
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except ImportError:
        pass
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shims"))


def main() -> None:
    argv, specs = sys.argv[1:], []
    while argv[:1] == ["--fault"] and len(argv) >= 2:
        specs.append(argv[1])
        argv = argv[2:]
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    script, script_args = argv[0], argv[1:]
    drill = Drill(specs)

    prepare = Accelerator.prepare

    def prepare_and_remember(self, *args, **kwargs):
        out = prepare(self, *args, **kwargs)
        drill.prepared.extend(out if isinstance(out, tuple) else (out,))
        return out

    batches = DataLoaderShard.__iter__

    def drilled_batches(self):
        for batch in batches(self):
            yield drill.on_batch(batch)

    if importlib.util.find_spec("torchvision") is None:
        _torchvision_shim()
    Accelerator.prepare = prepare_and_remember
    DataLoaderShard.__iter__ = drilled_batches
    # The script seeds nothing: seeded here, two runs of it can be compared bitwise.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
