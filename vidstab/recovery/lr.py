"""The learning-rate multiplier: what recovery backs off and restores, owned by the guard.

The guard owns the multiplier and saves it with its state (``vidstab_guard.json``: ``lr_multiplier`` and the
un-multiplied ``base_lrs``) so it survives checkpoints and reloads; :class:`~vidstab.recovery.policy.Recovery`
decides when it changes (back-off on a rollback, return after a stable stretch: docs/ARCHITECTURE.md,
"Recovery") and sets it through the guard. Everything that changes an optimizer's LR for either is here:

* :func:`scale_lrs` -- the one primitive: multiply every param group's LR now and the
  scheduler's ``base_lrs`` so the factor survives ``lr_scheduler.step()`` (also used by the LR faults of
  :mod:`vidstab.faults`);
* :class:`LRMultiplier` -- the guard's multiplier over the base LRs seen at attach, re-applied after the
  optimizer/scheduler were (re)loaded, and the LR figures the detectors read (``lr``, ``lr_peak``,
  ``lr_scheduled`` of :class:`~vidstab.detectors.StepStats`);
* :meth:`LRMultiplier.restore_schedule` -- after a skipped step, put back into ``param_groups`` the LR the
  schedule set (times the multiplier): the held scheduler does not rewrite it, so a value a bug wrote there
  would otherwise outlive the bug;
* :meth:`LRMultiplier.set` -- make the multiplier a given value (recovery's decisions).
"""

from __future__ import annotations

from typing import Any

import torch


def torch_scheduler(lr_scheduler: Any) -> Any:
    """The torch scheduler behind ``lr_scheduler`` (Accelerate's ``AcceleratedScheduler`` wraps one)."""
    return getattr(lr_scheduler, "scheduler", lr_scheduler)


def scale_lrs(optimizer: Any, factor: float, lr_scheduler: Any = None, *, as_scheduled: bool = True) -> None:
    """Multiply every param group's LR by ``factor`` so that the change survives ``lr_scheduler.step()``.

    Scales each group's ``lr`` (a tensor LR in place, so a compiled optimizer keeps seeing it) and
    ``initial_lr`` (what a scheduler rebuilt on this optimizer starts from), and the scheduler's
    ``base_lrs`` (LambdaLR & co. recompute ``base_lr * f(step)``). ``as_scheduled``: also set the
    scheduler's last LR (``get_last_lr()``) to the new LRs, so the change counts as the schedule's own --
    what a deliberate change (the guard's back-off) wants. A fault that imitates a bug writing the LR
    (:mod:`vidstab.faults`) passes False: until the scheduler's next step, ``get_last_lr()`` still says what
    the schedule set, and the ``lr_bound`` detector compares the step's LR with it.
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


class LRMultiplier:
    """A persistent multiplier over the base LRs an optimizer/scheduler had when the guard was attached."""

    def __init__(self, optimizer: Any, lr_scheduler: Any = None) -> None:
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        # What figures() reads on every step, reached once: AcceleratedOptimizer.param_groups is a property
        # over the inner optimizer's, and AcceleratedScheduler wraps the torch scheduler.
        self._groups_owner = getattr(optimizer, "optimizer", optimizer)
        self._torch_scheduler = torch_scheduler(lr_scheduler)
        self.multiplier = 1.0
        """The factor in effect over :attr:`base_lrs` (1.0: the schedule as configured)."""
        self.base_lrs: list[float] = self.current_base_lrs()
        """The un-multiplied base LR of each param group (saved with the guard's state)."""

    def current_base_lrs(self) -> list[float]:
        """The base LRs in effect now: the scheduler's ``base_lrs``, else each group's ``initial_lr``/``lr``."""
        sch = torch_scheduler(self.lr_scheduler)
        if sch is not None and hasattr(sch, "base_lrs"):
            return [float(b) for b in sch.base_lrs]
        return [float(g.get("initial_lr", g["lr"])) for g in self.optimizer.param_groups]

    def figures(self) -> tuple[float | None, float | None, float | None]:
        """``(lr, peak, scheduled)`` of param group 0, read on every optimizer step, in one function (each Python
        call is a cache miss right after a training step): ``lr`` the group's LR now (None when it is a tensor:
        reading it would need a device sync); ``peak`` the largest LR the schedule can produce, the base LR at
        attach x the multiplier, or the group's ``max_lr`` (OneCycleLR/CyclicLR) x the multiplier when larger;
        ``scheduled`` the LR the scheduler set for this step (``get_last_lr()[0]``), before anyone else touched it."""
        sch = self._torch_scheduler
        last = getattr(sch, "_last_lr", None) if sch is not None else None
        scheduled = float(last[0]) if last and isinstance(last[0], (int, float)) else None
        groups = self._groups_owner.param_groups  # read every step: the optimizer's load_state_dict replaces the list
        if not groups:
            return None, None, scheduled
        group = groups[0]
        lr = group.get("lr")
        lr = float(lr) if isinstance(lr, (int, float)) else None
        peak = None
        if self.base_lrs:
            peak = self.base_lrs[0] * self.multiplier
            max_lr = group.get("max_lr")
            if isinstance(max_lr, (int, float)):
                peak = max(peak, float(max_lr) * self.multiplier)
        return lr, peak, scheduled

    def scale(self, factor: float) -> None:
        """Multiply the LR persistently (:func:`scale_lrs`) and the multiplier with it."""
        scale_lrs(self.optimizer, factor, self.lr_scheduler)
        self.multiplier *= float(factor)

    def set(self, multiplier: float) -> None:
        """Make the multiplier ``multiplier``: the optimizer/scheduler first made consistent with the one in
        effect (they may have been reloaded), then scaled by the ratio."""
        self.reapply()
        if float(multiplier) != self.multiplier:
            self.scale(float(multiplier) / self.multiplier)

    def restore_schedule(self) -> bool:
        """Set each param group's LR to what the schedule says for the step to come; True if one changed.

        With a scheduler: its last LR (``get_last_lr()``, which already holds the multiplier: :meth:`scale`
        scales its ``base_lrs``); the guard holds the scheduler after a skip, so that is still the LR of the
        refused step as the schedule set it. Without one the schedule is constant, ``base LR x multiplier``: a
        group above it is brought down to it (a lower LR may be the loop's own warm-up and is left alone).
        Called on a skipped step only: a bug that wrote ``param_groups`` for three steps costs three skips.
        """
        groups = self._groups_owner.param_groups
        sch = self._torch_scheduler
        last = getattr(sch, "_last_lr", None) if sch is not None else None
        if last is not None and len(last) == len(groups):
            targets = [float(x) for x in last]
            lower_only = False
        elif sch is None and len(self.base_lrs) == len(groups):
            targets = [b * self.multiplier for b in self.base_lrs]
            lower_only = True
        else:
            return False
        changed = False
        for g, target in zip(groups, targets):
            lr = g["lr"]
            now = float(lr)  # a tensor LR: one host read, on a skipped step only
            if now == target or (lower_only and now < target):
                continue
            if isinstance(lr, torch.Tensor):
                lr.fill_(target)
            else:
                g["lr"] = target
            changed = True
        return changed

    def reapply(self) -> None:
        """Make the optimizer/scheduler reflect the multiplier after they were (re)loaded.

        Targets are ``base * multiplier``; each param group's lr is rescaled by ``target / current base``.
        Idempotent: a scheduler restored from a checkpoint saved with the multiplier in effect already
        matches (no change); a freshly built one gets the multiplier applied.
        """
        sch = torch_scheduler(self.lr_scheduler)
        target = [b * self.multiplier for b in self.base_lrs]
        current = self.current_base_lrs()
        groups = self.optimizer.param_groups
        for i, g in enumerate(groups):
            if i >= len(target) or current[i] == 0:
                continue
            r = target[i] / current[i]
            if r != 1.0:
                g["lr"] = g["lr"] * r
                if "initial_lr" in g:
                    g["initial_lr"] = g["initial_lr"] * r
        if sch is not None and hasattr(sch, "base_lrs"):
            sch.base_lrs = list(target[: len(sch.base_lrs)])
            if hasattr(sch, "_last_lr"):
                sch._last_lr = [g["lr"] for g in groups]
