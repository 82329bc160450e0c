"""Too large a share of recent steps skipped -> ROLLBACK (skipping no longer keeps the run on course).

``consecutive_skips`` sees a run of refused steps. A fault that refused steps alternate with applied ones
(a bug that rewrites the scheduler's own base LRs: the held schedule puts the LR back for one step, the
bug writes it again) never builds such a run; this detector counts the skips among the last ``window``
steps instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check
from .diagnosis import Timeline


@dataclass
class SkipRateConfig(DetectorConfig):
    """Configuration of the ``skip_rate`` detector (runs after the step detectors)."""

    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: a run that refuses this many of its steps is not training;
    past the retry budget recovery stops it with a message."""
    window: int = 50
    """Steps over which skips are counted (this one included)."""
    max_rate: float = 0.3
    """Act when more than this share of the last ``window`` steps was skipped (0.3 of 50: the 16th skip)."""

    def validate_fields(self, prefix: str) -> None:
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(0 < self.max_rate < 1, f"{prefix}.max_rate", "must be in (0, 1)", self.max_rate)


class SkipRateDetector(Detector):
    """Reads the verdict reached by the step detectors; the window is cleared after a rollback."""

    name = "skip_rate"
    needs = "findings"  # a skipped step has a finding that skipped it

    def __init__(self, config: SkipRateConfig) -> None:
        super().__init__(config)
        self.skipped: deque[bool] = deque(maxlen=config.window - 1)  # the steps before this one
        self.timeline = Timeline()

    def observe(self, s: StepStats) -> Finding | None:
        if s.verdict < Verdict.SKIP:
            return None
        count = sum(self.skipped) + 1
        if count <= self.config.max_rate * self.config.window:
            return None
        return self.finding(
            f"{count} of the last {len(self.skipped) + 1} optimizer steps skipped (more than "
            f"{self.config.max_rate:.0%} of {self.config.window}); {self.timeline.explain_with(s.step, s.findings)}",
            {"skipped": float(count), "window": float(self.config.window)},
        )

    def update(self, s: StepStats) -> None:
        if s.verdict >= Verdict.ROLLBACK:
            self.skipped.clear()
            self.timeline.clear()
            return
        if s.findings:
            self.timeline.add(s.step, s.findings)
            self.timeline.prune(s.step)
        self.skipped.append(s.verdict >= Verdict.SKIP)

    def state_dict(self) -> dict:
        return {"skipped": [int(x) for x in self.skipped], "timeline": self.timeline.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.skipped.clear()
        self.skipped.extend(bool(x) for x in d.get("skipped", []))
        self.timeline.load_state_dict(d.get("timeline", {}))
