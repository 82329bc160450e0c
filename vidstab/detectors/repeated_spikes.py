"""Several spikes within a short window -> ROLLBACK (the run is in an unstable region)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check
from .diagnosis import Timeline


@dataclass
class RepeatedSpikesConfig(DetectorConfig):
    """Configuration of the ``repeated_spikes`` detector (runs after the step detectors)."""

    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: isolated spikes are bad batches; clustered ones mean the
    weights sit in an unstable region that the LR back-off of a rollback is meant to leave."""
    max_spikes: int = 3
    """Rollback when this many spikes (this one included) fall within ``window`` steps."""
    window: int = 50
    """Steps over which spikes are counted."""
    detectors: tuple[str, ...] = field(default_factory=lambda: ("grad_spike",))
    """Which detectors' findings count as spikes."""

    def validate_fields(self, prefix: str) -> None:
        check(self.max_spikes >= 1, f"{prefix}.max_spikes", "must be >= 1", self.max_spikes)
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(all(isinstance(d, str) for d in self.detectors), f"{prefix}.detectors", "must be detector names", self.detectors)


class RepeatedSpikesDetector(Detector):
    """Counts steps with a spike finding; the history is cleared after a rollback."""

    name = "repeated_spikes"
    needs = "findings"

    def __init__(self, config: RepeatedSpikesConfig) -> None:
        super().__init__(config)
        self.steps: deque[int] = deque()
        self.timeline = Timeline()
        self._now: int | None = None  # the last quiet step absorbed: its expiry is still to be applied

    def _is_spike(self, s: StepStats) -> bool:
        return any(f.detector in self.config.detectors for f in s.findings)

    def observe(self, s: StepStats) -> Finding | None:
        if not self._is_spike(s):
            return None
        recent = [x for x in self.steps if x > s.step - self.config.window] + [s.step]
        if len(recent) < self.config.max_spikes:
            return None
        return self.finding(
            f"{len(recent)} spikes within {self.config.window} steps (steps {recent}); {self.timeline.explain_with(s.step, s.findings)}",
            {"spikes": float(len(recent)), "window": float(self.config.window)},
        )

    def update(self, s: StepStats) -> None:
        if not s.findings:  # a quiet step adds nothing; what it expires goes at the next use (observe and
            self._now = s.step  # explain_with filter by step) or the next save (state_dict)
            return
        if s.verdict >= Verdict.ROLLBACK:
            self.steps.clear()
            self.timeline.clear()
            return
        self.timeline.add(s.step, s.findings)
        if self._is_spike(s):
            self.steps.append(s.step)
        self._expire(s.step)

    def _expire(self, step: int) -> None:
        while self.steps and self.steps[0] <= step - self.config.window:
            self.steps.popleft()
        self.timeline.prune(step)

    def state_dict(self) -> dict:
        if self._now is not None:
            self._expire(self._now)
        return {"steps": list(self.steps), "timeline": self.timeline.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self._now = None  # the loaded state was expired when it was saved
        self.steps = deque(int(x) for x in d["steps"])
        self.timeline.load_state_dict(d.get("timeline", {}))
