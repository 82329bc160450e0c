"""An extreme (finite) input value entered the batch -> WARN.

The seed's unclamped VAE encoding: one clip encodes to latents orders of magnitude larger than the rest.
The loss can hide it (LayerNorms absorb the scale under epsilon prediction); the input statistics the
guard records for ``GuardConfig.input_keys`` cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import ACTIONS, Detector, EMAStat, Finding, StepStats, check


@dataclass
class InputRangeConfig:
    """Configuration of the ``input_range`` detector."""

    enabled: bool = True
    """Watch the largest finite absolute input value of each step (over ranks)."""
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

    def validate(self, prefix: str = "input_range") -> None:
        check(self.action in ACTIONS, f"{prefix}.action", f"must be one of {ACTIONS}", self.action)
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_steps >= 1, f"{prefix}.warmup_steps", "must be >= 1", self.warmup_steps)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class InputRangeDetector(Detector):
    """Ratio of the input absmax to its EMA; names the rank(s) holding the extreme input."""

    name = "input_range"

    def __init__(self, config: InputRangeConfig) -> None:
        super().__init__(config)
        self.ema = EMAStat(beta=config.beta)
        self.quiet_until = -1
        self._flagged_step: int | None = None

    def observe(self, s: StepStats) -> Finding | None:
        x = s.input_absmax
        if not math.isfinite(x) or x <= 0 or self.ema.count < self.config.warmup_steps or s.step < self.quiet_until:
            return None
        r = self.ema.ratio(x)
        if r < self.config.ratio:
            return None
        self._flagged_step = s.step
        ranks = [i for i, v in enumerate(s.rank_input_absmax) if v >= self.config.ratio * self.ema.mean]
        return self.finding(f"input absmax {x:.4g} is {r:.1f}x its EMA {self.ema.mean:.4g} (rank(s) {ranks})",
                            {"input_absmax": x, "ema": self.ema.mean, "ratio": r}, ranks)

    def update(self, s: StepStats) -> None:
        if self._flagged_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps
        elif s.input_absmax > 0:
            self.ema.add(s.input_absmax)

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "quiet_until": self.quiet_until}

    def load_state_dict(self, d: dict) -> None:
        self.ema.load_state_dict(d["ema"])
        self.quiet_until = int(d.get("quiet_until", -1))
