"""The windowed detectors judge in O(1)/O(log n) per step and reach what their batch definitions reach.

Each windowed detector (``clip_rate``, ``grad_growth``, ``input_scale``, ``param_growth``) is
run side by side with its batch definition (the window re-read in full every step: the previous
implementation, kept here verbatim as the reference) on a long random sequence that wraps its window many
times and produces findings, skips and re-arms. Findings (step, message, figures) and saved state must
match; midway, the incremental detector is saved to JSON and a fresh one continues from it (also from the
batch definition's state: the saved format is unchanged).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import deque

import pytest

from vidstab import StepStats, Verdict
from vidstab.detectors import (ClipRateConfig, ClipRateDetector, Finding, GradGrowthConfig, GradGrowthDetector,
                               InputScaleConfig, InputScaleDetector, ParamGrowthConfig, ParamGrowthDetector)
from vidstab.detectors.input_scale import DriftCusum, smooth_window
from vidstab.detectors.windows import SlopeWindow, SortedWindow, median_without, slope


# ---------------------------------------------------------------- the batch definitions (previous code)
class BatchClipRate(ClipRateDetector):
    def __init__(self, config):
        super().__init__(config)
        self.norms = deque(maxlen=config.window)

    def _judge(self, norms, max_norm):
        rate = sum(n > max_norm for n in norms) / len(norms)
        factor = statistics.median(norms) / max_norm if max_norm > 0 else math.inf
        return rate, factor, rate > self.config.max_rate and factor >= self.config.min_clip_factor

    def observe(self, s):
        if s.max_grad_norm is None or not self.armed or not math.isfinite(s.grad_norm) or not self._warm(s):
            return None
        norms = list(self.norms)[1 - self.config.window:] + [s.grad_norm] if self.config.window > 1 else [s.grad_norm]
        if len(norms) < self.config.window:
            return None
        rate, factor, heavy = self._judge(norms, s.max_grad_norm)
        if not heavy:
            return None
        return self.finding(
            f"gradients were clipped on {rate:.0%} of the last {len(norms)} steps, median pre-clip norm "
            f"{factor:.1f}x max_grad_norm: lower the LR or fix the model/data; clipping should be a seat belt, "
            "not the engine",
            {"clip_rate": rate, "clip_factor": factor, "window": float(len(norms))},
        )

    def update(self, s):
        self.warmed_up = self._warm(s)
        if any(f.detector == self.name for f in s.findings):
            self.armed = False
        if s.applied and s.max_grad_norm is not None and math.isfinite(s.grad_norm):
            self.norms.append(s.grad_norm)
            if not self.armed and len(self.norms) == self.config.window:
                self.armed = not self._judge(list(self.norms), s.max_grad_norm)[2]

    def state_dict(self):
        return {"norms": list(self.norms), "armed": self.armed, "warmed_up": self.warmed_up}


class BatchGradGrowth(GradGrowthDetector):
    def __init__(self, config):
        super().__init__(config)
        self.logs = deque(maxlen=config.window + 1)
        self.logs_all = []  # every absorbed log norm (the changes' EMA is over their differences)

    def observe(self, s):
        x = s.grad_norm
        if not (math.isfinite(x) and x > 0) or self.seen < self.config.warmup_steps:
            return None
        ys = list(self.logs) + [math.log(x)]
        if len(ys) < self.config.window + 1:
            return None
        ys = ys[-(self.config.window + 1):]
        rises = sum(b > a for a, b in zip(ys, ys[1:]))
        n = len(ys)
        xm, ym = (n - 1) / 2, sum(ys) / n
        slope_ = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum((i - xm) ** 2 for i in range(n))
        growth = math.exp(slope_ * self.config.window)
        noise_std = math.sqrt(max(self.changes.var, 0.0) / 2.0)
        bar = max(math.log(self.config.min_growth), self.config.noise_z * self.config.window * noise_std * math.sqrt(12.0 / (n * (n * n - 1))))
        if rises < self.config.min_rises or slope_ * self.config.window < bar:
            return None
        return self.finding(
            f"gradient norm rose on {rises}/{self.config.window} steps, x{growth:.2f} over the window "
            f"(x{math.exp(slope_):.3f} per step): likely heading for an explosion",
            {"grad_norm": x, "rises": float(rises), "growth": growth, "per_step": math.exp(slope_)},
        )

    def update(self, s):
        if any(f.detector == self.name for f in s.findings):
            self.logs.clear()
        if s.applied and math.isfinite(s.grad_norm) and s.grad_norm > 0:
            if self.logs_all:
                self.changes.add(math.log(s.grad_norm) - self.logs_all[-1])
            self.logs_all.append(math.log(s.grad_norm))
            self.logs.append(math.log(s.grad_norm))
            self.seen += 1

    def state_dict(self):
        return {"logs": list(self.logs), "seen": self.seen, "changes": self.changes.state_dict(),
                "last_log": self.logs_all[-1] if self.logs_all else None}


class BatchInputScale(InputScaleDetector):
    def __init__(self, config):
        super().__init__(config)
        self.recent = deque(maxlen=config.smooth_steps)

    def observe(self, s):
        x = s.input_rms
        if x is None or not math.isfinite(x) or x <= 0 or self.reference is None:
            return None
        window = list(self.recent)[1 - self.smooth:] + [x] if self.smooth > 1 else [x]
        judged = statistics.median_low(window)
        if max(x / self.reference, self.reference / x) >= self.config.instant_ratio:
            judged, window = x, [x]
        ratio = judged / self.reference
        far = max(ratio, 1.0 / ratio)
        figures = {"input_rms": x, "judged_rms": judged, "reference_rms": self.reference, "ratio": ratio}
        source = "given" if self.config.reference_rms is not None else f"first {self.config.reference_steps} steps"
        msg = (f"input RMS {judged:.4g} ({'this step' if len(window) == 1 else f'median of the last {len(window)} steps'}) is x{ratio:.3g} the reference "
               f"{self.reference:.4g} ({source}): check the data pipeline / VAE scaling factor")
        if far >= self.config.act_ratio:
            return self.finding(msg, figures)
        if far >= self.config.warn_ratio and s.step >= self.quiet_until:
            self._warned_step = s.step
            return Finding(self.name, min(self.verdict, Verdict.WARN), msg, figures)
        return None

    def update(self, s):
        if self._warned_step == s.step:
            self.quiet_until = s.step + self.config.quiet_steps
        x = s.input_rms
        if x is None or not math.isfinite(x) or x <= 0:
            return
        self.recent.append(x)
        if not self._measured and s.applied:
            self.early.append(x)
            if len(self.early) >= self.config.reference_steps:
                if self.reference is None:
                    self.reference = statistics.median(self.early)
                self.smooth = smooth_window(self.early, self.config)
                self.recent = deque(self.recent, maxlen=self.smooth)
                self._measured = True
                self.early = []

    def state_dict(self):
        return {"early": list(self.early), "reference": self.reference, "recent": list(self.recent),
                "quiet_until": self.quiet_until, "smooth_steps": self.smooth if self._measured else None,
                "drifts": {"default": DriftCusum(self.config.drift_lag).state_dict()}}  # off in these cases: it stays empty


class PlainWindow(deque):
    """A deque under the names of SortedWindow (the batch definitions re-read it in full)."""

    push = deque.append

    @property
    def values(self):
        return self


class BatchParamGrowth(ParamGrowthDetector):
    def _reference(self, step):
        old = [(st, v) for st, v in self.samples if st <= step - self.config.window]
        return old[-1] if old else None

    def _lowest(self, step):
        ref = self._reference(step)
        since = [(st, v) for st, v in self.samples if ref is None or st >= ref[0]]
        return min(since, key=lambda x: x[1]) if since else None


# ---------------------------------------------------------------- random runs
def clip_run(n, rng):
    out, level = [], 1.0
    for i in range(n):
        if i % 97 == 0:
            level = rng.choice([0.5, 1.2, 3.0, 4.0])  # regimes: no clipping, mild, heavy
        max_norm = 1.0 if rng.random() > 0.02 else rng.choice([0.5, 2.0])  # a threshold that moves now and then
        norm = round(level * math.exp(rng.gauss(0, 0.4)), 2)  # rounded: ties in the window
        lr_peak = 1e-3 if i < n // 2 else None
        out.append(dict(step=i, grad_norm=norm if rng.random() > 0.01 else math.nan, loss=1.0,
                        max_grad_norm=max_norm, lr=min(1e-3, 1e-5 * (i + 1)), lr_peak=lr_peak))
    return out


def growth_run(n, rng):
    out, y = [], 0.0
    for i in range(n):
        trend = 0.2 if (i // 40) % 3 == 2 else 0.0  # run-ups between stationary stretches
        y += trend + rng.gauss(0, 0.15)
        if rng.random() < 0.05:
            y -= 2.0
        out.append(dict(step=i, grad_norm=math.exp(y) if rng.random() > 0.01 else math.inf, loss=1.0))
    return out


def scale_run(n, rng):
    out = []
    for i in range(n):
        level = [1.0, 1.7, 2.5, 0.4, 6.0, 1.0][(i // 60) % 6]
        rms = round(level * math.exp(rng.gauss(0, 0.1)), 3)
        out.append(dict(step=i, grad_norm=1.0, loss=1.0, input_rms=rms if rng.random() > 0.02 else None))
    return out


def param_run(n, rng):
    out, p = [], 10.0
    for i in range(n):
        p *= math.exp(rng.gauss(0.003 if (i // 300) % 2 else 0.0, 0.002))
        out.append(dict(step=i, grad_norm=1.0, loss=1.0, param_norm=p if i % 10 == 0 else None))
    return out


CASES = {
    "clip_rate": (ClipRateDetector, BatchClipRate, ClipRateConfig(window=30), clip_run),
    "clip_rate_window_1": (ClipRateDetector, BatchClipRate, ClipRateConfig(window=1, max_rate=0.5), clip_run),
    "grad_growth": (GradGrowthDetector, BatchGradGrowth, GradGrowthConfig(warmup_steps=10), growth_run),
    # The level test (the median window); the drift test: test_input_drift_cusum_equals_its_batch_definition.
    "input_scale": (InputScaleDetector, BatchInputScale, InputScaleConfig(smooth_steps=6, quiet_steps=20, drift_threshold=0),
                    scale_run),
    "input_scale_given": (InputScaleDetector, BatchInputScale, InputScaleConfig(reference_rms=1.0, drift_threshold=0),
                          scale_run),
    "param_growth": (ParamGrowthDetector, BatchParamGrowth, ParamGrowthConfig(window=100, max_growth=1.2), param_run),
}


def figures_close(a: Finding, b: Finding) -> bool:
    return a.figures.keys() == b.figures.keys() and all(
        math.isclose(a.figures[k], b.figures[k], rel_tol=1e-9, abs_tol=1e-12) for k in a.figures)


@pytest.mark.parametrize("case", sorted(CASES))
def test_incremental_detector_equals_its_batch_definition_through_wraps_and_a_reload(case):
    new_cls, batch_cls, config, make = CASES[case]
    rng = random.Random(case)
    seq = make(3000, rng)
    applied_draws = [rng.random() > 0.1 for _ in seq]
    new, ref = new_cls(config), batch_cls(config)
    findings = 0
    for i, kw in enumerate(seq):
        if i in (1234, 2222):  # mid-window: save, reload into a fresh detector, go on with that one
            saved = json.loads(json.dumps(new.state_dict()))
            assert saved == json.loads(json.dumps(ref.state_dict()))  # same state, same format
            new = new_cls(config)
            new.load_state_dict(saved if i == 1234 else json.loads(json.dumps(ref.state_dict())))
        a, b = StepStats(**kw), StepStats(**kw)
        fa, fb = new.observe(a), ref.observe(b)
        assert (fa is None) == (fb is None), f"step {i}: {fa} vs {fb}"
        for s, f in ((a, fa), (b, fb)):
            if f is not None:
                s.findings.append(f)
                s.verdict = f.verdict
            s.applied = applied_draws[i] and s.verdict < Verdict.SKIP
        if fa is not None:
            findings += 1
            assert fa.message == fb.message and fa.ranks == fb.ranks and figures_close(fa, fb), f"step {i}"
        new.update(a)
        ref.update(b)
    assert new.published() == ref.published()
    final_new, final_ref = new.state_dict(), ref.state_dict()
    if case == "grad_growth":  # floats compared within rounding; the rest is identical
        assert final_new["seen"] == final_ref["seen"] and final_new["logs"] == pytest.approx(final_ref["logs"])
    else:
        assert final_new == final_ref
    assert findings >= 3, f"the run should exercise findings, got {findings}"


@pytest.mark.parametrize("restart", [True, False])
def test_input_drift_cusum_equals_its_batch_definition(restart):
    """input_scale's drift test (running baseline with a lag, Page's recursion) reaches what its definition
    reaches re-read in full every step: baseline = mean and std of the log RMS of the applied steps except the
    last ``drift_lag`` (with ``drift_restart``: only those from the last crossing on); CUSUM = the largest sum
    of (z - allowance) over the steps since its last crossing, ending at this one; it starts where that sum
    does. Through level changes, unknown RMS, skipped steps and a save and reload."""
    config = InputScaleConfig(warn_ratio=1e9, act_ratio=1e9, instant_ratio=1e9, quiet_steps=15, drift_threshold=6.0,
                              drift_allowance=0.5, drift_lag=30, drift_restart=restart)
    rng = random.Random(5)
    seq = scale_run(1500, rng)
    applied_draws = [rng.random() > 0.1 for _ in seq]
    new = InputScaleDetector(config)
    applied_logs: list[float] = []
    since_reset: list[tuple[int, float]] = []  # (step, z - allowance) since the last crossing
    quiet_until, warned, base_from = -1, 0, 0  # base_from: where the baseline's steps begin in applied_logs
    for i, kw in enumerate(seq):
        if i == 777:
            saved = json.loads(json.dumps(new.state_dict()))
            new = InputScaleDetector(config)
            new.load_state_dict(saved)
        s = StepStats(**kw)
        f = new.observe(s)
        x, expected = s.input_rms, None
        base = applied_logs[base_from:max(base_from, len(applied_logs) - config.drift_lag)]
        if x is not None and len(base) >= max(2, config.reference_steps):
            mean, std = statistics.fmean(base), max(statistics.stdev(base), config.drift_min_std)
            z = (math.log(x) - mean) / std
            since_reset.append((s.step, z - config.drift_allowance))
            sums = [(sum(w for _, w in since_reset[j:]), since_reset[j][0]) for j in range(len(since_reset))]
            downs = [(sum(-w - 2 * config.drift_allowance for _, w in since_reset[j:]), since_reset[j][0])
                     for j in range(len(since_reset))]
            up, down = max(sums), max(downs)
            if max(up[0], down[0]) > config.drift_threshold:
                since_reset = []
                if restart:
                    base_from = len(applied_logs)  # this step's RMS, if applied, is the new baseline's first
                if s.step >= quiet_until:
                    expected = up if up[0] > config.drift_threshold else down
                    quiet_until = s.step + config.quiet_steps
        assert (f is None) == (expected is None), f"step {i}: {f} vs {expected}"
        if f is not None:
            warned += 1
            assert f.verdict == Verdict.WARN and f.figures["since_step"] == expected[1]
            assert f.figures["cusum"] == pytest.approx(expected[0], rel=1e-9)
            s.findings.append(f)
            s.verdict = f.verdict
        s.applied = applied_draws[i]
        if x is not None and s.applied:
            applied_logs.append(math.log(x))
        new.update(s)
    assert warned >= 5, warned


def test_sorted_window_answers_what_statistics_would_on_the_pushed_window():
    rng = random.Random(0)
    for size in (1, 2, 3, 8):
        w, plain = SortedWindow(size), deque(maxlen=size)
        for _ in range(300):
            x = float(rng.randint(0, 6))  # many ties
            after = list(plain)[1 - size:] + [x] if size > 1 else [x]
            assert w.pushed_len() == len(after)
            assert w.median_pushed(x) == statistics.median(after)
            assert w.median_low_pushed(x) == statistics.median_low(after)
            assert [w.kth_pushed(x, k) for k in range(len(after))] == sorted(after)
            assert w.count_above_pushed(x, 2.5) == sum(v > 2.5 for v in after)
            w.push(x)
            plain.append(x)
            assert w.median() == statistics.median(plain) and w.count_above(3.0) == sum(v > 3.0 for v in plain)
    values = sorted(rng.random() for _ in range(9))
    assert all(median_without(values, i) == statistics.median(values[:i] + values[i + 1:]) for i in range(9))


def test_slope_window_matches_the_two_pass_fit_and_does_not_drift():
    rng = random.Random(1)
    w, plain = SlopeWindow(9), deque(maxlen=9)
    for step in range(5000):
        y = rng.gauss(50.0, 10.0) + 0.01 * step
        n, sy, siy, rises = w.pushed(y)
        after = (list(plain) + [y])[-9:]
        xm, ym = (n - 1) / 2, sum(after) / n
        if n >= 2:
            exact = sum((i - xm) * (v - ym) for i, v in enumerate(after)) / sum((i - xm) ** 2 for i in range(n))
            assert slope(n, sy, siy) == pytest.approx(exact, rel=1e-9, abs=1e-9)
        assert rises == sum(b > a for a, b in zip(after, after[1:]))
        w.push(y)
        plain.append(y)


def test_judge_and_absorb_skip_only_detectors_with_nothing_to_do_and_reach_the_same_verdicts_and_state():
    from vidstab import GuardConfig
    from vidstab.detectors.running import absorb, build_detectors, judge

    def everyone(detectors, s):  # the judge without the ``needs`` gate: every observe, every step
        for det in detectors:
            f = det.observe(s)
            if f is not None:
                s.findings.append(f)
                s.verdict = max(s.verdict, f.verdict)

    def everyone_absorbs(detectors, s):  # absorb without the ``update_needs`` gate
        for det in detectors:
            det.update(s)

    rng = random.Random(7)
    gated, plain = build_detectors(GuardConfig()), build_detectors(GuardConfig())
    calls = {d.name: 0 for d in gated}
    for det in gated:
        det.observe = (lambda fn, name: lambda s: calls.__setitem__(name, calls[name] + 1) or fn(s))(det.observe, det.name)
    verdicts, lr_bound_findings = set(), 0
    for i in range(1500):
        spike = 30.0 if rng.random() < 0.03 else 1.0
        kw = dict(step=i, grad_norm=spike * math.exp(rng.gauss(0, 0.2)), loss=math.exp(rng.gauss(0, 0.2)),
                  lr=1e-3 * (1.5 if 300 <= i < 310 else 5.0 if i == 700 else 1.0), lr_peak=1e-3, max_grad_norm=1.0 if i < 800 else None,
                  param_norm=10.0 * (1 + i / 300) if i % 10 == 0 else None,
                  update_ratio=1e-3 * (5 if 600 < i < 650 else 1) if i % 10 == 0 else None,
                  input_rms=math.exp(rng.gauss(0, 0.05)) * (3.0 if 1000 < i < 1010 else 1.0), input_absmax=4.0)
        a, b = StepStats(**kw), StepStats(**kw)
        judge(gated, a)
        everyone(plain, b)
        assert a.verdict == b.verdict and [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
        verdicts.add(a.verdict)
        lr_bound_findings += any(f.detector == "lr_bound" for f in a.findings)
        a.applied = b.applied = a.verdict < Verdict.SKIP
        absorb(gated, a)
        everyone_absorbs(plain, b)
        if i % 100 == 99:
            assert [d.state_dict() for d in gated] == [d.state_dict() for d in plain]
    assert {Verdict.WARN, Verdict.SKIP, Verdict.ROLLBACK} <= verdicts and lr_bound_findings >= 2
    assert calls["param_growth"] == calls["nonfinite_params"] == calls["update_ratio"] == 150  # measured steps only
    assert calls["loss_scale"] == calls["exception"] == 0  # no fp16 scaler, no exception in this run
    assert calls["clip_rate"] == 800 and calls["grad_spike"] == 1500
    assert 0 < calls["trend"] < 1500 and calls["trend"] == calls["repeated_spikes"]  # steps with findings
