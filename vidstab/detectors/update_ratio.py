"""The update/weight ratio ``||dW|| / ||W||`` grew several-fold -> WARN.

The classic precursor of an AdamW divergence when the LR is too high for the current state, and
invisible in the gradient norm (benchmarks/RESULTS.md: leads of 10-29 steps on LR ramps, no false alarm
in 20k healthy steps). Uses the ratio the guard measures every ``param_norm_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ACTIONS, EMAJumpDetector, Finding, StepStats, check


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


class UpdateRatioDetector(EMAJumpDetector):
    """Ratio of the measured update ratio to its EMA; only applied steps are absorbed."""

    name = "update_ratio"
    absorb_skipped = False

    @property
    def warmup(self) -> int:
        return self.config.warmup_samples

    def value(self, s: StepStats) -> float | None:
        return s.update_ratio

    def describe(self, s: StepStats, value: float, ratio: float) -> Finding:
        return self.finding(f"update/weight ratio {value:.3g} is {ratio:.1f}x its EMA {self.ema.mean:.3g}",
                            {"update_ratio": value, "ema": self.ema.mean, "ratio": ratio})
