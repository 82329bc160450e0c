"""An LR bug that stops is not a divergence: after a skipped step the LR in param_groups is
what the schedule says (times vidstab's multiplier), so a bug that wrote it for three steps costs three skips,
no rollback and no back-off. Real Accelerate, the user's own unmodified loop, real checkpoints and recovery."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointManager
from vidstab.recovery.policy import Recovery, RecoveryConfig


def _events(run_dir, kind):
    lines = (run_dir / "vidstab" / "events-rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _loop(tmp_path, bug_steps, steps=30, scheduler=True):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10)) if scheduler else None
    if scheduler:
        model, opt, sched = acc.prepare(model, opt, sched)
    else:
        model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(keep=3, async_save=False))
    for name, obj in (("model", model), ("optimizer", opt), ("vidstab", guard)) + ((("lr_scheduler", sched),) if sched else ()):
        ckpt.register(name, obj)
    recovery = Recovery(acc, ckpt, guard, RecoveryConfig(), run_dir=str(tmp_path))
    g = torch.Generator().manual_seed(1)
    lrs_after = {}
    for step in range(steps):
        if step in bug_steps:
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 1e4  # the user's bug, for a few steps only
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x).pow(2).mean()
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        lrs_after[step] = opt.param_groups[0]["lr"]
        assert recovery.after_step(guard.last_result) is None  # never a rollback
        if (step + 1) % 5 == 0:
            ckpt.save(step + 1, healthy=guard.healthy, trainer_state={"step": step + 1})
    guard.close()
    return guard, recovery, sched, lrs_after


def test_a_three_step_lr_bug_costs_three_skips_and_no_rollback_or_backoff(tmp_path):
    guard, recovery, sched, lrs = _loop(tmp_path, bug_steps={12, 13, 14})
    skips = _events(tmp_path, "skip")
    assert sorted({e["step"] for e in skips}) == [12, 13, 14]
    assert all(e["detector"] == "lr_bound" for e in skips)
    assert not _events(tmp_path, "rollback_request") and not _events(tmp_path, "rollback")
    assert guard.lr_multiplier == 1.0 and recovery.lr_multiplier == 1.0
    # After each skip param_groups hold the schedule's LR again (the held scheduler did not move it).
    for step in (12, 13, 14):
        assert lrs[step] == sched.get_last_lr()[0] or abs(lrs[step] - 1e-3) < 1e-12
    assert lrs[14] == 1e-3  # warm-up over: the schedule's LR, not x10^4
    metrics = {e["step"]: e for e in _events(tmp_path, "metrics")}
    assert metrics[15]["applied"] and abs(metrics[15]["lr"] - 1e-3) < 1e-12


def test_without_a_scheduler_a_skip_brings_an_lr_above_the_constant_schedule_back(tmp_path):
    guard, recovery, _, lrs = _loop(tmp_path, bug_steps={6, 7, 8}, steps=15, scheduler=False)
    assert sorted({e["step"] for e in _events(tmp_path, "skip")}) == [6, 7, 8]
    assert lrs[8] == 1e-3 and not _events(tmp_path, "rollback")


def test_a_bug_on_every_other_step_escalates_by_skip_rate_then_stops(tmp_path):
    """A bug that writes the LR on every other step only: refused and applied steps in turn, so no run of
    ``consecutive_skips`` builds up. More than 30% of the last 50 steps skipped rolls back (in place, the attached
    form), the bug comes back, and past the retry budget the run stops with the message."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path, rollback_every=5)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(vidstab.RunAborted, match="still failing after 3 rollback.*skip_rate: 16 of the last 50"):
        for step in range(400):
            if step >= 20 and step % 2 == 0:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 1e4  # the user's bug, on every other step
            x = torch.randn(4, 8, generator=g)
            loss = (model(x) - x).pow(2).mean()
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    guard.close()
    skips = sorted({e["step"] for e in _events(tmp_path, "skip")})
    assert skips[:3] == [20, 22, 24] and not set(range(21, 50, 2)) & set(skips)  # never two in a row
    rollbacks = _events(tmp_path, "rollback")
    assert len(rollbacks) >= 3 and all(r["reason"].startswith("skip_rate:") for r in rollbacks)
