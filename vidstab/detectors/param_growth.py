"""Parameter norm growing fast over a long window -> WARN.

The norm is judged against the *lowest* norm measured within the last ``window`` steps (back to the newest
sample at least ``window`` steps old), and from the second measurement on, not only once ``window`` steps of
history exist: a x1.5 growth in 10 steps is at least as alarming as one in 200. Without that, a fault whose
weights blow up inside the first ``window`` steps of a run (or of the detector's history) was judged only at
step ``window``: on attention-logit growth without QK-norm (query/key weights x1.1 per step) that left the
first finding 9-27 steps behind OLMo's 6-sigma rule (CHANGELOG.md, "Logit growth on the tuning
split", where this was chosen). Healthy runs grow far less (at most x1.03 within 200 steps on every tuning
run), and the rule fires wherever the old one did (its reference is among the samples compared).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, check


@dataclass
class ParamGrowthConfig(DetectorConfig):
    """Configuration of the ``param_growth`` detector (uses the norm measured every ``param_norm_every``)."""

    action: str = "warn"
    """``warn | skip | rollback``. Warn: weight growth is slow damage (weight decay too low, LR too high)."""
    window: int = 200
    """Steps over which growth is measured (module docstring: shorter spans count too)."""
    max_growth: float = 1.5
    """Warn when the norm grew by more than this factor within ``window`` steps."""

    def validate_fields(self, prefix: str) -> None:
        check(self.window >= 1, f"{prefix}.window", "must be >= 1", self.window)
        check(self.max_growth > 1, f"{prefix}.max_growth", "must be > 1", self.max_growth)


class ParamGrowthDetector(Detector):
    """Compares the current norm with the lowest sample since the newest one at least ``window`` steps old
    (every sample so far while none is that old)."""

    name = "param_growth"
    needs = "param_norm"

    def __init__(self, config: ParamGrowthConfig) -> None:
        super().__init__(config)
        self.samples: deque[tuple[int, float]] = deque()
        # The candidates for "lowest since step t", for any t: the samples no later sample is lower than,
        # oldest first, their norms rising (a sliding-window minimum), so judging costs the same at any
        # window size or measuring cadence.
        self.lows: deque[tuple[int, float]] = deque()
        self.quiet_until = -1

    def _reference(self, step: int) -> tuple[int, float] | None:
        """The newest sample at least ``window`` steps old. ``update`` keeps only the one that was the
        reference and the newer ones, so this scans just the samples that aged past the window since."""
        limit = step - self.config.window
        samples = self.samples
        if not samples or samples[0][0] > limit:
            return None
        j = 0
        while j + 1 < len(samples) and samples[j + 1][0] <= limit:
            j += 1
        return samples[j]

    def _lowest(self, step: int) -> tuple[int, float] | None:
        """The lowest-norm sample (the oldest of equals) from the window's reference (``_reference``) on, or
        of every sample while none is ``window`` steps old: the first of ``lows`` from there on (the few
        before it aged past the window since the last ``update`` and are skipped, not removed)."""
        if not self.samples:
            return None
        ref = self._reference(step)
        start = -math.inf if ref is None else ref[0]
        return next(x for x in self.lows if x[0] >= start)  # the newest sample is always in lows

    def observe(self, s: StepStats) -> Finding | None:
        if s.param_norm is None or not math.isfinite(s.param_norm) or s.step < self.quiet_until:
            return None
        ref = self._lowest(s.step)
        if ref is None or ref[1] <= 0:
            return None
        growth = s.param_norm / ref[1]
        if growth <= self.config.max_growth:
            return None
        return self.finding(
            f"parameter norm grew x{growth:.2f} in {s.step - ref[0]} steps ({ref[1]:.4g} -> {s.param_norm:.4g})",
            {"param_norm": s.param_norm, "reference": ref[1], "growth": growth},
        )


    def update(self, s: StepStats) -> None:
        if s.findings and any(f.detector == self.name for f in s.findings):
            self.quiet_until = s.step + self.config.window
        if s.param_norm is None or not math.isfinite(s.param_norm):
            return
        self._push((s.step, s.param_norm))
        ref = self._reference(s.step)
        while self.samples and ref is not None and self.samples[0][0] < ref[0]:
            self.samples.popleft()  # keep the newest sample older than the window, drop the rest
        while self.lows and ref is not None and self.lows[0][0] < ref[0]:
            self.lows.popleft()

    def _push(self, sample: tuple[int, float]) -> None:
        self.samples.append(sample)
        while self.lows and self.lows[-1][1] > sample[1]:  # never the lowest again; equals keep the older
            self.lows.pop()
        self.lows.append(sample)

    def state_dict(self) -> dict:
        return {"samples": [list(x) for x in self.samples], "quiet_until": self.quiet_until}

    def load_state_dict(self, d: dict) -> None:
        self.samples, self.lows = deque(), deque()
        for a, b in d["samples"]:
            self._push((int(a), float(b)))
        self.quiet_until = int(d["quiet_until"])
