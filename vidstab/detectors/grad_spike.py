"""A sudden gradient-norm spike against its EMA -> SKIP by default."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, EMAStat, Finding, StepStats, check, exp_or_inf


@dataclass
class GradSpikeConfig(DetectorConfig):
    """Configuration of the ``grad_spike`` detector."""

    action: str = "skip"
    """``warn | skip | rollback``. Skip: a 10x gradient is almost always one bad batch, and clipping
    alone would still move the weights a full clipped step in that batch's direction."""
    ratio: float = 10.0
    """Flag when ``norm / EMA(norm) >= ratio``. 10 is the rule of thumb in the field (an order of
    magnitude above normal is trouble even before NaN appears)."""
    zscore: float = 6.0
    """Flag when the z-score of ``log(norm)`` against the EMA mean/std of ``log(norm)`` is ``>= zscore``.
    In log space because gradient norms are positive with multiplicative, heavy-tailed noise: an epsilon
    UNet's norm reaches 3.5-5x its mean on healthy batches of small timesteps, which a linear
    z-test with a std floored at 25% of the mean calls a 6-sigma spike."""
    beta: float = 0.98
    """EMA decay per applied step (0.98: a memory of about 50 steps, slow enough to trust)."""
    warmup_steps: int = 20
    """Applied steps absorbed before the z-score test judges (a variance needs more samples than a mean)."""
    ratio_warmup_steps: int = 5
    """Applied steps absorbed before the ratio test judges: a 10x jump over the mean of even a handful of
    steps is already far outside normal, and short runs deserve protection too."""
    min_log_std: float = 0.2
    """Floor of the EMA std of ``log(norm)``, so that an unusually quiet phase does not turn a harmless
    wiggle into a 6-sigma event: with 0.2 the z-test needs at least ``exp(6 * 0.2) = 3.3x`` the geometric
    mean. Chosen on the tuning split (benchmarks/RESULTS.md): healthy DiT runs reach log-z 5 with a log std
    of 0.15, and the linear test's old floor (2.5x the mean) had already flagged 2.2-2.6x healthy norms."""

    def validate_fields(self, prefix: str) -> None:
        check(self.ratio > 1, f"{prefix}.ratio", "must be > 1", self.ratio)
        check(self.zscore > 0, f"{prefix}.zscore", "must be > 0", self.zscore)
        check(0 < self.beta < 1, f"{prefix}.beta", "must be in (0, 1)", self.beta)
        check(self.warmup_steps >= 1, f"{prefix}.warmup_steps", "must be >= 1", self.warmup_steps)
        check(self.ratio_warmup_steps >= 1, f"{prefix}.ratio_warmup_steps", "must be >= 1", self.ratio_warmup_steps)
        check(self.min_log_std >= 0, f"{prefix}.min_log_std", "must be >= 0", self.min_log_std)


class GradSpikeDetector(Detector):
    """Ratio OR z-score test after warm-up; flagged steps are never absorbed into the EMA."""

    name = "grad_spike"
    per_bucket = True

    def __init__(self, config: GradSpikeConfig) -> None:
        super().__init__(config)
        self.ema = EMAStat(beta=config.beta)
        self.log_ema = EMAStat(beta=config.beta)  # of log(norm): the z-test's statistics
        self.early: list[float] = []  # norms absorbed during the warm-up (median reference)
        self._flagged_step: int | None = None

    def reference(self) -> float:
        """The ratio test's reference: the median of the absorbed norms during the warm-up (robust to the
        large first norms of a fresh model), the EMA mean after it."""
        if self.ema.count < self.config.warmup_steps and self.early:
            xs = sorted(self.early)
            n = len(xs)
            return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
        return self.ema.mean

    def observe(self, s: StepStats) -> Finding | None:
        x = s.grad_norm
        n = self.ema.count
        if not math.isfinite(x) or n < min(self.config.warmup_steps, self.config.ratio_warmup_steps):
            return None  # non-finite norms are the nonfinite detector's business
        ref = self.reference()
        ratio = x / ref if ref > 0 else math.inf
        z = self.log_z(x)
        by_ratio = n >= self.config.ratio_warmup_steps and ratio >= self.config.ratio
        by_z = n >= self.config.warmup_steps and z >= self.config.zscore
        if not (by_ratio or by_z):
            return None
        self._flagged_step = s.step
        suspects = _suspect_ranks(s)
        return self.finding(
            f"gradient norm {x:.4g} is {ratio:.1f}x its {'EMA' if ref == self.ema.mean else 'warm-up median'} "
            f"{ref:.4g} (z={z:.1f})",
            {"grad_norm": x, "ema": self.ema.mean, "reference": ref, "ratio": ratio, "zscore": z},
            suspects,
        )

    def _log_std(self) -> float:
        return max(math.sqrt(max(self.log_ema.var, 0.0)), self.config.min_log_std, 1e-12)

    def log_z(self, x: float) -> float:
        """z-score of ``log(x)`` against the EMA of log norms (std floored at ``min_log_std``)."""
        return (math.log(x) - self.log_ema.mean) / self._log_std() if x > 0 else -math.inf

    def update(self, s: StepStats) -> None:
        if s.applied and self._flagged_step != s.step and math.isfinite(s.grad_norm) and s.grad_norm > 0:
            y = math.log(s.grad_norm)
            self.log_ema.add(y)
            if self.ema.count < self.config.warmup_steps:
                self.early.append(s.grad_norm)
            elif self.early:
                self.early = []
            self.ema.add(s.grad_norm)


    def _line(self) -> tuple[float, float]:
        """``(reference, the lowest norm the next step would be flagged at)`` once a test judges."""
        n, c = self.ema.count, self.config
        ref, line = self.reference(), math.inf
        if n >= c.ratio_warmup_steps:
            line = ref * c.ratio
        if n >= c.warmup_steps:
            line = min(line, exp_or_inf(self.log_ema.mean + c.zscore * self._log_std()))
        return ref, line

    def published(self) -> dict[str, float]:
        """The reference and the lowest norm the next step would be flagged at (the dashboard's red line)."""
        if self.ema.count < min(self.config.warmup_steps, self.config.ratio_warmup_steps):
            return {}
        ref, line = self._line()
        return {"grad_norm_ema": ref, "grad_spike_threshold": line}

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "log_ema": self.log_ema.state_dict(), "early": list(self.early)}

    def load_state_dict(self, d: dict) -> None:
        self.ema.load_state_dict(d["ema"])
        if "log_ema" in d:
            self.log_ema.load_state_dict(d["log_ema"])
        self.early = [float(x) for x in d.get("early", [])]


def _suspect_ranks(s: StepStats) -> list[int]:
    """Under DDP the norm is global, so the culprit is a guess: the rank with the highest loss and the
    rank with the largest input (usually the same)."""
    out: set[int] = set()
    finite = [(v, r) for r, v in enumerate(s.rank_loss) if math.isfinite(v)]
    if finite:
        out.add(max(finite)[1])
    if s.rank_input_absmax:
        out.add(max((v, r) for r, v in enumerate(s.rank_input_absmax))[1])
    return sorted(out) or list(range(s.world_size))
