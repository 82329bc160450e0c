"""Sustained exponential growth of the gradient norm -> WARN before it blows up."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, EMAStat, Finding, StepStats, check
from .windows import SlopeWindow, slope


@dataclass
class GradGrowthConfig(DetectorConfig):
    """Configuration of the ``grad_growth`` detector.

    A norm growing 10% per step crosses the spike detector's 10x only after ~24 steps; this detector
    sees the trend after ``window`` steps (8 by default), while there is still time to act.
    """

    action: str = "warn"
    """``warn | skip | rollback``. Warn: a trend is a forecast, not yet damage."""
    window: int = 8
    """Number of step-to-step changes looked at (``window + 1`` norms)."""
    min_rises: int = 6
    """How many of those ``window`` changes must be increases (default ``window - 2``: gradient norms are
    noisy - the per-sample timestep alone makes them so - and a real run-up still wobbles)."""
    min_growth: float = 3.0
    """Growth over the window implied by the least-squares slope of log(norm) must reach this factor.
    Tuned on a reference run diverging under an LR ramp (warned 20 steps before the loss blew up) and on
    stationary noise: about 1 false warning per 10k steps for i.i.d. log-norm noise of std 0.3, ~0 for
    smooth (autocorrelated) noise; ``min_rises=7`` missed the real run-up, ``min_growth=2`` warned 20x more
    often on noise."""
    warmup_steps: int = 50
    """Applied steps before judging: the norm often rises legitimately while the LR warms up."""
    noise_z: float = 3.5
    """The fitted growth must also be this many standard deviations of what stationary noise of the observed
    dispersion gives the fitted growth (a constant false-alarm rate as the noise grows). The dispersion is
    measured, not assumed: an EMA of the variance of step-to-step changes of log(norm), halved (the variance
    of i.i.d. noise; a steady trend moves only the changes' mean). 3.5 is ``min_growth`` at the log-norm
    std 0.3 it was tuned for (``log 3 / (3.5 x 0.31)``): below that std ``min_growth`` decides, as before;
    above it (a batch of two samples: 0.4) the bar rises with the noise instead of letting its false-alarm
    rate rise (CHANGELOG.md, "Small-batch UNet on the tuning split"). 0: off."""

    def validate_fields(self, prefix: str) -> None:
        check(self.noise_z >= 0, f"{prefix}.noise_z", "must be >= 0", self.noise_z)
        check(self.window >= 2, f"{prefix}.window", "must be >= 2", self.window)
        check(1 <= self.min_rises <= self.window, f"{prefix}.min_rises", f"must be in [1, window={self.window}]", self.min_rises)
        check(self.min_growth > 1, f"{prefix}.min_growth", "must be > 1", self.min_growth)
        check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0", self.warmup_steps)


class GradGrowthDetector(Detector):
    """Rises-count AND fitted-slope test over the last ``window`` applied steps; warns once per window.

    The log norms live in a :class:`~vidstab.detectors.windows.SlopeWindow`: the rises and the slope of
    "the window with this step's norm in it" cost O(1) per step, not a refit of the line.
    """

    name = "grad_growth"
    per_bucket = True

    def __init__(self, config: GradGrowthConfig) -> None:
        super().__init__(config)
        self.logs = SlopeWindow(config.window + 1)
        self.seen = 0
        self.changes = EMAStat(beta=0.98)  # of step-to-step changes of log(norm), applied steps (noise_z)
        self._last_log: float | None = None

    def min_log_growth(self) -> float:
        """The log growth over the window a warning needs: ``log(min_growth)``, or ``noise_z`` standard
        deviations of the least-squares growth under i.i.d. noise of the measured std, if that is larger."""
        n = self.config.window + 1
        noise_std = math.sqrt(max(self.changes.var, 0.0) / 2.0)
        fitted_std = self.config.window * noise_std * math.sqrt(12.0 / (n * (n * n - 1)))
        return max(math.log(self.config.min_growth), self.config.noise_z * fitted_std)

    def observe(self, s: StepStats) -> Finding | None:
        x = s.grad_norm
        if not (math.isfinite(x) and x > 0) or self.seen < self.config.warmup_steps or len(self.logs) < self.config.window:
            return None
        n, sum_y, sum_iy, rises = self.logs.pushed(math.log(x))  # n = window + 1 norms
        per_step = slope(n, sum_y, sum_iy)
        growth = math.exp(per_step * self.config.window)
        if rises < self.config.min_rises or per_step * self.config.window < self.min_log_growth():
            return None
        return self.finding(
            f"gradient norm rose on {rises}/{self.config.window} steps, x{growth:.2f} over the window "
            f"(x{math.exp(per_step):.3f} per step): likely heading for an explosion",
            {"grad_norm": x, "rises": float(rises), "growth": growth, "per_step": math.exp(per_step)},
        )



    def update(self, s: StepStats) -> None:
        if s.findings and any(f.detector == self.name for f in s.findings):
            self.logs.clear()  # warn once per window: the next warning needs a fresh window
        if s.applied and math.isfinite(s.grad_norm) and s.grad_norm > 0:
            y = math.log(s.grad_norm)
            if self._last_log is not None:
                self.changes.add(y - self._last_log)
            self._last_log = y
            self.logs.push(y)
            self.seen += 1

    def state_dict(self) -> dict:
        return {"logs": list(self.logs.values), "seen": self.seen, "changes": self.changes.state_dict(),
                "last_log": self._last_log}

    def load_state_dict(self, d: dict) -> None:
        self.logs = SlopeWindow(self.config.window + 1, (float(v) for v in d["logs"]))
        self.seen = int(d["seen"])
        if "changes" in d:
            self.changes.load_state_dict(d["changes"])
        last = d.get("last_log")
        self._last_log = float(last) if last is not None else None


