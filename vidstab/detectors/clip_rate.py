"""Clipping on most recent steps -> WARN once (clipping is a seat belt, not an engine).

This is advice about the configuration rather than an alarm: many diffusers scripts clip at 1.0 with
pre-clip norms sitting just above it for the whole run. So it warns once, and re-arms only after the
clip rate has dropped back to ``max_rate`` or below (benchmarks/RESULTS.md: warning every window made it
the noisiest detector, 6.85 warnings per 1k healthy steps).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .base import ACTIONS, Detector, Finding, StepStats, check


@dataclass
class ClipRateConfig:
    """Configuration of the ``clip_rate`` detector."""

    enabled: bool = True
    """Watch how often gradient clipping fires."""
    action: str = "warn"
    """``warn | skip | rollback``. Warn: permanent clipping means the LR or the model is off, which a
    human must fix; the run itself is not in danger yet."""
    window: int = 100
    """Applied steps in the window."""
    max_rate: float = 0.8
    """Warn when more than this fraction of the window's steps were clipped."""

    def validate(self, prefix: str = "clip_rate") -> None:
        check(self.action in ACTIONS, f"{prefix}.action", f"must be one of {ACTIONS}", self.action)
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(0 < self.max_rate <= 1, f"{prefix}.max_rate", "must be in (0, 1]", self.max_rate)


class ClipRateDetector(Detector):
    """Judges once the window is full; warns once, re-armed when the rate is back to ``max_rate`` or below."""

    name = "clip_rate"

    def __init__(self, config: ClipRateConfig) -> None:
        super().__init__(config)
        self.flags: deque[bool] = deque(maxlen=config.window)
        self.armed = True

    @property
    def rate(self) -> float:
        """Fraction of clipped steps in the current window (0 when empty)."""
        return sum(self.flags) / len(self.flags) if self.flags else 0.0

    def observe(self, s: StepStats) -> Finding | None:
        if s.max_grad_norm is None or not self.armed:
            return None
        flags = list(self.flags)[1 - self.config.window:] + [s.clipped] if self.config.window > 1 else [s.clipped]
        if len(flags) < self.config.window:
            return None
        rate = sum(flags) / len(flags)
        if rate <= self.config.max_rate:
            return None
        return self.finding(
            f"gradients were clipped on {rate:.0%} of the last {len(flags)} steps: lower the LR or fix the "
            "model/data; clipping should be a seat belt, not the engine",
            {"clip_rate": rate, "window": float(len(flags))},
        )

    def update(self, s: StepStats) -> None:
        if any(f.detector == self.name for f in s.findings):
            self.armed = False
        if s.applied and s.max_grad_norm is not None:
            self.flags.append(bool(s.clipped))
            if not self.armed and len(self.flags) == self.config.window and self.rate <= self.config.max_rate:
                self.armed = True

    def state_dict(self) -> dict:
        return {"flags": [int(f) for f in self.flags], "armed": self.armed}

    def load_state_dict(self, d: dict) -> None:
        self.flags = deque((bool(f) for f in d["flags"]), maxlen=self.config.window)
        self.armed = bool(d.get("armed", True))
