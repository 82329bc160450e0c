"""The scale of the inputs moved away from a fixed reference -> WARN, then SKIP.

``input_range`` compares one step's absmax with its own moving average: it catches a single x10^4 sample,
but an average follows a slow drift (latents growing 1% per step) and a constant x5.5 (a dropped VAE
scaling factor) is below its 10x. This detector judges the RMS of the step's inputs
(``GuardConfig.input_keys``, over ranks) against a reference that does not move:

* ``reference_rms`` when the user gives one, e.g. from the latent cache:
  ``scale_reference(latents).rms`` (the same function ``vidstab audit`` can report for a cache), which
  also catches a fault present from the very first step;
* otherwise the median RMS of the first ``reference_steps`` applied steps, frozen from then on.

The judged value is the median RMS of the last ``smooth_steps`` steps, so one unusual batch is not a
trend, while a persistent change shows within ``smooth_steps // 2 + 1`` steps; a step whose own RMS is
``instant_ratio`` away (x4: no healthy batch of a latent pipeline is) is acted on at once.

How many steps the median needs depends on how much one batch's RMS varies, and that grows as the batch
shrinks (samples differ in scale: the log-RMS of a batch of two varies ~0.2 per step, of four ~0.15, of a
video clip batch ~0.03). So the window is sized from the dispersion measured over the same first
``reference_steps`` steps: the smallest window of at least ``smooth_steps`` steps whose median crosses
``warn_ratio`` on healthy data with probability at most ``false_warn_rate`` per step (log-normal batch RMS,
its std measured as the sample std of log RMS: an odd batch among the first steps only lengthens the window;
the margin less the reference's own standard error), at most ``max_smooth_steps``. With batches of four and
more this is ``smooth_steps`` itself; with batches of two, 7-9 steps (benchmarks/RESULTS.md, "Small-batch
UNet on the tuning split").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

import torch

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check
from .windows import SortedWindow


@dataclass(frozen=True)
class ScaleReference:
    """Scale statistics of a set of input tensors (finite values only)."""

    rms: float
    """Root mean square over every finite value."""
    mean: float
    """Mean over every finite value."""
    std: float
    """Standard deviation over every finite value."""
    absmax: float
    """Largest finite absolute value."""
    count: int
    """Number of finite values."""

    def ratio(self, rms: float) -> float:
        """``rms / reference``, folded to >= 1 (x2 and x0.5 are equally far from the reference)."""
        if not (self.rms > 0 and rms > 0):
            return math.inf
        r = rms / self.rms
        return max(r, 1.0 / r)


def scale_reference(tensors: Iterable[torch.Tensor]) -> ScaleReference:
    """The :class:`ScaleReference` of ``tensors`` (e.g. every latent of a latent cache).

    Shared by the runtime detector (pass ``.rms`` as ``input_scale.reference_rms``) and offline checks of
    a data set, so both judge the same number computed the same way.
    """
    total = sq = 0.0
    count, absmax = 0, 0.0
    for t in tensors:
        x = t.detach().double().reshape(-1)
        x = x[torch.isfinite(x)]
        if x.numel() == 0:
            continue
        total += float(x.sum())
        sq += float(x.square().sum())
        count += x.numel()
        absmax = max(absmax, float(x.abs().max()))
    if count == 0:
        return ScaleReference(math.nan, math.nan, math.nan, 0.0, 0)
    mean = total / count
    return ScaleReference(math.sqrt(sq / count), mean, math.sqrt(max(sq / count - mean * mean, 0.0)), absmax, count)


@dataclass
class InputScaleConfig(DetectorConfig):
    """Configuration of the ``input_scale`` detector."""

    action: str = "skip"
    """``warn | skip | rollback``. Skip: a model trained on inputs at the wrong scale learns the wrong
    thing; skipping keeps those batches out of the weights, and if the fault persists ``consecutive_skips``
    rolls back and the abort message names the data, the first thing to check."""
    reference_rms: float | None = None
    """RMS the inputs should have (e.g. ``scale_reference(latent_cache).rms``); ``None``: learn it from the
    first ``reference_steps`` applied steps."""
    reference_steps: int = 20
    """Applied steps whose median RMS becomes the reference when ``reference_rms`` is not given."""
    smooth_steps: int = 5
    """The judged RMS is the median of this many most recent steps (this one included)."""
    warn_ratio: float = 1.5
    """Warn when the judged RMS is this many times above or below the reference."""
    act_ratio: float = 2.0
    """Act (``action``) when it is this many times above or below the reference."""
    instant_ratio: float = 4.0
    """Act on a single step whose own RMS is this many times above or below the reference (no smoothing
    delay for a rescale as large as a dropped VAE scaling factor, x5.5)."""
    quiet_steps: int = 50
    """After a warning, no new warning for this many steps (actions are never silenced)."""
    false_warn_rate: float = 1e-5
    """Probability per healthy step that the median crosses ``warn_ratio``, which sizes the median's window
    from the measured dispersion (module docstring). 1e-5 is 0.01 per 1,000 steps: a thirtieth of the
    benchmark's whole alarm budget (0.3 / 1k for all detectors together). 0: always ``smooth_steps``."""
    max_smooth_steps: int = 25
    """The window never grows beyond this many steps (a persistent change shows within half of it)."""

    def validate_fields(self, prefix: str) -> None:
        check(0 <= self.false_warn_rate < 1, f"{prefix}.false_warn_rate", "must be in [0, 1)", self.false_warn_rate)
        check(self.max_smooth_steps >= self.smooth_steps, f"{prefix}.max_smooth_steps",
              f"must be >= smooth_steps={self.smooth_steps}", self.max_smooth_steps)
        check(self.reference_rms is None or self.reference_rms > 0, f"{prefix}.reference_rms", "must be > 0 or null",
              self.reference_rms)
        check(self.reference_steps >= 1, f"{prefix}.reference_steps", "must be >= 1", self.reference_steps)
        check(self.smooth_steps >= 1, f"{prefix}.smooth_steps", "must be >= 1", self.smooth_steps)
        check(self.warn_ratio > 1, f"{prefix}.warn_ratio", "must be > 1", self.warn_ratio)
        check(self.act_ratio >= self.warn_ratio, f"{prefix}.act_ratio", f"must be >= warn_ratio={self.warn_ratio}",
              self.act_ratio)
        check(self.instant_ratio >= self.act_ratio, f"{prefix}.instant_ratio", f"must be >= act_ratio={self.act_ratio}",
              self.instant_ratio)
        check(self.quiet_steps >= 0, f"{prefix}.quiet_steps", "must be >= 0", self.quiet_steps)


class InputScaleDetector(Detector):
    """Median RMS of the recent steps against a frozen (or user-given) reference RMS."""

    name = "input_scale"
    needs = "input_rms"
    update_needs = "input_rms"

    def __init__(self, config: InputScaleConfig) -> None:
        super().__init__(config)
        self.early: list[float] = []
        self.reference: float | None = config.reference_rms
        self.smooth = config.smooth_steps  # the median's window, sized once the dispersion is measured
        self.recent = SortedWindow(self.smooth)  # RMS of the last steps, skipped ones included
        self.quiet_until = -1
        self._warned_step: int | None = None
        self._measured = False  # whether the window was sized (after ``reference_steps`` applied steps)

    def observe(self, s: StepStats) -> Finding | None:
        x = s.input_rms
        ref = self.reference
        if x is None or not math.isfinite(x) or x <= 0 or ref is None:
            return None
        if max(x / ref, ref / x) >= self.config.instant_ratio:
            judged, n = x, 1  # too far to wait for the median
        else:  # a majority of the recent steps must be off, even early on
            judged, n = self.recent.median_low_pushed(x), self.recent.pushed_len()
        ratio = judged / ref
        far = max(ratio, 1.0 / ratio)
        act = far >= self.config.act_ratio
        if not act and not (far >= self.config.warn_ratio and s.step >= self.quiet_until):
            return None
        figures = {"input_rms": x, "judged_rms": judged, "reference_rms": ref, "ratio": ratio}
        source = "given" if self.config.reference_rms is not None else f"first {self.config.reference_steps} steps"
        msg = (f"input RMS {judged:.4g} ({'this step' if n == 1 else f'median of the last {n} steps'}) is x{ratio:.3g} the reference "
               f"{ref:.4g} ({source}): check the data pipeline / VAE scaling factor")
        if act:
            return self.finding(msg, figures)
        self._warned_step = s.step
        return Finding(self.name, min(self.verdict, Verdict.WARN), msg, figures)

    def update(self, s: StepStats) -> None:
        if self._warned_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps
        x = s.input_rms
        if x is None or not math.isfinite(x) or x <= 0:
            return
        self.recent.push(x)  # every step: a skipped batch is still what the data pipeline produces
        if not self._measured and s.applied:
            self.early.append(x)
            if len(self.early) >= self.config.reference_steps:
                if self.reference is None:
                    self.reference = statistics.median(self.early)
                self.smooth = smooth_window(self.early, self.config)
                self.recent = SortedWindow(self.smooth, self.recent.values)
                self._measured = True
                self.early = []

    def state_dict(self) -> dict:
        return {"early": list(self.early), "reference": self.reference, "recent": list(self.recent.values),
                "quiet_until": self.quiet_until, "smooth_steps": self.smooth if self._measured else None}

    def load_state_dict(self, d: dict) -> None:
        self.early = [float(x) for x in d.get("early", [])]
        ref = d.get("reference")
        self.reference = float(ref) if ref is not None else self.config.reference_rms
        smooth = d.get("smooth_steps")
        # A state saved before the window was sized: measured already if its reference was learnt.
        self._measured = smooth is not None or (ref is not None and self.config.reference_rms is None)
        self.smooth = int(smooth) if smooth is not None else self.config.smooth_steps
        self.recent = SortedWindow(self.smooth, (float(x) for x in d.get("recent", [])))
        self.quiet_until = int(d.get("quiet_until", -1))


def smooth_window(early: list[float], config: InputScaleConfig) -> int:
    """The median's window for batch RMS values like ``early`` (module docstring): the smallest
    ``k >= smooth_steps`` with P(median of k healthy steps beyond ``warn_ratio``) <= ``false_warn_rate``."""
    logs = [math.log(x) for x in early if x > 0 and math.isfinite(x)]
    if config.false_warn_rate <= 0 or len(logs) < 3:
        return config.smooth_steps
    std = statistics.stdev(logs)
    if std <= 0:
        return config.smooth_steps
    # One step beyond the bound on one side; the judged median_low of k is beyond it when k - (k-1)//2 of the
    # k steps are above, or (k-1)//2 + 1 are below.
    # The reference is itself the median of these len(logs) steps: its standard error (1.2533 std / sqrt(n))
    # comes off the margin, or a reference that happens to sit low would put one side's bound within reach.
    margin = math.log(config.warn_ratio) - 1.2533 * std / math.sqrt(len(logs))
    if margin <= 0:
        return config.max_smooth_steps
    p = 0.5 * math.erfc(margin / (std * math.sqrt(2.0)))
    for k in range(config.smooth_steps, config.max_smooth_steps + 1):
        lo = (k - 1) // 2
        if _tail(k, p, k - lo) + _tail(k, p, lo + 1) <= config.false_warn_rate:
            return k
    return config.max_smooth_steps


def _tail(n: int, p: float, m: int) -> float:
    """P(Binomial(n, p) >= m)."""
    return sum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(m, n + 1))
