"""The detector protocol: host-side judges of one optimizer step.

Every rank builds the same :class:`StepStats` from the same reduced summary (one host read per
optimizer step), runs the same detectors in the same order, and therefore reaches the same verdict:
no rank-local ``if`` ever decides whether to step.

A detector has two phases per step:

* :meth:`Detector.observe` judges the step and returns a :class:`Finding` or ``None``. It must not
  change the detector's running statistics (another detector may still skip the step).
* :meth:`Detector.update` is called once the final verdict is known (``stats.verdict``,
  ``stats.applied``). Statistics absorb only applied steps, so a skipped outlier never poisons an EMA.

Detectors that reason about the verdict itself (consecutive skips, repeated spikes) run last and read
``stats.verdict`` / ``stats.findings``: the verdict reached by the detectors before them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A configuration value is unknown or out of range; the message names the field."""


def check(cond: bool, name: str, requirement: str, value: Any) -> None:
    """Raise :class:`ConfigError` ``"<name> <requirement>, got <value>"`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{name} {requirement}, got {value!r}")


def exp_or_inf(v: float) -> float:
    """``math.exp`` that is ``inf`` instead of raising on overflow."""
    return math.exp(v) if v < 709.0 else math.inf


def lr_ratios(lr: float | None, peak: float | None, scheduled: float | None) -> tuple[float, float]:
    """``(lr / peak, lr / scheduled)``, each 0.0 where the reference is unknown or not positive, both 0.0 for
    an LR that is unknown, not finite or not positive (``lr_bound`` judges nothing then). """
    if lr is None or not math.isfinite(lr) or lr <= 0:
        return 0.0, 0.0
    return (lr / peak if peak is not None and peak > 0 else 0.0,
            lr / scheduled if scheduled is not None and scheduled > 0 else 0.0)


class Verdict(enum.IntEnum):
    """What the guard does with an optimizer step; the worst finding wins."""

    OK = 0
    WARN = 1
    SKIP = 2
    ROLLBACK = 3

    @classmethod
    def from_action(cls, action: str) -> "Verdict":
        """Map a config action (``"warn" | "skip" | "rollback"``) to a verdict."""
        return {"warn": cls.WARN, "skip": cls.SKIP, "rollback": cls.ROLLBACK}[action]


ACTIONS = ("warn", "skip", "rollback")


@dataclass
class DetectorConfig:
    """What every detector's configuration holds: on/off, the action of its findings, validation.

    A detector's own config subclasses it, adds its fields (each with a docstring) and checks them in
    :meth:`validate_fields`; YAML/dict loading (``GuardConfig.from_dict``) is the same for all of them,
    registered user detectors included (:func:`vidstab.register_detector`).
    """

    enabled: bool = True
    """Run this detector."""
    action: str = "warn"
    """``warn | skip | rollback``: the verdict of this detector's findings."""

    def validate(self, prefix: str = "detector") -> None:
        """Raise :class:`ConfigError` naming the first bad field as ``<prefix>.<field>``."""
        check(isinstance(self.enabled, bool), f"{prefix}.enabled", "must be true or false", self.enabled)
        check(self.action in ACTIONS, f"{prefix}.action", f"must be one of {ACTIONS}", self.action)
        self.validate_fields(prefix)

    def validate_fields(self, prefix: str) -> None:
        """Check this detector's own fields (default: none)."""


@dataclass
class Finding:
    """One detector's judgement of one step."""

    detector: str
    """Name of the detector, e.g. ``"grad_spike"``."""
    verdict: Verdict
    """What the detector asks for."""
    message: str
    """One human sentence with the numbers that matter."""
    figures: dict[str, float] = field(default_factory=dict)
    """The numbers behind the judgement (JSON-serialisable floats)."""
    ranks: list[int] = field(default_factory=list)
    """Ranks that caused the finding where that is known (bad data on rank 1 ...), else empty."""

    def to_dict(self) -> dict:
        """JSON form used in events and incident bundles."""
        return {
            "detector": self.detector,
            "verdict": self.verdict.name,
            "message": self.message,
            "figures": {k: _json_float(v) for k, v in self.figures.items()},
            "ranks": list(self.ranks),
        }


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@dataclass
class StepStats:
    """Host-side view of one optimizer step, identical on every rank."""

    step: int
    """Optimizer step counter (attempted steps, applied or skipped)."""
    grad_norm: float
    """Global pre-clip gradient norm (``nan`` when unavailable or non-finite)."""
    loss: float
    """Mean finite loss over ranks and micro-steps (``nan`` if none was finite)."""
    world_size: int = 1
    """Number of ranks."""
    grad_norm_known: bool = True
    """False when the backend gave no norm (DeepSpeed without an engine norm): ``grad_norm`` is nan."""
    max_grad_norm: float | None = None
    """Clipping threshold used this step (``None``: no clipping)."""
    clipped: bool = False
    """Whether clipping changed the gradients (pre-clip norm > max norm)."""
    lr: float | None = None
    """Learning rate of the first param group at this step."""
    lr_peak: float | None = None
    """Largest LR the schedule can produce for the first param group: its base LR when the guard attached
    (times the guard's ``lr_multiplier``) or the group's ``max_lr``; ``None`` when unknown."""
    lr_scheduled: float | None = None
    """LR the scheduler itself set for this step (``get_last_lr()[0]``); ``None`` without a scheduler."""
    loss_scale: float | None = None
    """GradScaler scale under fp16, else ``None``."""
    overflow: bool = False
    """fp16 GradScaler overflow: non-finite grads with finite losses and inputs everywhere."""
    param_norm: float | None = None
    """Global parameter norm (measured every ``param_norm_every`` steps), else ``None``."""
    update_ratio: float | None = None
    """||delta params|| / ||params|| of the last measured update, else ``None``."""
    nonfinite_loss_ranks: list[int] = field(default_factory=list)
    """Ranks whose loss was non-finite on some micro-step of the window."""
    nonfinite_input_ranks: list[int] = field(default_factory=list)
    """Ranks whose inputs (the floating tensors of the batch, or ``GuardConfig.input_keys``) held
    non-finite values."""
    exception_ranks: list[int] = field(default_factory=list)
    """Ranks whose caller reported an exception for a micro-step (``guard.backward(error=...)``)."""
    oom_ranks: list[int] = field(default_factory=list)
    """Ranks that ran out of memory in a micro-step's forward or backward (:mod:`vidstab.recovery.oom`)."""
    oom_micro_batch: int | None = None
    """The largest micro-batch (samples) that ran out of memory on any rank (``None``: no OOM)."""
    optimizer_oom: str | None = None
    """The previous optimizer step ran out of memory inside ``optimizer.step()`` on some rank: ``"skipped"`` (on
    every rank, before any weight or state was touched: skipped everywhere alike), ``"touched"`` (a rank had
    updated part of it) or ``"partial"`` (some ranks applied it, some did not); ``None``: no such OOM."""
    optimizer_oom_ranks: list[int] = field(default_factory=list)
    """The ranks whose previous optimizer step ran out of memory (gathered like ``oom_ranks``)."""
    rank_loss: list[float] = field(default_factory=list)
    """Per-rank mean finite loss (``nan`` for a rank without one). Per-rank figures are gathered only on a step
    the summary shows something on (a non-finite value, an exception, a finding); empty on the others."""
    rank_input_absmax: list[float] = field(default_factory=list)
    """Per-rank largest absolute input value (non-finite where that rank's inputs were); empty as ``rank_loss``."""
    rank_seconds: list[float] = field(default_factory=list)
    """Per-rank own compute time of the step in seconds, waiting for other ranks excluded (``-1``:
    unknown; on CUDA the previous step's, measured with events; ``vidstab.signals.StepClock``); empty as
    ``rank_loss``."""
    slowest_rank: int | None = None
    """The rank with the longest own compute time this step (``None`` when no rank measured one)."""
    slowest_seconds: float | None = None
    """That rank's own compute time in seconds."""
    seconds_sum: float = 0.0
    """The sum of every rank's own compute time (the others' mean: ``(seconds_sum - slowest_seconds) /
    (world_size - 1)``)."""
    first_bad_rank: int | None = None
    """The lowest rank with a non-finite loss or input or an exception this step (``None``: none)."""
    batch_fp: str | None = None
    """A fingerprint of the step's batch over every rank (the ranks' CRC-32s of their sample ids, summed; ``None``
    when the loop gives no ids): a resume is checked against it (:mod:`vidstab.run.resume_check`)."""
    bucket: str = "default"
    """The step's shape bucket (``guard.backward(..., bucket=...)``, by default the shape of the first input with
    the most dimensions); ``"mixed"`` when its ranks or micro-steps were of different buckets."""
    timestep_bucket_loss: list[float | None] = field(default_factory=list)
    """Mean loss per diffusion-timestep bucket (``None`` for empty buckets)."""
    input_absmax: float = 0.0
    """Largest finite absolute input value over ranks."""
    input_nonfinite: int = 0
    """Ranks whose inputs held a non-finite value (the exact count of values is in the incident bundle:
    the guard does not count them on healthy steps, ``vidstab.signals``)."""
    input_rms: float | None = None
    """Root mean square of the finite input values over ranks (``None`` when no input was recorded)."""

    @property
    def lr_unplaced(self) -> float | None:
        """``lr`` when the schedule's peak is unknown (``lr_peak`` is ``None``), else ``None``: an LR that no
        rule can place against the schedule (``lr_jump``'s input; with the peak known ``lr_bound`` judges)."""
        return self.lr if self.lr_peak is None else None

    @property
    def lr_to_peak(self) -> float:
        """``lr / lr_peak`` (0.0 when either is unknown or not positive): what ``lr_bound`` compares with its
        peak ratios (:func:`lr_ratios`)."""
        return lr_ratios(self.lr, self.lr_peak, self.lr_scheduled)[0]

    @property
    def lr_to_scheduled(self) -> float:
        """``lr / lr_scheduled`` (0.0 when either is unknown or not positive): :func:`lr_ratios`."""
        return lr_ratios(self.lr, self.lr_peak, self.lr_scheduled)[1]

    @property
    def update_per_lr(self) -> float | None:
        """``update_ratio`` per unit of LR (``update_ratio`` itself when the LR is unknown; ``None`` when not
        measured or the LR is not positive): ``update_ratio``'s input."""
        if self.update_ratio is None:
            return None
        if self.lr is None:
            return self.update_ratio
        return self.update_ratio / self.lr if self.lr > 0 else None

    @property
    def timestep_buckets_filled(self) -> int:
        """How many timestep buckets carry a loss this step (0: the loop passes no per-sample losses)."""
        return sum(v is not None for v in self.timestep_bucket_loss)

    # Filled in by the guard while judging (see module docstring).
    verdict: Verdict = Verdict.OK
    """Verdict reached so far (final verdict in :meth:`Detector.update`)."""
    findings: list[Finding] = field(default_factory=list)
    """Findings so far (all findings in :meth:`Detector.update`)."""
    applied: bool = False
    """Whether the optimizer step was applied (valid in :meth:`Detector.update`)."""


class Detector:
    """Base class of the detectors; see the module docstring for the two phases.

    The protocol is :meth:`observe`, :meth:`update`, :meth:`state_dict`/:meth:`load_state_dict`, and optionally
    :meth:`published`. Three class attributes say when the guard calls it: :attr:`needs`,
    :attr:`min_world_size` and :attr:`per_bucket`."""

    name: ClassVar[str] = "detector"
    needs: ClassVar[str | None] = None
    """The :class:`StepStats` field without which :meth:`observe` has nothing to judge (``None`` or an empty list
    on the steps that lack it, e.g. ``param_norm`` between measurements): :meth:`observe` is not called then.
    :meth:`update` is called on every step and checks what it absorbs itself."""
    min_world_size: ClassVar[int] = 1
    """The fewest processes a run needs for this detector to judge anything (``straggler``, which compares
    the ranks, needs 2): with fewer the guard does not build it (:func:`vidstab.detectors.running.build_detectors`)."""
    per_bucket: ClassVar[bool] = False
    """Whether its statistics depend on the step's shape bucket (resolution, frame count, batch size): the guard
    then keeps one instance per bucket (:class:`vidstab.detectors.running.PerBucket`), so a planned change of bucket is
    compared with steps of the same bucket, not taken for a spike or a drift."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.verdict = Verdict.from_action(config.action) if hasattr(config, "action") else Verdict.WARN

    def observe(self, s: StepStats) -> Finding | None:  # pragma: no cover - interface
        """Judge the step; must not change running statistics."""
        raise NotImplementedError

    def update(self, s: StepStats) -> None:
        """Absorb the step once the final verdict is known (default: nothing to absorb)."""

    def state_dict(self) -> dict:
        """JSON-serialisable state (running statistics, counters)."""
        return {}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict`."""

    def published(self) -> dict[str, float]:
        """Thresholds this detector applies to the next step, logged with the step's metrics so that the
        dashboard draws the detector's own line (e.g. ``{"grad_spike_threshold": 3.2}``); default none."""
        return {}

    def finding(self, message: str, figures: dict[str, float], ranks: list[int] | None = None) -> Finding:
        """A finding of this detector with its configured verdict."""
        return Finding(self.name, self.verdict, message, dict(figures), list(ranks or []))


@dataclass
class EMAStat:
    """Exponential moving mean and variance with a warm-up count (JSON-serialisable)."""

    beta: float = 0.98
    mean: float = 0.0
    var: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        """Absorb one finite value."""
        if not math.isfinite(x):
            return
        # Plain running mean/variance for the first 1/(1-beta) samples, then exponential: early statistics
        # are the average of what was seen, not anchored to the very first value.
        a = max(1.0 - self.beta, 1.0 / (self.count + 1))
        d = x - self.mean
        self.mean += a * d
        self.var = (1.0 - a) * (self.var + a * d * d)
        self.count += 1

    def ratio(self, x: float) -> float:
        """``x / mean`` (``inf`` when the mean is not positive)."""
        return x / self.mean if self.mean > 0 else math.inf

    def zscore(self, x: float, min_std_fraction: float) -> float:
        """``(x - mean) / std`` with std floored at ``min_std_fraction * |mean|`` (and 1e-12)."""
        std = max(math.sqrt(max(self.var, 0.0)), min_std_fraction * abs(self.mean), 1e-12)
        return (x - self.mean) / std

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict) -> None:
        self.mean, self.var, self.count = float(d["mean"]), float(d["var"]), int(d["count"])
        self.beta = float(d.get("beta", self.beta))


class EMAJumpDetector(Detector):
    """Shared logic of the "a signal jumped against its own EMA" detectors (LR, update ratio, input range).

    After ``warmup`` absorbed values, flag when ``value / EMA >= config.ratio``; the flagged value is not
    absorbed, and no new warning comes for ``config.quiet_steps`` steps while later values ARE absorbed, so
    a deliberate new level becomes the reference instead of warning forever. Subclasses say which value
    they watch (:meth:`value`), how to word it (:meth:`describe`) and whether skipped steps count.
    """

    absorb_skipped: ClassVar[bool] = True
    """Whether values of skipped steps feed the EMA (true for values that are not the step's fault)."""
    reanchor: ClassVar[bool] = False
    """Whether a flagged value becomes the new reference at once (for levels set on purpose, like an LR);
    otherwise it is not absorbed, so a one-off outlier cannot blind the detector."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.ema = EMAStat(beta=config.beta)
        self.quiet_until = -1
        self._flagged_step: int | None = None

    def value(self, s: StepStats) -> float | None:  # pragma: no cover - interface
        """The watched value of this step (``None`` when not measured)."""
        raise NotImplementedError

    @property
    def warmup(self) -> int:
        return self.config.warmup_steps

    def describe(self, s: StepStats, value: float, ratio: float) -> Finding:
        return self.finding(f"{self.name} {value:.4g} is {ratio:.1f}x its EMA {self.ema.mean:.4g}",
                            {self.name: value, "ema": self.ema.mean, "ratio": ratio})

    def observe(self, s: StepStats) -> Finding | None:
        x = self.value(s)
        if x is None or not math.isfinite(x) or x <= 0 or self.ema.count < self.warmup or s.step < self.quiet_until:
            return None
        r = self.ema.ratio(x)
        if r < self.config.ratio:
            return None
        self._flagged_step = s.step
        return self.describe(s, x, r)

    def update(self, s: StepStats) -> None:
        x = self.value(s)
        if self._flagged_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps
            if self.reanchor and x is not None and math.isfinite(x):
                self.ema.mean = x
            return
        if x is not None and x > 0 and (s.applied or self.absorb_skipped):
            self.ema.add(x)

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "quiet_until": self.quiet_until}

    def load_state_dict(self, d: dict) -> None:
        self.ema.load_state_dict(d["ema"])
        self.quiet_until = int(d.get("quiet_until", -1))
