"""Published divergence rules, reimplemented over recorded per-step signals, next to vidstab's detectors.

Each baseline is a few lines that a reader can diff against its source (cited above each class). They
all have the same shape: ``observe(StepRecord) -> bool`` (True = the rule fires on this step), fed every
step of a recording in order, and they keep whatever state their source keeps -- including its blind
spots (e.g. a running mean that a NaN poisons forever), because that is what users run today.

``VidstabReplay`` hands each recorded step, as the vector a rank packs (``vidstab.signals.Layout``), to the
guard's own statistics producer (``vidstab.guard.stats.build_stats``) and judge (observe all, then update with
the final verdict and whether the step was applied), so detection is compared on identical runs and nothing of
the guard is re-implemented.

Offline replay is valid for detection quality because every detector here is a pure function of the
per-step signals. Caveat: in a live run a detector that SKIPs or rolls back changes the trajectory after
its first alarm; the replay keeps the unguarded trajectory. The first alarm -- which is what lead time
and detection rate measure -- is unaffected; what happens after it is measured by the end-to-end runs
of ``bench_detection.py`` (``recipes/train.py`` with vidstab on vs ``--no_vidstab``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

try:  # as a module of the repo (tests) or next to the bench scripts
    from benchmarks.scenarios.recorder import StepRecord
except ImportError:  # pragma: no cover
    from scenarios.recorder import StepRecord  # type: ignore[no-redef]


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ------------------------------------------------------------------------------------------------------
# docs/PRACTICES.md A2 (article A, a practitioner's guide to gradient explosions in video diffusion):
#   ``check_gradients(model, max_norm=1e4)``: return "not finite" when the total norm is NaN/Inf, and warn
#   when ``total_norm > max_norm``.
# ------------------------------------------------------------------------------------------------------
@dataclass
class FixedThreshold:
    """Article A's fixed rule (docs/PRACTICES.md A2): non-finite grad norm, or grad norm > 1e4."""

    threshold: float = 1e4
    name: str = "fixed_1e4"

    def observe(self, r: StepRecord) -> bool:
        return not _finite(r.grad_norm) or r.grad_norm > self.threshold


# ------------------------------------------------------------------------------------------------------
# docs/PRACTICES.md A2: a norm that becomes ten times its moving average or more is a warning even before
# NaN appears, plus the same article's non-finite check. The article gives no decay; 0.95 (a ~20-step memory) is our choice. It is a
# monitor, not a skipper, so every finite norm enters the average.
# ------------------------------------------------------------------------------------------------------
@dataclass
class EMARatio:
    """Article A's dynamic rule (docs/PRACTICES.md A2): grad norm >= 10x its EMA (or non-finite)."""

    ratio: float = 10.0
    decay: float = 0.95
    name: str = "ema_10x"
    ema: float | None = None

    def observe(self, r: StepRecord) -> bool:
        g = r.grad_norm
        if not _finite(g):
            return True
        fired = self.ema is not None and g >= self.ratio * self.ema
        self.ema = g if self.ema is None else self.decay * self.ema + (1 - self.decay) * g
        return fired


# ------------------------------------------------------------------------------------------------------
# Megatron-LM, megatron/core/rerun_state_machine.py ``RerunStateMachine.is_unexpectedly_large`` as used by
# ``check_for_large_grads`` (megatron/core/distributed/param_and_grad_buffer.py ``check_grads``,
# threshold=10): the max |value| of the first 100 samples is the reference; afterwards a value
# ``>= 10 * max`` is flagged. NaN/Inf are ignored there and caught by ``check_for_nan_in_grad`` (on by
# default via --check-for-nan-in-loss-and-grad), included here. Megatron checks each bucket's local norm
# before the all-reduce; with one bucket that is the global pre-clip norm recorded here.
# ------------------------------------------------------------------------------------------------------
@dataclass
class MegatronLargeGrads:
    """Megatron-LM: grad norm >= 10x the max of the first 100 steps (+ NaN/Inf check)."""

    threshold: float = 10.0
    num_samples: int = 100
    name: str = "megatron_10x_max100"
    count: int = 0
    max_value: float = 0.0

    def observe(self, r: StepRecord) -> bool:
        if not _finite(r.grad_norm):
            return True  # check_for_nan_in_grad
        value = abs(r.grad_norm)
        if self.count < self.num_samples:
            self.count += 1
            self.max_value = max(self.max_value, value)
            return False
        return value >= self.max_value * self.threshold


# ------------------------------------------------------------------------------------------------------
# LLM Foundry, llmfoundry/callbacks/kill_loss_spike_callback.py ``KillLossSpike`` (defaults: patience=4,
# outlier_multiplier=2, window_size=100, loss_cap=10): once the window holds 100 losses, a loss
# ``>= 2 x mean(window)`` is an outlier; more than ``patience`` consecutive outliers (the 5th) fire;
# otherwise, after 2 windows of steps, half the window above ``loss_cap`` fires ("high losses"). Every
# loss, outlier or not, NaN or not, is appended to the window (as in the source, so one NaN makes the
# mean NaN for the next 100 steps).
# ------------------------------------------------------------------------------------------------------
@dataclass
class KillLossSpike:
    """LLM Foundry's KillLossSpike: loss >= 2x window mean for 5 consecutive steps (or persistent loss > 10)."""

    patience: int = 4
    outlier_multiplier: float = 2.0
    window_size: int = 100
    loss_cap: float = 10.0
    name: str = "foundry_kill_loss_spike"
    outlier_counter: int = 0
    loss_window: deque = field(default_factory=deque)

    def observe(self, r: StepRecord) -> bool:
        fired = False
        if len(self.loss_window) == self.window_size:
            running_loss_avg = sum(self.loss_window) / len(self.loss_window)  # NaN/Inf propagate as in np.mean
            spike = False
            if r.loss >= running_loss_avg * self.outlier_multiplier:  # detect_loss_spike
                self.outlier_counter += 1
                spike = self.outlier_counter > self.patience
            elif self.outlier_counter > 0:
                self.outlier_counter = 0
            # detect_high_losses (the source's elif: only when no spike fired)
            fired = spike or (r.step >= self.window_size * 2 and sum(
                1 for x in self.loss_window if x > self.loss_cap) >= self.window_size / 2)
        self.loss_window.append(r.loss)
        while len(self.loss_window) > self.window_size:
            self.loss_window.popleft()
        return fired


# ------------------------------------------------------------------------------------------------------
# OLMo-core, src/olmo_core/optim/skip_step_optimizer.py ``SkipStepOptimizer.get_step_factor``
# (rolling_interval_length=128, sigma_factor=6): keep the last 129 losses and grad norms (the current one
# last); once at least max(20, 128 // 2) losses are held, skip unless both |x - mean| / std <= 6 over the
# previous values (torch.std_mean: unbiased std). A NaN makes a z-score NaN and ``NaN <= 6`` is False, so
# NaN steps -- and every step while a NaN sits in the window -- are skipped, as in the source.
# ------------------------------------------------------------------------------------------------------
@dataclass
class OLMoSkipStep:
    """OLMo-core's skip-step rule: loss or grad norm beyond mean + 6 sigma of the last 128 steps."""

    rolling_interval_length: int = 128
    sigma_factor: float = 6.0
    name: str = "olmo_skip_6sigma"
    losses: deque = field(default_factory=deque)
    grad_norms: deque = field(default_factory=deque)

    def _z(self, values: deque) -> float:
        prev = list(values)[:-1]
        if not all(map(_finite, prev)) or not _finite(values[-1]):
            return math.nan
        mean, std = statistics.fmean(prev), statistics.stdev(prev)
        return abs(values[-1] - mean) / std if std > 0 else (0.0 if values[-1] == mean else math.inf)

    def observe(self, r: StepRecord) -> bool:
        for buf, x in ((self.losses, r.loss), (self.grad_norms, r.grad_norm)):
            buf.append(x)
            while len(buf) > self.rolling_interval_length + 1:
                buf.popleft()
        if len(self.losses) < max(20, self.rolling_interval_length // 2):
            return False
        ok = self._z(self.losses) <= self.sigma_factor and self._z(self.grad_norms) <= self.sigma_factor
        return not ok


# ------------------------------------------------------------------------------------------------------
# ZClip (Kumar et al. 2025, arXiv:2504.02507; github.com/bluorion-com/ZClip ``zclip/zclip.py``, defaults
# alpha=0.97, z_thresh=2.5, warmup_steps=25, mode="zscore", clip_option="adaptive_scaling"): the first 25
# norms initialise the mean/variance; then z = (g - mean) / (std + 1e-6) and z > 2.5 is a spike (ZClip
# clips it to mean + z_thresh * std / (z / z_thresh)); the EMA absorbs the clipped value (or g). It is a
# clipper: "firing" is cheap for it; here it is scored as an alarm like every other rule. A NaN norm makes
# z NaN (no spike) and the EMA NaN from then on, as in the source.
# ------------------------------------------------------------------------------------------------------
@dataclass
class ZClip:
    """ZClip's z-score spike test (z > 2.5 against an EMA with alpha 0.97)."""

    alpha: float = 0.97
    z_thresh: float = 2.5
    warmup_steps: int = 25
    eps: float = 1e-6
    name: str = "zclip_z2.5"
    buffer: list = field(default_factory=list)
    mean: float | None = None
    var: float | None = None

    def observe(self, r: StepRecord) -> bool:
        g = r.grad_norm
        if self.mean is None:
            self.buffer.append(g)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            return False
        std = self.var ** 0.5 if _finite(self.var) and self.var >= 0 else math.nan
        z = (g - self.mean) / (std + self.eps)
        clip_val = None
        if z > self.z_thresh:  # NaN > 2.5 is False
            clip_val = self.mean + (self.z_thresh * std) / (z / self.z_thresh)
        x = clip_val if clip_val is not None else g
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return clip_val is not None


BASELINES = (FixedThreshold, EMARatio, MegatronLargeGrads, KillLossSpike, OLMoSkipStep, ZClip)
"""Baseline classes, in table order; each is instantiated fresh per recording."""


def new_baselines() -> list:
    """Fresh instances of every baseline."""
    return [cls() for cls in BASELINES]


# ------------------------------------------------------------------------------------------------------
# vidstab's detectors, replayed through the guard's own statistics producer and judge
# ------------------------------------------------------------------------------------------------------
class VidstabReplay:
    """vidstab's detectors judging recorded steps with the guard's OWN statistics producer and judge.

    The detectors are the ones a one-process :class:`vidstab.Guard` builds from the config
    (``vidstab.detectors.running.build_detectors``). Per step, the recorded vector (a rank's :class:`vidstab.signals.Layout`
    columns; with one process it is also the reduced summary) goes through ``vidstab.guard.stats.build_stats`` with
    the three LR values the guard reads from the optimizer and the scheduler (the param group's LR, the schedule's
    peak, the scheduler's own LR) and the step's shape bucket; then ``vidstab.detectors.running.judge``,
    ``applied = verdict <= WARN`` (the unguarded trajectory), ``vidstab.detectors.running.absorb``: the guard's two phases.
    Nothing about what detectors see is re-implemented here.
    """

    name = "vidstab"

    def __init__(self, config=None, max_grad_norm: float = 1.0, lr_peak: float | None = None) -> None:
        from vidstab import signals
        from vidstab.config import GuardConfig
        from vidstab.detectors import Verdict
        from vidstab.detectors.running import absorb, build_detectors, judge
        from vidstab.guard.stats import build_stats

        self.config = config if config is not None else GuardConfig()
        self.max_grad_norm = max_grad_norm
        self.lr_peak = lr_peak
        self.layout = signals.Layout(self.config.timestep_buckets)
        self.detectors = build_detectors(self.config, world_size=1)
        self._build_stats, self._judge, self._absorb, self._Verdict = build_stats, judge, absorb, Verdict
        self._signals = signals
        self._prev: StepRecord | None = None

    def stats_of_vector(self, step: int, vector: list[float], lr: float | None, lr_peak: float | None,
                        lr_scheduled: float | None, bucket: str = "default", scale_known: bool = False):
        """``build_stats`` of one recorded one-process vector, as the guard's step calls it."""
        vector, L = list(vector), self.layout
        for column, value in ((L.lr, lr), (L.lr_peak, lr_peak), (L.lr_scheduled, lr_scheduled)):
            vector[column] = -1.0 if value is None else value  # the guard packs each rank's LR figures
        return self._build_stats(step, vector, self.layout, rows=[vector], bucket=bucket,
                                 max_grad_norm=self.max_grad_norm, sharded=False, scale_known=scale_known,
                                 has_scaler=False)

    def observe_stats(self, s) -> list:
        """Judge one step's statistics as the guard does, then absorb them; returns the findings (empty: no alarm)."""
        self._judge(self.detectors, s)
        s.applied = s.verdict <= self._Verdict.WARN
        self._absorb(self.detectors, s)
        return list(s.findings)

    def observe_vector(self, step: int, vector: list[float], lr: float | None = None, lr_peak: float | None = None,
                       lr_scheduled: float | None = None, bucket: str = "default", scale_known: bool = False) -> list:
        """Judge one recorded vector as the guard would; returns the findings (empty: no alarm)."""
        return self.observe_stats(self.stats_of_vector(step, vector, lr, lr_peak, lr_scheduled, bucket, scale_known))

    def vector_of_record(self, r: StepRecord) -> list[float]:
        """The vector :meth:`vidstab.signals.Window.pack` would have made for a tuning-split ``StepRecord`` (recorded
        without vectors) on one process: one micro-step, the parameter norm measured after the previous
        ``param_norm_every`` step, no input RMS (the tuning recordings hold only the absmax; ``input_scale`` ignores
        a non-positive RMS), no timestep buckets, no time measured."""
        S, L = self._signals, self.layout
        v = [0.0] * L.width
        g = r.grad_norm
        v[L.norm_known] = 1.0
        v[L.grad_norm] = g if _finite(g) else 0.0
        v[L.norm_nan], v[L.norm_nonfinite] = float(math.isnan(g)), float(not math.isfinite(g))
        finite_loss = _finite(r.loss)
        v[L.loss_sum], v[L.loss_count] = (r.loss, 1.0) if finite_loss else (0.0, 0.0)
        v[L.loss_nonfinite] = v[L.ranks_loss_bad] = 0.0 if finite_loss else 1.0
        inputs_ok = not r.input_nonfinite
        v[L.ranks_input_bad] = 0.0 if inputs_ok else 1.0
        # One input "tensor" whose absmax is the recorded one (a rank with non-finite inputs carries no input figures).
        v[L.in_numel], v[L.in_absmax] = (1.0, r.input_absmax) if inputs_ok else (0.0, 0.0)
        v[L.loss_scale] = 0.0 if r.loss_scale is None else r.loss_scale
        v[L.ranks] = v[L.micro_steps] = 1.0
        v[L.slowest] = S.slowest_key(-1.0, 0)
        v[L.bucket] = S.bucket_hash("default")
        v[L.neg_bucket] = -v[L.bucket]
        prev, every = self._prev, self.config.param_norm_every
        if prev is not None and every > 0 and prev.step % every == 0:
            psq = prev.param_norm ** 2 if _finite(prev.param_norm) else math.nan
            ur = prev.update_ratio * prev.param_norm if _finite(prev.update_ratio) and _finite(prev.param_norm) else -1.0
            usq = ur * ur if ur >= 0 else -1.0
            v[L.param_measured] = 1.0
            v[L.param_sq_sum] = v[L.param_sq_max] = psq
            v[L.update_sq_sum] = v[L.update_sq_max] = usq
        return v

    def observe(self, r: StepRecord) -> list:
        """Judge a tuning-split ``StepRecord`` (its LR peak is the one given at construction; the
        scheduler's own LR was not recorded)."""
        vector = self.vector_of_record(r)
        self._prev = r
        return self.observe_vector(r.step, vector, r.lr, self.lr_peak, None, scale_known=r.loss_scale is not None)

    def close(self) -> None:
        """Nothing to release (kept: callers close every replay)."""
