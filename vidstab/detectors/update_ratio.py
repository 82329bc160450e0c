"""The update/weight ratio ``||dW|| / ||W||`` grew several-fold -> WARN.

The classic precursor of an AdamW divergence when the LR is too high for the current state, and
invisible in the gradient norm (benchmarks/RESULTS.md: leads of 10-29 steps on LR ramps, no false alarm
in 20k healthy steps). Uses the ratio the guard measures every ``param_norm_every`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import DetectorConfig, EMAJumpDetector, Finding, StepStats, check


@dataclass
class UpdateRatioConfig(DetectorConfig):
    """Configuration of the ``update_ratio`` detector."""

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

    def validate_fields(self, prefix: str) -> None:
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_samples >= 1, f"{prefix}.warmup_samples", "must be >= 1", self.warmup_samples)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class UpdateRatioDetector(EMAJumpDetector):
    """Ratio of the measured update ratio to its EMA; only applied steps are absorbed."""

    name = "update_ratio"
    needs = "update_ratio"
    absorb_skipped = False

    @property
    def warmup(self) -> int:
        return self.config.warmup_samples


    def value(self, s: StepStats) -> float | None:
        # Per unit of LR: an AdamW update scales with the LR, so the schedule itself (a warm restart, the end
        # of a warm-up) moves the raw ratio several-fold; per unit of LR only the optimizer state and the
        # weights move it. An LR that leaves its schedule is ``lr_bound``'s business.
        return s.update_per_lr

    def describe(self, s: StepStats, value: float, ratio: float) -> Finding:
        per_lr = s.lr is not None
        what = "update/weight ratio per unit of LR" if per_lr else "update/weight ratio"
        return self.finding(f"{what} {value:.3g} is {ratio:.1f}x its EMA {self.ema.mean:.3g} "
                            f"(update ratio {s.update_ratio:.3g})",
                            {"update_ratio": s.update_ratio, "judged": value, "ema": self.ema.mean, "ratio": ratio})
