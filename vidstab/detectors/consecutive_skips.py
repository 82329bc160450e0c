"""Too many skipped steps in a row -> ROLLBACK (skipping no longer helps)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ACTIONS, Detector, Finding, StepStats, Verdict, check


@dataclass
class ConsecutiveSkipsConfig:
    """Configuration of the ``consecutive_skips`` detector (runs after the step detectors)."""

    enabled: bool = True
    """Escalate a run of skips."""
    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: when every step is rejected, the weights or the optimizer
    state themselves are sick."""
    max_consecutive: int = 5
    """Rollback when this many optimizer steps in a row were skipped (this one included)."""

    def validate(self, prefix: str = "consecutive_skips") -> None:
        check(self.action in ACTIONS, f"{prefix}.action", f"must be one of {ACTIONS}", self.action)
        check(self.max_consecutive >= 1, f"{prefix}.max_consecutive", "must be >= 1", self.max_consecutive)


class ConsecutiveSkipsDetector(Detector):
    """Reads the verdict reached by the step detectors; the count resets on an applied step or a rollback."""

    name = "consecutive_skips"

    def __init__(self, config: ConsecutiveSkipsConfig) -> None:
        super().__init__(config)
        self.count = 0

    def observe(self, s: StepStats) -> Finding | None:
        if s.verdict < Verdict.SKIP or self.count + 1 < self.config.max_consecutive:
            return None
        return self.finding(
            f"{self.count + 1} consecutive optimizer steps skipped", {"consecutive": float(self.count + 1)}
        )

    def update(self, s: StepStats) -> None:
        if s.verdict >= Verdict.ROLLBACK:
            self.count = 0
        elif s.verdict >= Verdict.SKIP:
            self.count += 1
        elif s.applied:
            self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, d: dict) -> None:
        self.count = int(d["count"])
