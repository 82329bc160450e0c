"""The update/weight ratio ``||dW|| / ||W||`` grew several-fold -> WARN.

The classic precursor of an AdamW divergence when the LR is too high for the current state, and
invisible in the gradient norm (benchmarks/RESULTS.md: leads of 10-29 steps on LR ramps, no false alarm
in 20k healthy steps). Uses the ratio the guard measures every ``param_norm_every`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import ACTIONS, Detector, EMAStat, Finding, StepStats, check


@dataclass
class UpdateRatioConfig:
    """Configuration of the ``update_ratio`` detector."""

    enabled: bool = True
    """Watch the measured update/weight ratio."""
    action: str = "warn"
    """``warn | skip | rollback``. Warn: a forecast; the step detectors skip when damage shows."""
    ratio: float = 3.0
    """Flag when the update ratio reaches this multiple of its EMA."""
    beta: float = 0.9
    """EMA decay per measured sample (one every ``param_norm_every`` steps: ~10 samples of memory)."""
    warmup_samples: int = 8
    """Measured samples absorbed before judging (80 steps at ``param_norm_every=10``)."""
    quiet_steps: int = 50
    """After a warning, no new warning for this many steps; samples are absorbed meanwhile so that a new
    regime becomes the reference instead of warning forever."""

    def validate(self, prefix: str = "update_ratio") -> None:
        check(self.action in ACTIONS, f"{prefix}.action", f"must be one of {ACTIONS}", self.action)
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_samples >= 1, f"{prefix}.warmup_samples", "must be >= 1", self.warmup_samples)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class UpdateRatioDetector(Detector):
    """Ratio of the measured update ratio to its EMA; only applied steps are absorbed."""

    name = "update_ratio"

    def __init__(self, config: UpdateRatioConfig) -> None:
        super().__init__(config)
        self.ema = EMAStat(beta=config.beta)
        self.quiet_until = -1
        self._flagged_step: int | None = None

    def observe(self, s: StepStats) -> Finding | None:
        u = s.update_ratio
        if u is None or not math.isfinite(u) or self.ema.count < self.config.warmup_samples or s.step < self.quiet_until:
            return None
        r = self.ema.ratio(u)
        if r < self.config.ratio:
            return None
        self._flagged_step = s.step
        return self.finding(f"update/weight ratio {u:.3g} is {r:.1f}x its EMA {self.ema.mean:.3g}",
                            {"update_ratio": u, "ema": self.ema.mean, "ratio": r})

    def update(self, s: StepStats) -> None:
        if self._flagged_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps
        elif s.update_ratio is not None and s.applied:
            self.ema.add(s.update_ratio)

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "quiet_until": self.quiet_until}

    def load_state_dict(self, d: dict) -> None:
        self.ema.load_state_dict(d["ema"])
        self.quiet_until = int(d.get("quiet_until", -1))
