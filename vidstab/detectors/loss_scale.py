"""Frequent GradScaler scale drops under fp16 -> WARN (the model lives at the edge of overflow)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, check


@dataclass
class LossScaleConfig(DetectorConfig):
    """Configuration of the ``loss_scale`` detector (fp16 only; silent otherwise)."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: overflows are skipped by the scaler itself; frequent ones say
    the initial scale, the loss or the activations need attention."""
    window: int = 50
    """Steps over which drops are counted."""
    max_drops: int = 3
    """Warn when at least this many scale drops happen within ``window`` steps."""
    warmup_steps: int = 20
    """Ignore drops in the first steps, while the scaler calibrates down from its initial scale."""

    def validate_fields(self, prefix: str) -> None:
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(self.max_drops >= 1, f"{prefix}.max_drops", "must be >= 1", self.max_drops)
        check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0", self.warmup_steps)


class LossScaleDetector(Detector):
    """Counts steps where the scale went down; every step counts (overflow steps are the point)."""

    name = "loss_scale"
    needs = "loss_scale"

    def __init__(self, config: LossScaleConfig) -> None:
        super().__init__(config)
        self.last: float | None = None
        self.drops: deque[int] = deque()
        self.quiet_until = -1

    def _drops_with(self, s: StepStats) -> list[int]:
        drops = [d for d in self.drops if d > s.step - self.config.window]
        if self.last is not None and s.loss_scale is not None and s.loss_scale < self.last:
            if s.step >= self.config.warmup_steps:
                drops.append(s.step)
        return drops

    def observe(self, s: StepStats) -> Finding | None:
        if s.loss_scale is None or s.step < self.quiet_until:
            return None
        drops = self._drops_with(s)
        if len(drops) < self.config.max_drops:
            return None
        return self.finding(
            f"loss scale dropped {len(drops)} times in {self.config.window} steps (now {s.loss_scale:g}): "
            "frequent fp16 overflows",
            {"loss_scale": s.loss_scale, "drops": float(len(drops))},
        )

    def update(self, s: StepStats) -> None:
        if s.loss_scale is None:
            return
        self.drops = deque(self._drops_with(s))
        self.last = s.loss_scale
        if any(f.detector == self.name for f in s.findings):
            self.quiet_until = s.step + self.config.window
            self.drops.clear()

    def state_dict(self) -> dict:
        return {"last": self.last, "drops": list(self.drops), "quiet_until": self.quiet_until}

    def load_state_dict(self, d: dict) -> None:
        self.last = d["last"]
        self.drops = deque(int(x) for x in d["drops"])
        self.quiet_until = int(d["quiet_until"])
