"""vidstab.recovery.lr.scale_lrs: the one LR multiplier behind the guard's back-off and the LR faults."""

from __future__ import annotations

import pytest
import torch

from vidstab.recovery.lr import scale_lrs


def _sgd(lr=0.1):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("as_scheduled", [True, False])
def test_scale_lrs_survives_scheduler_steps(as_scheduled):
    optimizer, scheduler = _sgd()
    scale_lrs(optimizer, 0.5, scheduler, as_scheduled=as_scheduled)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.05) and group["initial_lr"] == pytest.approx(0.05)
    assert scheduler.base_lrs == pytest.approx([0.05])
    # A deliberate change is the schedule's own LR; a fault leaves the scheduler's word for lr_bound to compare.
    assert scheduler.get_last_lr() == pytest.approx([0.05] if as_scheduled else [0.1])
    optimizer.step()
    scheduler.step()
    assert group["lr"] == pytest.approx(0.05 / 2) and scheduler.get_last_lr() == pytest.approx([0.05 / 2])


def test_scale_lrs_keeps_a_tensor_lr_object_and_works_without_scheduler():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=torch.tensor(0.01))
    lr = optimizer.param_groups[0]["lr"]
    scale_lrs(optimizer, 2.0)
    assert optimizer.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.02)


@pytest.mark.parametrize("schedule", ["lambda", "onecycle", "none"])
def test_lr_figures_are_the_three_readings_at_once(schedule):
    """``LRMultiplier.figures()`` (read on every optimizer step) is the group's LR, the schedule's peak times the
    multiplier (OneCycleLR's ``max_lr`` when larger) and the scheduler's last LR, through a schedule, a back-off and
    an LR written by hand."""
    from vidstab.recovery.lr import LRMultiplier

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = {"lambda": lambda: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)),
                 "onecycle": lambda: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=20),
                 "none": lambda: None}[schedule]()
    lr = LRMultiplier(optimizer, scheduler)
    for step in range(8):
        group = optimizer.param_groups[0]
        peak = 0.1 * lr.multiplier if schedule != "onecycle" else max(lr.base_lrs[0], 0.3) * lr.multiplier
        scheduled = scheduler.get_last_lr()[0] if scheduler is not None else None
        assert lr.figures() == (group["lr"], peak, scheduled), step
        if step == 3:
            lr.scale(0.5)
        if step == 5:
            optimizer.param_groups[0]["lr"] = 7.0
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
