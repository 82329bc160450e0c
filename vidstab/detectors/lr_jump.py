"""The learning rate jumped against its own recent history -> WARN (only when the schedule's peak is unknown).

Under AdamW the update, not the gradient, scales with the LR: during an LR ramp or after a bad resume
the gradient norm can stay flat until the run is already breaking, while the LR itself shows it at once
(benchmarks/RESULTS.md: the only detector that sees an LR spike on the spike step itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import DetectorConfig, EMAJumpDetector, Finding, StepStats, check


@dataclass
class LRJumpConfig(DetectorConfig):
    """Configuration of the ``lr_jump`` detector."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: a deliberate LR change (a warm restart) is legitimate, a 2x jump
    is still worth a line in the log."""
    ratio: float = 1.2
    """Flag when ``lr / EMA(lr) >= ratio``: after warm-up, common schedules (constant, cosine, step, linear
    decay) never raise the LR above its own recent average, so a 20% rise is already news; a x1.1-per-step
    ramp reaches it in 2 steps (benchmarks/RESULTS.md)."""
    beta: float = 0.98
    """EMA decay per step (about 50 steps of memory)."""
    warmup_steps: int = 300
    """Steps absorbed before judging. A linear warm-up from 0 of ANY length stays below 1.2x its EMA from
    step ~300 on: the EMA (beta 0.98) lags a linear ramp by ~49 steps, so the ratio is t / (t - 49)."""
    quiet_steps: int = 50
    """After a warning, no new warning for this many steps; the EMA absorbs the LR meanwhile so that a
    deliberate new LR level becomes the reference instead of warning forever."""

    def validate_fields(self, prefix: str) -> None:
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_steps >= 1, f"{prefix}.warmup_steps", "must be >= 1", self.warmup_steps)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class LRJumpDetector(EMAJumpDetector):
    """Ratio of the LR to its EMA after warm-up; the flagged step is not absorbed, the quiet period is."""

    name = "lr_jump"
    # With the schedule's peak known, ``lr_bound`` judges the LR against it and without history; a rise below
    # the peak is the schedule's own (warm-up, warm restart) and no news. This EMA rule is the fallback for
    # LRs the guard cannot place (no base LR known): on every other step it is not called at all.
    needs = "lr_unplaced"
    reanchor = True  # a new LR level set on purpose (a warm restart) is the reference from then on

    def value(self, s: StepStats) -> float | None:
        return s.lr_unplaced

    def describe(self, s: StepStats, value: float, ratio: float) -> Finding:
        return self.finding(f"learning rate {value:.3g} is {ratio:.1f}x its EMA {self.ema.mean:.3g}",
                            {"lr": value, "ema": self.ema.mean, "ratio": ratio})
