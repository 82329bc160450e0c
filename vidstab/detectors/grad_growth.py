"""Sustained exponential growth of the gradient norm -> WARN before it blows up."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .base import (PROMISE_UPDATES, Bounds, Detector, DetectorConfig, EMAStat, Finding, StepStats, above, below,
                   check, ema_weight, exp_or_inf)
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
    rate rise (benchmarks/RESULTS.md, "Small-batch UNet on the tuning split"). 0: off."""

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

    def promise(self) -> tuple[Bounds | None, int]:
        """Quiet before the window is judged (the counts grow by one per update at most) and while too few
        rises remain possible (one more per update at most): both steady. Then, for up to ``PROMISE_UPDATES``
        updates, on norms inside a band around the window's mean log norm narrow enough that no window of
        known and in-band values fits the slope a warning needs (:meth:`_band`: steady); where no useful band
        exists, for one update, below the norm whose log would fit a slope of exactly the growth a warning
        needs (the fitted slope rises with the newest value: its coefficient in the least-squares sum is
        ``(n - 1) / 2 > 0``)."""
        c, w = self.config, self.logs
        if self.seen < c.warmup_steps or len(w) < c.window:
            self.promise_steady = True
            return (), max(c.warmup_steps - self.seen, c.window - len(w))
        v, n, sy, siy, rises = w.values, len(w), w.sum_y, w.sum_iy, w.rises
        if n == w.size:  # as SlopeWindow.pushed: the oldest leaves, every index moves down by one
            sy -= v[0]
            siy -= sy
            if n > 1:
                rises -= v[1] > v[0]
            n -= 1
        few = c.min_rises - rises - 1  # updates that cannot bring enough rises (when positive)
        band = self._band() if few < PROMISE_UPDATES else None
        if band is not None and band[1] > few:
            self.promise_steady = True
            return band
        if few > 0:  # even a rise on this step leaves too few
            self.promise_steady = True
            return (), few
        m = n + 1  # values in the judged window
        need = self.min_log_growth() / c.window * (m * (m * m - 1) / 12)  # the slope's numerator a warning needs
        y = (need - siy + (m - 1) / 2 * sy) / (n - (m - 1) / 2)  # log norm at which the numerator reaches it
        if rises < c.min_rises:  # the warning needs this step to rise as well
            y = max(y, v[-1])
        return (("grad_norm", -math.inf, below(exp_or_inf(y - 1e-9 * (1.0 + abs(y))))),), 1

    def _band(self) -> "tuple[Bounds, int] | None":
        """``(bounds, k)``: log norms in ``[mean - h, mean + h]`` (``mean`` of the window's log norms) keep the
        fitted growth below the warning's bar on each of the next ``k >= 2`` steps, whatever the in-band values
        absorbed before them; ``None`` when no band of at least 2.5 noise standard deviations covers 2 steps.

        The judged window of the step after ``j`` more updates holds the newest known values and ``j + 1``
        unknown ones; the slope's numerator ``sum (i - (n - 1) / 2) y_i`` is largest with each unknown at the
        band's end its coefficient's sign picks. The bar is taken as low as ``j`` updates can bring it: the
        EMA of the changes' variance keeps at least ``1 - a`` of itself per update. A small slack covers the
        rounding of the window's running sums."""
        c, w = self.config, self.logs
        known, n = list(w.values), w.size  # len(known) >= window = n - 1: every judged window holds n values
        centre = math.fsum(known) / len(known)
        var = max(self.changes.var, 0.0)
        keep = 1.0 - ema_weight(self.changes)
        floor = max(2.5 * math.sqrt(var / 2.0), 0.05)  # a narrower band would break on healthy noise
        log_min = math.log(c.min_growth)
        mid, cs, a, scale = _coefficients(n)
        noise = c.noise_z * c.window * math.sqrt(var / 2.0) * scale  # the bar's noise term (min_log_growth)
        per_bar = n * (n * n - 1) / 12 / c.window  # the slope's numerator per unit of growth over the window
        kept = known[len(known) - (n - 1):]  # the newest n - 1 known values: those the next judged window holds
        s1 = math.fsum(kept)
        s2 = math.fsum(i * y for i, y in enumerate(kept))
        h, k, decay = math.inf, 0, 1.0
        for u in range(1, PROMISE_UPDATES + 1):  # u - 1 updates before the judged step, u values unknown in it
            if u > 1 and kept:  # the oldest known value leaves the judged window, the others move down
                s1 -= kept[u - 2] if u - 2 < len(kept) else 0.0
                s2 -= s1
            ks = s2 - mid * s1 if u < n else 0.0
            bar = max(log_min, noise * math.sqrt(decay)) * (1.0 - 1e-9)
            need = bar * per_bar
            j = min(u, n)
            slack = 1e-7 * (abs(need) + abs(ks) + abs(centre * cs[j]) + a[j] * abs(centre) + 1.0)
            h_u = (need - ks - centre * cs[j] - slack) / a[j]
            if min(h, h_u) < floor:
                break
            h, k = min(h, h_u), u
            decay *= keep
        if k < 2:
            return None
        lo, hi = centre - h, centre + h
        return ((("grad_norm", above(exp_or_inf(lo + 1e-9 * (1.0 + abs(lo)))),
                  below(exp_or_inf(hi - 1e-9 * (1.0 + abs(hi))))),), k)

    def update(self, s: StepStats) -> None:
        if s.findings and any(f.detector == self.name for f in s.findings):
            self.logs.clear()  # warn once per window: the next warning needs a fresh window
            self.break_promise()
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
        self.break_promise()


@functools.lru_cache(maxsize=64)
def _coefficients(n: int) -> tuple[float, list[float], list[float], float]:
    """For judged windows of ``n`` log norms: ``(n - 1) / 2``; by the number ``u`` of unknown (newest) values,
    the sum and the sum of absolute values of their least-squares coefficients ``i - (n - 1) / 2``; and
    ``sqrt(12 / (n (n^2 - 1)))``, the fitted growth's standard deviation per unit of noise and window
    (:meth:`GradGrowthDetector.min_log_growth`)."""
    mid = (n - 1) / 2
    cs = [sum(i - mid for i in range(n - u, n)) for u in range(n + 1)]
    a = [sum(abs(i - mid) for i in range(n - u, n)) for u in range(n + 1)]
    return mid, cs, a, math.sqrt(12.0 / (n * (n * n - 1)))
