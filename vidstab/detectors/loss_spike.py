"""A loss spike against its EMA -> WARN by default."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, EMAStat, Finding, StepStats, check


@dataclass
class LossSpikeConfig(DetectorConfig):
    """Configuration of the ``loss_spike`` detector."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: diffusion losses are noisy by nature (the timestep is sampled
    per sample), so a high loss alone is weak evidence; the gradient detectors decide skips."""
    ratio: float = 5.0
    """Flag when ``loss / EMA(loss) >= ratio``. 5, not 3: a small-batch diffusion loss with random
    timesteps reaches 3-4x its EMA on healthy steps (benchmarks/RESULTS.md: 4.25 false alarms per 1k
    steps at 3, none at 5, and every divergence still caught at the same step)."""
    zscore: float = 6.0
    """Flag when the loss z-score against the EMA mean/std is ``>= zscore``."""
    beta: float = 0.98
    """EMA decay per applied step (about 50 steps of memory)."""
    warmup_steps: int = 20
    """Applied steps absorbed before the detector judges."""
    min_std_fraction: float = 0.1
    """Floor of the EMA std as a fraction of the EMA mean (a harmless wiggle in a quiet phase is not a 6-sigma event)."""

    def validate_fields(self, prefix: str) -> None:
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(self.zscore > 0, f"{prefix}.zscore", "must be > 0", self.zscore)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_steps >= 1, f"{prefix}.warmup_steps", "must be >= 1", self.warmup_steps)
        check(self.min_std_fraction >= 0, f"{prefix}.min_std_fraction", "must be >= 0", self.min_std_fraction)


class LossSpikeDetector(Detector):
    """Ratio OR z-score test after warm-up; flagged steps are not absorbed."""

    name = "loss_spike"

    def __init__(self, config: LossSpikeConfig) -> None:
        super().__init__(config)
        self.ema = EMAStat(beta=config.beta)
        self._flagged_step: int | None = None

    def observe(self, s: StepStats) -> Finding | None:
        x = s.loss
        if not math.isfinite(x) or self.ema.count < self.config.warmup_steps:
            return None
        ratio, z = self.ema.ratio(x), self.ema.zscore(x, self.config.min_std_fraction)
        if ratio < self.config.ratio and z < self.config.zscore:
            return None
        self._flagged_step = s.step
        finite = [(v, r) for r, v in enumerate(s.rank_loss) if math.isfinite(v)]
        ranks = [max(finite)[1]] if finite else []
        return self.finding(
            f"loss {x:.4g} is {ratio:.1f}x its EMA {self.ema.mean:.4g} (z={z:.1f})",
            {"loss": x, "ema": self.ema.mean, "ratio": ratio, "zscore": z},
            ranks,
        )

    def update(self, s: StepStats) -> None:
        if s.applied and self._flagged_step != s.step:
            self.ema.add(s.loss)

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.ema.load_state_dict(d["ema"])
