"""Sustained, corroborated warnings -> ROLLBACK to a checkpoint from before the trend began.

A slowly diverging run warns long before any step is bad enough to skip (an LR ramp: ``lr_bound`` and
``update_ratio`` dozens of steps ahead; growing attention logits: ``param_growth`` and ``grad_growth``).
One warning is a forecast; warnings from several independent detectors within a window are a trend.
This escalation detector turns that into an action while the weights are still good. Its finding names
``figures["trend_start"]``, the step of the trend's first warning. The rollback goes to the last healthy
checkpoint, and that one predates the trend: a checkpoint taken within ``GuardConfig.health_window`` steps
after a warning is no rollback target, and with ``window <= health_window`` (the defaults: 50 and 50)
every step between the trend's first warning and the rollback is within that distance of a warning.

A rollback restores weights, so the trend must include a *witness*: a warning from a detector that judges
the optimizer's trajectory (the LR, the update, the weights), not only the batch just seen. Warnings that
judge one batch (``loss_spike``, ``input_scale``, ``input_range``) and the gradient of a few batches
(``grad_growth``) all fire together on a run of unlucky small batches (a batch of two samples at t < 100
under an epsilon loss: CHANGELOG.md, "Small-batch UNet on the tuning split"), which is noise, and
a data fault they see is refused by the skip detectors and escalated by ``consecutive_skips``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check
from .diagnosis import Timeline


@dataclass
class TrendConfig(DetectorConfig):
    """Configuration of the ``trend`` escalation detector (runs after the step detectors)."""

    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: the weights are still good now and will not be soon."""
    window: int = 50
    """Steps over which warnings are collected. Keep it <= ``GuardConfig.health_window``: then no checkpoint
    taken after the trend began is healthy, so the rollback lands before the trend (module docstring)."""
    min_detectors: int = 2
    """Act when at least this many different detectors (of ``detectors``) warned within ``window`` steps ..."""
    min_steps: int = 2
    """... on at least this many different steps: one bad batch often trips two detectors at once, and a
    one-off is a skip's business (``grad_spike``), not a trend."""
    detectors: tuple[str, ...] = field(default_factory=lambda: (
        "lr_bound", "lr_jump", "update_ratio", "grad_growth", "param_growth", "loss_spike", "input_scale",
        "input_range"))
    """Which detectors' WARN findings count (a finding that already skips has acted; ``repeated_spikes``
    escalates those). ``clip_rate`` and ``loss_scale`` describe a lasting regime, not a trend."""
    witnesses: tuple[str, ...] = field(default_factory=lambda: ("lr_bound", "lr_jump", "update_ratio", "param_growth"))
    """At least one counted warning must come from one of these (the detectors that judge the LR, the update or
    the weights, module docstring); empty: any counted detector will do."""

    def validate_fields(self, prefix: str) -> None:
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(self.min_detectors >= 1, f"{prefix}.min_detectors", "must be >= 1", self.min_detectors)
        check(self.min_steps >= 1, f"{prefix}.min_steps", "must be >= 1", self.min_steps)
        check(all(isinstance(d, str) for d in self.detectors), f"{prefix}.detectors", "must be detector names",
              self.detectors)
        check(all(isinstance(d, str) for d in self.witnesses), f"{prefix}.witnesses", "must be detector names",
              self.witnesses)


class TrendDetector(Detector):
    """Counts distinct warning detectors in a sliding window; cleared after any rollback."""

    name = "trend"
    needs = "findings"

    def __init__(self, config: TrendConfig) -> None:
        super().__init__(config)
        self.warnings: deque[tuple[int, str]] = deque()
        self.timeline = Timeline(horizon=config.window)
        self._now: int | None = None  # the last quiet step absorbed: its expiry is still to be applied

    def _counted(self, s: StepStats) -> list[tuple[int, str]]:
        return [(s.step, f.detector) for f in s.findings
                if f.detector in self.config.detectors and f.verdict == Verdict.WARN]

    def observe(self, s: StepStats) -> Finding | None:
        mine = self._counted(s)
        if s.verdict >= Verdict.ROLLBACK or not mine:
            return None
        recent = [(st, d) for st, d in self.warnings if st > s.step - self.config.window] + mine
        names = sorted({d for _, d in recent})
        if len(names) < self.config.min_detectors or len({st for st, _ in recent}) < self.config.min_steps:
            return None
        if self.config.witnesses and not set(names) & set(self.config.witnesses):
            return None  # batch-side warnings only: noise of small batches or a data fault, not the weights
        start = min(st for st, _ in recent)
        return self.finding(
            f"{len(names)} detectors warned within {s.step - start + 1} steps ({', '.join(names)}), since step "
            f"{start}: a trend, not noise; {self.timeline.explain_with(s.step, s.findings)}. Roll back to a checkpoint from before step {start}",
            {"trend_start": float(start), "detectors": float(len(names)), "warnings": float(len(recent))},
        )

    def update(self, s: StepStats) -> None:
        if not s.findings:  # a quiet step adds nothing; what it expires goes at the next use (observe and
            self._now = s.step  # explain_with filter by step) or the next save (state_dict)
            return
        if s.verdict >= Verdict.ROLLBACK:
            self.warnings.clear()
            self.timeline.clear()
            return
        self.timeline.add(s.step, s.findings)
        self.warnings.extend(self._counted(s))
        self._expire(s.step)

    def _expire(self, step: int) -> None:
        while self.warnings and self.warnings[0][0] <= step - self.config.window:
            self.warnings.popleft()
        self.timeline.prune(step)

    def state_dict(self) -> dict:
        if self._now is not None:
            self._expire(self._now)
        return {"warnings": [list(w) for w in self.warnings], "timeline": self.timeline.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self._now = None  # the loaded state was expired when it was saved
        self.warnings = deque((int(a), str(b)) for a, b in d.get("warnings", []))
        self.timeline.load_state_dict(d.get("timeline", {}))
