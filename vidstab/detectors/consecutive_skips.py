"""Too many skipped steps in a row -> ROLLBACK (skipping no longer helps)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check
from .diagnosis import Timeline


@dataclass
class ConsecutiveSkipsConfig(DetectorConfig):
    """Configuration of the ``consecutive_skips`` detector (runs after the step detectors)."""

    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: when every step is rejected, the weights or the optimizer
    state themselves are sick."""
    max_consecutive: int = 5
    """Rollback when this many optimizer steps in a row were skipped (this one included)."""

    def validate_fields(self, prefix: str) -> None:
        check(self.max_consecutive >= 1, f"{prefix}.max_consecutive", "must be >= 1", self.max_consecutive)


class ConsecutiveSkipsDetector(Detector):
    """Reads the verdict reached by the step detectors; the count resets on an applied step or a rollback."""

    name = "consecutive_skips"
    needs = "findings"  # a skipped step has a finding that skipped it

    def __init__(self, config: ConsecutiveSkipsConfig) -> None:
        super().__init__(config)
        self.count = 0
        self.timeline = Timeline()
        self._now: int | None = None  # the last quiet step absorbed: its expiry is still to be applied

    def observe(self, s: StepStats) -> Finding | None:
        if s.verdict < Verdict.SKIP or _out_of_memory_only(s) or self.count + 1 < self.config.max_consecutive:
            return None
        return self.finding(
            f"{self.count + 1} consecutive optimizer steps skipped; {self.timeline.explain_with(s.step, s.findings)}",
            {"consecutive": float(self.count + 1)},
        )

    def update(self, s: StepStats) -> None:
        if not s.findings:  # a quiet step: no skip, and the timeline's expiry waits for its next use
            self._now = s.step
            if s.applied:
                self._run_over()
            return
        if s.applied and s.verdict < Verdict.SKIP:
            self._run_over()
        self.timeline.add(s.step, s.findings)
        if s.verdict >= Verdict.ROLLBACK:
            self.count = 0
            self.timeline.clear()
        elif s.verdict >= Verdict.SKIP and not _out_of_memory_only(s):
            self.count += 1

    def _run_over(self) -> None:
        """An applied step: the run of skips, if any, is over, and so is its diagnosis (an earlier trouble the run
        got past must not be named as the cause of the next one)."""
        if self.count:
            self.timeline.clear()
        self.count = 0

    def state_dict(self) -> dict:
        if self._now is not None:
            self.timeline.prune(self._now)
        return {"count": self.count, "timeline": self.timeline.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self._now = None  # the loaded state was expired when it was saved
        self.count = int(d["count"])
        self.timeline.load_state_dict(d.get("timeline", {}))


def _out_of_memory_only(s: StepStats) -> bool:
    """Skipped for an OOM alone: a memory budget, not sick weights (a rollback would meet the same bucket)."""
    return all(f.detector == "oom" for f in s.findings if f.verdict >= Verdict.SKIP)
