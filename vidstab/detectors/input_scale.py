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
more this is ``smooth_steps`` itself; with batches of two, 7-9 steps (CHANGELOG.md, "Small-batch
UNet on the tuning split").

A slow drift (inputs +1% per step) needs ~41 steps to carry the median to x1.5. A second test warns about
it sooner: a two-sided CUSUM (Page, "Continuous inspection schemes", Biometrika 41, 1954: the sequential
test with the shortest worst-case delay for a persistent shift at a given false-alarm rate, Lorden 1971,
Moustakides 1986; a drift is a shift that keeps growing) on the step's log RMS standardised by the mean and std of the log RMS of the applied steps so far,
except the last ``drift_lag`` ones, from ``reference_steps`` steps on. Its baseline grows with the run and
is never an average over a window: it weighs every step since the start alike, so a drift that began
``drift_lag`` steps ago is not in it, and an older one is in it only in proportion to its share of the
run. Estimating it from the run itself is the self-starting scheme of Hawkins ("Self-starting cusum charts
for location and scale", The Statistician 36, 1987): a baseline of only 20 steps would need a far higher
bar (Jones, Champ and Rigdon, "The run length distribution of the CUSUM with estimated parameters",
J. Quality Technology 36, 2004). After a crossing the baseline starts afresh (``drift_restart``), so a
lasting new level is warned about once, not until the older steps are outweighed. The drift test only
warns; acting stays with the level test above.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
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
    drift_threshold: float = 10.0
    """Warn when the drift test's CUSUM (module docstring) of standardised log RMS exceeds this many
    standard deviations; 0: no drift test. With ``drift_allowance`` 0.75 and ``drift_lag`` 50, simulated on
    400-step runs of normal log RMS with the baseline measured as the detector does: 4.6e-6 false warnings
    per step, and +1% per step at a log-RMS std of 0.13 (batches of four images) warned 23 steps after it
    began (95%: within 30); CHANGELOG.md, "Input drift on the tuning split"."""
    drift_allowance: float = 0.75
    """The CUSUM's allowance, in standard deviations of the log RMS: each step adds its deviation less
    this, so only a shift larger than it accumulates (Page's reference value, half the shift the test is
    tuned to: here 1.5 standard deviations)."""
    drift_lag: int = 50
    """The drift test's baseline leaves out the most recent this many applied steps, so that a drift has
    that long to be warned about before it enters the baseline."""
    drift_restart: bool = True
    """After a crossing, the baseline starts afresh from the next applied steps (as Page's and Hawkins's
    schemes restart after a signal): a lasting new level, such as a new data mix, is the baseline again once
    ``reference_steps + drift_lag`` applied steps have passed, instead of being warned about until the old
    steps are outweighed (measured on synthetic batch RMS, log-RMS std 0.028, x1.05 from step 1,000: 10-11
    warnings in the next 700 steps without the restart, 1 with it). A drift that goes on is warned about
    again once the new baseline is measured; the level test judges it meanwhile."""
    drift_min_std: float = 0.01
    """Floor of the standard deviation the drift test divides by: a shift of the RMS by about this
    fraction is never a drift on its own, however steady the inputs were (e.g. a normalised latent cache)."""

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
        check(self.drift_threshold >= 0, f"{prefix}.drift_threshold", "must be >= 0 (0: no drift test)",
              self.drift_threshold)
        check(self.drift_allowance >= 0, f"{prefix}.drift_allowance", "must be >= 0", self.drift_allowance)
        check(self.drift_lag >= 0, f"{prefix}.drift_lag", "must be >= 0", self.drift_lag)
        check(self.drift_min_std > 0, f"{prefix}.drift_min_std", "must be > 0", self.drift_min_std)


class DriftCusum:
    """The drift test's state (module docstring): a two-sided CUSUM of standardised log RMS and its baseline,
    the running mean and variance (Welford) of the log RMS of the applied steps except the last ``lag``."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.pending: deque[float] = deque()  # log RMS of the last ``lag`` applied steps, not yet in the baseline
        self.restart()

    def std(self, floor: float) -> float:
        return max(math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0, floor)

    def advance(self, log_rms: float, step: int, config: "InputScaleConfig") -> tuple[float, float, int, int]:
        """(up, down, up_since, down_since) after this step's log RMS (nothing changes)."""
        z = (log_rms - self.mean) / self.std(config.drift_min_std)
        up, down = self.up + z - config.drift_allowance, self.down - z - config.drift_allowance
        up_since = (self.up_since if self.up > 0 else step) if up > 0 else -1
        down_since = (self.down_since if self.down > 0 else step) if down > 0 else -1
        return max(up, 0.0), max(down, 0.0), up_since, down_since

    def reset_sums(self) -> None:
        """Both CUSUMs back to 0 (after a crossing: Page's scheme)."""
        self.up = self.down = 0.0  # the two CUSUMs, in standard deviations
        self.up_since = self.down_since = -1  # step at which each last rose from 0 (where the shift began)

    def restart(self) -> None:
        """Both sums and the baseline start afresh (``drift_restart``)."""
        self.pending.clear()
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # Welford sums of the baseline
        self.reset_sums()

    def add_to_baseline(self, log_rms: float) -> None:
        self.pending.append(log_rms)
        while len(self.pending) > self.lag:
            v = self.pending.popleft()
            self.count += 1
            d = v - self.mean
            self.mean += d / self.count
            self.m2 += d * (v - self.mean)

    def state_dict(self) -> dict:
        return {"pending": list(self.pending), "count": self.count, "mean": self.mean, "m2": self.m2,
                "up": self.up, "down": self.down, "up_since": self.up_since, "down_since": self.down_since}

    def load_state_dict(self, d: dict) -> None:
        self.pending = deque(float(x) for x in d.get("pending", []))
        self.count, self.mean, self.m2 = int(d.get("count", 0)), float(d.get("mean", 0.0)), float(d.get("m2", 0.0))
        self.up, self.down = float(d.get("up", 0.0)), float(d.get("down", 0.0))
        self.up_since, self.down_since = int(d.get("up_since", -1)), int(d.get("down_since", -1))


MAX_DRIFTS = 64
"""Shape buckets whose drift sums ``input_scale`` keeps at once."""


class InputScaleDetector(Detector):
    """Median RMS of the recent steps against a frozen (or user-given) reference RMS, and a CUSUM drift test."""

    name = "input_scale"
    needs = "input_rms"

    def __init__(self, config: InputScaleConfig) -> None:
        super().__init__(config)
        self.early: list[float] = []
        self.reference: float | None = config.reference_rms
        self.smooth = config.smooth_steps  # the median's window, sized once the dispersion is measured
        self.recent = SortedWindow(self.smooth)  # RMS of the last steps, skipped ones included
        self.quiet_until = -1
        self._warned_step: int | None = None
        self._measured = False  # whether the window was sized (after ``reference_steps`` applied steps)
        self.drifts: dict[str, DriftCusum] = {}  # the drift test's sums, per shape bucket
        self.drift = self._drift_of("default")
        self._advanced: tuple | None = None  # (step, rms, log rms, the sums after it) computed by observe

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
            self._drift_of(s.bucket)
            return self._drift_finding(s.step, x) if s.step >= self.quiet_until else None
        figures = {"input_rms": x, "judged_rms": judged, "reference_rms": ref, "ratio": ratio}
        source = "given" if self.config.reference_rms is not None else f"first {self.config.reference_steps} steps"
        msg = (f"input RMS {judged:.4g} ({'this step' if n == 1 else f'median of the last {n} steps'}) is x{ratio:.3g} the reference "
               f"{ref:.4g} ({source}): check the data pipeline / VAE scaling factor")
        if act:
            return self.finding(msg, figures)
        self._warned_step = s.step
        return Finding(self.name, min(self.verdict, Verdict.WARN), msg, figures)


    def _drift_of(self, bucket: str) -> DriftCusum:
        """The drift test of ``bucket`` (made on first use, the least recently used dropped past MAX_DRIFTS): a
        latent's level does not depend on its shape, but a switch of resolution nudges its RMS enough for a
        CUSUM to take it for a drift, so each bucket drifts against its own baseline."""
        d = self.drifts.pop(bucket, None) or DriftCusum(self.config.drift_lag)
        while len(self.drifts) >= MAX_DRIFTS:
            self.drifts.pop(next(iter(self.drifts)))
        self.drifts[bucket] = self.drift = d
        return d

    def _drift_on(self) -> bool:
        return self.config.drift_threshold > 0 and self.drift.count >= max(2, self.config.reference_steps)

    def _drift_finding(self, step: int, x: float) -> Finding | None:
        """The drift test's WARN for this step's RMS ``x``, or None."""
        if not self._drift_on():
            return None
        d, h = self.drift, self.config.drift_threshold
        log_x = math.log(x)
        up, down, up_since, down_since = advanced = d.advance(log_x, step, self.config)
        self._advanced = (step, x, log_x, advanced)  # update() commits the same numbers
        if max(up, down) <= h:
            return None
        rising = up > h
        since = up_since if rising else down_since
        base = math.exp(d.mean)
        figures = {"input_rms": x, "baseline_rms": base, "ratio": x / base, "cusum": up if rising else down,
                   "since_step": float(since), "baseline_log_std": d.std(self.config.drift_min_std)}
        msg = (f"input RMS drifting {'up' if rising else 'down'} since about step {since}: x{x / base:.3g} the "
               f"baseline {base:.4g} (log-RMS mean of the applied steps before the last {self.config.drift_lag}), "
               f"CUSUM {figures['cusum']:.3g} std > {h:g}: check the data pipeline / VAE scaling factor")
        self._warned_step = step
        return Finding(self.name, min(self.verdict, Verdict.WARN), msg, figures)

    def update(self, s: StepStats) -> None:
        self._drift_of(s.bucket)
        if self._warned_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps
        x = s.input_rms
        if x is None or not math.isfinite(x) or x <= 0:
            return
        self.recent.push(x)  # every step: a skipped batch is still what the data pipeline produces
        memo, self._advanced = self._advanced, None
        if self.config.drift_threshold > 0:
            seen = memo is not None and memo[0] == s.step and memo[1] == x  # observe computed this step's sums
            log_x = memo[2] if seen else math.log(x)
            if self._drift_on():  # every step is judged; a crossing restarts both sums (Page's scheme)
                d = self.drift
                d.up, d.down, d.up_since, d.down_since = memo[3] if seen else d.advance(log_x, s.step, self.config)
                if max(d.up, d.down) > self.config.drift_threshold:
                    if self.config.drift_restart:
                        d.restart()  # this step's RMS (if applied) is the first of the new baseline
                    else:
                        d.reset_sums()
            if s.applied:
                self.drift.add_to_baseline(log_x)
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
                "quiet_until": self.quiet_until, "smooth_steps": self.smooth if self._measured else None,
                "drifts": {k: d.state_dict() for k, d in self.drifts.items()}}

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
        self.drifts = {}
        for bucket, state in (d.get("drifts") or {"default": d.get("drift", {})}).items():
            self._drift_of(bucket).load_state_dict(state)
        self._advanced = None  # a state saved before the drift test: it starts afresh


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
