"""The edges of the guard's decisions, each held by a test that fails when its rule changes by one token:
the ``health_ignore`` exemption and the health boundary (``<= WARN``), the mixed-rank "bad input only" case, the
scheduler held after a skip in the attached loop, and a bucket's warm-up that counts only applied steps.
Real Accelerate, the real guard and detectors, 1 process."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from accelerate import Accelerator

import vidstab
from vidstab import GuardConfig
from vidstab.detectors import (Detector, DetectorConfig, Finding, StepStats, Verdict, register_detector,
                               unregister_detector)
from vidstab.detectors.running import absorb, build_detectors, judge
from vidstab.guard.stats import bad_input_only


@dataclass
class RegimeConfig(DetectorConfig):
    """A finding on every step from ``from_step`` on: a lasting regime (heavy clipping, a slow rank)."""

    action: str = "warn"
    from_step: int = 3


class RegimeDetector(Detector):
    name = "regime"

    def observe(self, s: StepStats) -> Finding | None:
        return self.finding("a lasting regime", {}) if s.step >= self.config.from_step else None


@pytest.fixture
def regime():
    register_detector(RegimeDetector, RegimeConfig)
    yield
    unregister_detector("regime")


def _health(tmp_path, **config) -> tuple[list[bool], list]:
    """``guard.healthy`` after each of 8 healthy steps of a tiny model, and the step results."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model, opt = torch.nn.Linear(4, 1), None
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, config=GuardConfig.from_dict({"health_window": 4, **config}),
                           run_dir=tmp_path)
    health, results = [], []
    for _ in range(8):
        x = torch.randn(4, 4)
        guard.backward(model(x).pow(2).mean(), batch={"latents": x})
        results.append(guard.step(1.0))
        health.append(guard.healthy)
    guard.close()
    return health, results


def test_a_warning_of_an_ignored_detector_leaves_checkpoints_healthy(tmp_path, regime):
    """``health_ignore``: a detector describing a lasting regime warns on every step; were its warnings counted,
    no checkpoint would ever be healthy and a rollback would have no target. And ``healthy`` holds for a last step
    that only warned (``<= WARN``)."""
    health, results = _health(tmp_path / "ignored", health_ignore=["regime"], regime={"from_step": 3})
    assert all(r.verdict == Verdict.WARN for r in results[3:])
    assert health == [True] * 8


def test_the_same_warning_not_ignored_makes_them_unhealthy_for_health_window_steps(tmp_path, regime):
    health, _ = _health(tmp_path / "counted", health_ignore=[], regime={"from_step": 3})
    assert health == [True] * 3 + [False] * 5


def test_a_skipped_last_step_is_never_healthy_even_from_an_ignored_detector(tmp_path, regime):
    """The boundary is ``<= WARN``: a step refused (SKIP) leaves the weights of the step before, not a state known
    to be good, whatever the detector."""
    health, results = _health(tmp_path / "skip", health_ignore=["regime"], regime={"from_step": 7, "action": "skip"})
    assert results[7].skipped and health == [True] * 7 + [False]


def _nonfinite(input_ranks: list[int], loss_ranks: list[int]) -> StepStats:
    s = StepStats(step=5, grad_norm=math.nan, loss=math.nan, nonfinite_input_ranks=input_ranks,
                  nonfinite_loss_ranks=loss_ranks, world_size=2)
    judge(build_detectors(GuardConfig(), world_size=2), s)
    assert s.verdict == Verdict.SKIP and [f.detector for f in s.findings] == ["nonfinite"]
    return s


def test_bad_input_only_needs_every_rank_with_a_nonfinite_loss_to_have_had_bad_inputs():
    """Two ranks: rank 0's sample is NaN, and rank 1's loss is NaN on finite inputs. The skip is not "bad data
    only": rank 1's model or step is sick, and checkpoints must become unhealthy."""
    assert bad_input_only(_nonfinite([0], [0]), ()) is True  # one bad sample: the model is fine
    assert bad_input_only(_nonfinite([0, 1], [0, 1]), ()) is True
    assert bad_input_only(_nonfinite([0], [0, 1]), ()) is False  # mixed: a finite-input rank went non-finite
    assert bad_input_only(_nonfinite([], [1]), ()) is False


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared_scheduler", "scheduler_not_prepared"])
def test_the_users_scheduler_step_is_held_after_a_skipped_step_in_the_attached_loop(tmp_path, prepared):
    """The loop is the user's own (``optimizer.step(); lr_scheduler.step()``); a skipped step must not advance the
    schedule, so the LR after it is the LR the refused step had, and the schedule ends one step behind. A scheduler
    not given to ``accelerator.prepare`` has no Accelerate wrapper to hold it: the guard's hold is the only one."""
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
    if prepared:
        model, opt, sched = acc.prepare(model, opt, sched)
    else:
        model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    lrs = []
    for step in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        x = torch.randn(4, 4)
        if step == 2:
            x[0, 0] = float("nan")
        acc.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    guard.close()
    assert guard.skipped_total == 1
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.4, 0.5])  # held at the skip, then on schedule
    assert getattr(sched, "scheduler", sched).last_epoch == 5


def test_a_bucket_in_warm_up_is_judged_by_the_pooled_test_until_it_has_enough_applied_steps():
    """A new bucket's own statistics need ``warmup_steps`` *applied* steps; until then the pooled instance judges it.
    Steps refused in that bucket absorb nothing and must not count, or a bucket whose first steps were skipped
    would leave the pooled protection with almost no statistics of its own."""
    cfg = GuardConfig.from_dict({"grad_spike": {"warmup_steps": 10, "ratio_warmup_steps": 5}})
    (spike,) = [d for d in build_detectors(cfg) if d.name == "grad_spike"]
    step = 0

    def one(bucket: str, norm: float, applied: bool = True) -> StepStats:
        nonlocal step
        s = StepStats(step=step, grad_norm=norm, loss=1.0, bucket=bucket)
        judge([spike], s)
        s.applied = applied and s.verdict < Verdict.SKIP
        absorb([spike], s)
        step += 1
        return s

    for i in range(30):
        one("480p", 1.0 + 0.01 * (i % 3))  # a warm bucket
    for i in range(3):
        one("720p", 1.0 + 0.01 * i)  # the new bucket's first applied steps
    for _ in range(8):
        one("720p", 1.0, applied=False)  # refused for another reason (e.g. a wrong LR): nothing learnt
    # 11 steps of 720p, 3 applied: its own ratio test is not warm (5), so the pooled test must judge a x30 norm
    s = one("720p", 30.0)
    assert s.verdict == Verdict.SKIP and "grad_spike" in {f.detector for f in s.findings}, s.findings
