"""A loss spike against its EMA -> WARN by default.

A diffusion loss depends on the timesteps drawn for the batch: under an epsilon loss a sample at t < 100 has
several times the loss of one at t ~ 500. With a few samples per step, some batches draw only small
timesteps (a batch of two: about 1 step in 100), and their loss is 5-8x the EMA on a healthy run
(CHANGELOG.md, "Small-batch UNet on the tuning split"). So when the step carries the loss per
timestep bucket (``StepStats.timestep_bucket_loss``), the detector judges the loss *the batch would have had
at the usual mix of timesteps*: ``loss x E[all buckets] / E[this batch's buckets]``, with ``E[b]`` an EMA of
bucket ``b``'s loss. A fault (an LR, a data or a numerics change) raises the loss at every timestep, so
it still shows in full; the timestep draw no longer does. Without buckets (or before every bucket of the
batch has ``min_bucket_samples`` values) the raw loss is judged, as before.
"""

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

    min_bucket_samples: int = 5
    """Values a timestep bucket's EMA needs before it adjusts the judged loss (module docstring)."""

    def validate_fields(self, prefix: str) -> None:
        check(self.min_bucket_samples >= 1, f"{prefix}.min_bucket_samples", "must be >= 1", self.min_bucket_samples)
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(self.zscore > 0, f"{prefix}.zscore", "must be > 0", self.zscore)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_steps >= 1, f"{prefix}.warmup_steps", "must be >= 1", self.warmup_steps)
        check(self.min_std_fraction >= 0, f"{prefix}.min_std_fraction", "must be >= 0", self.min_std_fraction)


class LossSpikeDetector(Detector):
    """Ratio OR z-score test after warm-up on the timestep-adjusted loss; flagged steps are not absorbed."""

    name = "loss_spike"
    per_bucket = True

    def __init__(self, config: LossSpikeConfig) -> None:
        super().__init__(config)
        self.ema = EMAStat(beta=config.beta)
        self.buckets: list[EMAStat] = []  # per timestep bucket: EMA of its mean loss
        self._flagged_step: int | None = None

    def _batch_buckets(self, s: StepStats) -> list[tuple[int, float]]:
        return [(b, v) for b, v in enumerate(s.timestep_bucket_loss) if v is not None and math.isfinite(v)]

    def timestep_factor(self, s: StepStats, mine: list[tuple[int, float]] | None = None) -> float:
        """``E[all buckets] / E[this batch's buckets]`` (1.0 when the buckets cannot tell: module docstring);
        ``mine``: ``_batch_buckets(s)`` when the caller has it already."""
        if mine is None:
            mine = self._batch_buckets(s)
        if not mine or len(self.buckets) != len(s.timestep_bucket_loss):
            return 1.0
        warm = [e.mean for e in self.buckets if e.count >= self.config.min_bucket_samples and e.mean > 0]
        if any(self.buckets[b].count < self.config.min_bucket_samples or self.buckets[b].mean <= 0 for b, _ in mine):
            return 1.0
        batch = sum(self.buckets[b].mean for b, _ in mine) / len(mine)
        return (sum(warm) / len(warm)) / batch

    def observe(self, s: StepStats) -> Finding | None:
        raw = s.loss
        if not math.isfinite(raw) or self.ema.count < self.config.warmup_steps:
            return None
        factor = self.timestep_factor(s)
        x = raw * factor
        ratio, z = self.ema.ratio(x), self.ema.zscore(x, self.config.min_std_fraction)
        if ratio < self.config.ratio and z < self.config.zscore:
            return None
        self._flagged_step = s.step
        finite = [(v, r) for r, v in enumerate(s.rank_loss) if math.isfinite(v)]
        ranks = [max(finite)[1]] if finite else []
        adjusted = "" if factor == 1.0 else f" at the usual timestep mix ({raw:.4g} at this batch's timesteps)"
        return self.finding(
            f"loss {x:.4g}{adjusted} is {ratio:.1f}x its EMA {self.ema.mean:.4g} (z={z:.1f})",
            {"loss": raw, "judged": x, "ema": self.ema.mean, "ratio": ratio, "zscore": z},
            ranks,
        )

    def update(self, s: StepStats) -> None:
        if not (s.applied and math.isfinite(s.loss)):
            return
        mine = self._batch_buckets(s)
        if self._flagged_step != s.step:
            x = s.loss * self.timestep_factor(s, mine)
            self.ema.add(x)
        # Every applied step teaches the buckets, flagged ones too: otherwise a bucket whose batches are flagged
        # while it is still unknown (the rare t < 100) would never become known. A fault that raises the loss
        # at every timestep leaves the buckets' ratios, hence the adjustment, as they were.
        if len(self.buckets) != len(s.timestep_bucket_loss):
            self.buckets = [EMAStat(beta=self.config.beta) for _ in s.timestep_bucket_loss]
        for b, v in mine:
            self.buckets[b].add(v)


    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "buckets": [e.state_dict() for e in self.buckets]}

    def load_state_dict(self, d: dict) -> None:
        self.ema.load_state_dict(d["ema"])
        self.buckets = []
        for b in d.get("buckets", []):
            e = EMAStat(beta=self.config.beta)
            e.load_state_dict(b)
            self.buckets.append(e)
