"""The one primitive that multiplies a run's learning rate: :func:`scale_lrs`.

A factor applied only to ``param_groups[i]["lr"]`` is undone at the next ``lr_scheduler.step()``:
``LambdaLR``-style schedulers recompute ``lr = base_lr * f(step)`` from their ``base_lrs``. So a lasting
change scales the param groups, their ``initial_lr`` (what a scheduler rebuilt on this optimizer starts
from) and the scheduler's ``base_lrs`` alike. Used by the guard's rollback back-off (``Guard.scale_lr``) and
by the ``lr_spike``/``lr_ramp`` faults (:mod:`vidstab.faults`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["scale_lrs", "torch_scheduler"]


def torch_scheduler(lr_scheduler: Any) -> Any:
    """The torch scheduler behind Accelerate's ``AcceleratedScheduler`` (or ``lr_scheduler`` itself)."""
    return getattr(lr_scheduler, "scheduler", lr_scheduler)


def scale_lrs(optimizer: torch.optim.Optimizer, factor: float, lr_scheduler: Any = None, *,
              as_scheduled: bool = True) -> None:
    """Multiply every param group's LR by ``factor`` so that the change survives ``lr_scheduler.step()``.

    Scales each group's ``lr`` (a tensor LR in place, so a compiled optimizer keeps seeing it) and
    ``initial_lr``, and the scheduler's ``base_lrs``. ``as_scheduled``: also set the scheduler's last LR
    (``get_last_lr()``) to the new LRs, so the change counts as the schedule's own -- what a deliberate
    change (the guard's back-off) wants. A fault that imitates a bug writing the LR passes False: until the
    scheduler's next step, ``get_last_lr()`` still says what the schedule set, and the ``lr_bound`` detector
    compares the step's LR with it (``vidstab.detectors.lr_bound``).
    """
    factor = float(factor)
    for g in optimizer.param_groups:
        g["lr"] = g["lr"].mul_(factor) if isinstance(g["lr"], torch.Tensor) else g["lr"] * factor
        if "initial_lr" in g:
            g["initial_lr"] = g["initial_lr"] * factor
    sch = torch_scheduler(lr_scheduler)
    if sch is not None and hasattr(sch, "base_lrs"):
        sch.base_lrs = [b * factor for b in sch.base_lrs]
        if as_scheduled and hasattr(sch, "_last_lr"):
            sch._last_lr = [g["lr"] for g in optimizer.param_groups]
