"""Clipping on most recent steps -> WARN once (clipping is a seat belt, not an engine).

Many diffusers scripts clip at 1.0 with pre-clip norms sitting just above it for the whole run: clipping
almost every step, but mildly, is normal there. The detector therefore warns only when clipping is the
engine: most of the window clipped AND the median pre-clip norm at least ``min_clip_factor`` x the clipping
threshold (a typical update then loses more than half its length). It warns once, and re-arms only after
the condition has cleared (benchmarks/RESULTS.md: healthy runs of the reference DiT clip 80-99% of steps
with a windowed median of at most 1.71x, which the rate alone reported 2.1 times per 1k steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, check
from .windows import SortedWindow


@dataclass
class ClipRateConfig(DetectorConfig):
    """Configuration of the ``clip_rate`` detector."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: permanent clipping means the LR or the model is off, which a
    human must fix; the run itself is not in danger yet."""
    window: int = 100
    """Applied steps in the window."""
    max_rate: float = 0.8
    """Warn when more than this fraction of the window's steps were clipped ..."""
    min_clip_factor: float = 2.5
    """... and the window's median pre-clip norm is at least this multiple of ``max_grad_norm``."""

    def validate_fields(self, prefix: str) -> None:
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(0 < self.max_rate <= 1, f"{prefix}.max_rate", "must be in (0, 1]", self.max_rate)
        check(self.min_clip_factor >= 1, f"{prefix}.min_clip_factor", "must be >= 1", self.min_clip_factor)


class ClipRateDetector(Detector):
    """Judges once the window is full; warns once, re-armed when the condition has cleared.

    The window is a :class:`~vidstab.detectors.windows.SortedWindow`: the clipped count and the median of
    "the window with this step's norm in it" cost O(log window) per step, not a pass over it.
    """

    name = "clip_rate"
    per_bucket = True
    needs = "max_grad_norm"

    def __init__(self, config: ClipRateConfig) -> None:
        super().__init__(config)
        self.norms = SortedWindow(config.window)  # pre-clip norms of applied steps
        self.armed = True
        self.warmed_up = False  # the LR has reached the schedule's peak once (or the peak is unknown)

    def _heavy(self, rate: float, factor: float) -> bool:
        return rate > self.config.max_rate and factor >= self.config.min_clip_factor

    def _warm(self, s: StepStats) -> bool:
        # "Lower the LR" is wrong advice while the LR is still warming up (the fresh model clips hard and the
        # LR is a fraction of its peak): judge once the LR has reached the schedule's peak.
        return self.warmed_up or s.lr_peak is None or s.lr is None or s.lr >= 0.95 * s.lr_peak

    def observe(self, s: StepStats) -> Finding | None:
        max_norm, x = s.max_grad_norm, s.grad_norm
        if max_norm is None or not self.armed or not math.isfinite(x) or not self._warm(s):
            return None
        n = self.norms.pushed_len()  # the window as it would be with this step's norm
        if n < self.config.window:
            return None
        rate = self.norms.count_above_pushed(x, max_norm) / n
        if rate <= self.config.max_rate:
            return None  # the common case, decided without the median (``_heavy`` needs both)
        factor = self.norms.median_pushed(x) / max_norm if max_norm > 0 else math.inf
        if not self._heavy(rate, factor):
            return None
        return self.finding(
            f"gradients were clipped on {rate:.0%} of the last {n} steps, median pre-clip norm "
            f"{factor:.1f}x max_grad_norm: lower the LR or fix the model/data; clipping should be a seat belt, "
            "not the engine",
            {"clip_rate": rate, "clip_factor": factor, "window": float(n)},
        )


    def update(self, s: StepStats) -> None:
        self.warmed_up = self._warm(s)
        if s.findings and any(f.detector == self.name for f in s.findings):
            self.armed = False
        max_norm = s.max_grad_norm
        if not (s.applied and max_norm is not None and math.isfinite(s.grad_norm)):
            return
        self.norms.push(s.grad_norm)
        if not self.armed and self.norms.full:  # re-armed once the condition has cleared
            w = self.norms
            factor = w.median() / max_norm if max_norm > 0 else math.inf
            self.armed = not self._heavy(w.count_above(max_norm) / len(w), factor)

    def state_dict(self) -> dict:
        return {"norms": list(self.norms.values), "armed": self.armed, "warmed_up": self.warmed_up}

    def load_state_dict(self, d: dict) -> None:
        self.norms = SortedWindow(self.config.window, (float(n) for n in d.get("norms", [])))
        self.armed = bool(d.get("armed", True))
        self.warmed_up = bool(d.get("warmed_up", True))
