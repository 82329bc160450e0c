"""An extreme (finite) input value entered the batch -> WARN.

An unclamped VAE encoding (docs/PRACTICES.md A1): one clip encodes to latents orders of magnitude larger than the rest.
The loss can hide it (LayerNorms absorb the scale under epsilon prediction); the input statistics the
guard records for ``GuardConfig.input_keys`` cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import DetectorConfig, EMAJumpDetector, Finding, StepStats, check


@dataclass
class InputRangeConfig(DetectorConfig):
    """Configuration of the ``input_range`` detector."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: the sample may be legitimate; the bad ranks are named, and with
    ``skip`` the offending micro-batches are captured as an incident bundle."""
    ratio: float = 10.0
    """Flag when the step's input absmax reaches this multiple of its EMA."""
    beta: float = 0.98
    """EMA decay per step (about 50 steps of memory)."""
    warmup_steps: int = 20
    """Steps absorbed before judging."""
    quiet_steps: int = 50
    """After a warning, no new warning for this many steps; values are absorbed meanwhile so that a
    deliberate change of data scale becomes the reference instead of warning forever."""

    def validate_fields(self, prefix: str) -> None:
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_steps >= 1, f"{prefix}.warmup_steps", "must be >= 1", self.warmup_steps)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class InputRangeDetector(EMAJumpDetector):
    """Ratio of the input absmax to its EMA; names the rank(s) holding the extreme input."""

    name = "input_range"
    per_bucket = True

    def value(self, s: StepStats) -> float | None:
        return s.input_absmax

    def describe(self, s: StepStats, value: float, ratio: float) -> Finding:
        ranks = [i for i, v in enumerate(s.rank_input_absmax) if v >= self.config.ratio * self.ema.mean]
        return self.finding(f"input absmax {value:.4g} is {ratio:.1f}x its EMA {self.ema.mean:.4g} (rank(s) {ranks})",
                            {"input_absmax": value, "ema": self.ema.mean, "ratio": ratio}, ranks)
