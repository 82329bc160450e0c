"""The learning rate of this step is beyond anything the schedule can produce -> SKIP, before it is applied.

Needs no history, so it protects the first steps of a short fine-tune as well as step 100,000. The guard
hands every detector two references for the LR of the step (``StepStats.lr_peak``, ``StepStats.lr_scheduled``):

* the schedule's peak: the base LR the scheduler had when the guard attached (times vidstab's own rollback
  back-off), or the param group's ``max_lr`` (OneCycleLR, CyclicLR). Warm-up, cosine decay, warm restarts,
  step decay, linear decay never go above it.
* the LR the scheduler itself set for this step (``get_last_lr()``): a user bug that writes
  ``param_groups[i]["lr"]`` (x10^4) is far from it even while the schedule is still warming up.

The verdict is reached before ``optimizer.step()`` (the guard judges, then applies), so the refused update
never touches the weights. A bug that keeps writing the LR keeps being refused; ``consecutive_skips`` then
rolls back and, if it persists, the run aborts naming the LR (``vidstab.detectors.diagnosis``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check, lr_ratios


@dataclass
class LRBoundConfig(DetectorConfig):
    """Configuration of the ``lr_bound`` detector."""

    action: str = "skip"
    """``warn | skip | rollback``. Skip: an LR several times the schedule's peak destroys weights in a
    single AdamW step (every coordinate moves by about the LR); refusing the step costs one batch."""
    skip_peak_ratio: float = 3.0
    """Act when ``lr > skip_peak_ratio x lr_peak``. No schedule the guard can see exceeds its peak; 3x
    leaves room for a user's deliberate mild raise (which should go through ``scale_lr`` or a new run)."""
    skip_scheduled_ratio: float = 10.0
    """Act when ``lr > skip_scheduled_ratio x`` the LR the scheduler set for this step (catches an LR bug
    during a warm-up, while the peak is still far above)."""
    warn_peak_ratio: float = 1.2
    """Warn (once per ``quiet_steps``) when ``lr > warn_peak_ratio x lr_peak``: above the peak, below the
    action threshold: an LR ramp that has begun."""
    quiet_steps: int = 50
    """After a warning, no new warning for this many steps (actions are never silenced)."""

    def validate_fields(self, prefix: str) -> None:
        check(self.skip_peak_ratio > 1, f"{prefix}.skip_peak_ratio", "must be > 1", self.skip_peak_ratio)
        check(self.skip_scheduled_ratio > 1, f"{prefix}.skip_scheduled_ratio", "must be > 1", self.skip_scheduled_ratio)
        check(1 < self.warn_peak_ratio <= self.skip_peak_ratio, f"{prefix}.warn_peak_ratio",
              f"must be in (1, skip_peak_ratio={self.skip_peak_ratio}]", self.warn_peak_ratio)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class LRBoundDetector(Detector):
    """Compares the step's LR with the schedule's peak and with the LR the scheduler set; no warm-up."""

    name = "lr_bound"
    needs = "lr"

    def __init__(self, config: LRBoundConfig) -> None:
        super().__init__(config)
        self.quiet_until = -1
        self._warned_step: int | None = None

    def observe(self, s: StepStats) -> Finding | None:
        lr = s.lr
        if lr is None or not math.isfinite(lr) or lr <= 0:
            return None
        peak = s.lr_peak if s.lr_peak is not None and s.lr_peak > 0 else None
        sched = s.lr_scheduled if s.lr_scheduled is not None and s.lr_scheduled > 0 else None
        vs_peak, vs_sched = lr_ratios(lr, peak, sched)
        warn = vs_peak > self.config.warn_peak_ratio and s.step >= self.quiet_until
        skip = vs_peak > self.config.skip_peak_ratio or vs_sched > self.config.skip_scheduled_ratio
        if not (skip or warn):
            return None  # the common case: the LR the schedule set, below its peak
        figures = {"lr": lr, "lr_peak": peak or math.nan, "lr_scheduled": sched or math.nan,
                   "ratio_to_peak": vs_peak, "ratio_to_scheduled": vs_sched}
        if skip:
            what = (f"{vs_peak:.3g}x the schedule's peak {peak:.3g}" if vs_peak > self.config.skip_peak_ratio
                    else f"{vs_sched:.3g}x the {sched:.3g} the scheduler set for this step")
            return self.finding(f"learning rate {lr:.3g} is {what}: update refused before it was applied "
                                "(a wrong LR in param_groups or a broken schedule)", figures)
        self._warned_step = s.step
        return Finding(self.name, min(self.verdict, Verdict.WARN),
                       f"learning rate {lr:.3g} is {vs_peak:.2f}x the schedule's peak {peak:.3g}", figures)


    def update(self, s: StepStats) -> None:
        if self._warned_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps

    def state_dict(self) -> dict:
        return {"quiet_until": self.quiet_until}

    def load_state_dict(self, d: dict) -> None:
        self.quiet_until = int(d.get("quiet_until", -1))
