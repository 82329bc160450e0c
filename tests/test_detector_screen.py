"""The healthy-step screen (vidstab/detectors/screen.py) changes nothing the detectors decide.

The same stream of steps goes through two sets of the default detectors: one judged with a plan kept across
steps (the guard's way: the detectors' promises about the next step are used), one judged with a fresh plan
every step (no promises: every detector's ``observe`` runs). Findings, verdicts and every detector's state
must be equal on every step, while the screened set skips most ``observe`` calls on healthy steps. A third set
makes the updates of steady promises later (the guard's deferring plan): the same findings and verdicts on
every step, the same thresholds in every step's metrics record, the same state whenever it is caught up. The
stream walks through what the promises are about: warm-ups, gradient and loss spikes, a gradient run-up,
timestep buckets, heavy clipping at two clip values, an LR above the schedule's peak, input rescales and drifts, non-finite values, a
rollback's state reload.
"""

from __future__ import annotations

import math
import random

import pytest

from vidstab import GuardConfig
from vidstab.detectors import (DetectorPlan, StepStats, Verdict, absorb, build_detectors, catch_up, judge, published,
                               absorb_batch)


def _stream(seed: int, steps: int):
    rng = random.Random(seed)
    growth = 0.0
    for i in range(steps):
        g = math.exp(rng.gauss(0, 0.25))
        if 400 <= i < 430:  # a run-up of the gradient norm
            growth += 0.12
        elif i >= 430:
            growth = max(0.0, growth - 0.2)
        g *= math.exp(growth)
        if rng.random() < 0.02:
            g *= rng.choice([4.0, 12.0, 40.0])
        loss = math.exp(rng.gauss(0, 0.15)) * (rng.uniform(2.0, 9.0) if rng.random() < 0.03 else 1.0)
        clip = 1.0 if i < 900 else 0.5 if i < 1300 else None
        if 600 <= i < 900:  # clipping hard for a long while, about at the rate the detector warns at
            u = rng.random()
            g = 3.0 * math.exp(rng.gauss(0, 0.1)) if u < 0.68 else 1.1 if u < 0.79 else 0.5
        scale = 1.0 + (0.01 * (i - 1000) if 1000 <= i < 1060 else 0.6 if 1060 <= i < 1100 else 0.0)
        if 1500 <= i < 1510:
            scale = 3.0
        elif i >= 1550:  # a lasting rescale down: every EMA falls, and with it every line
            scale, g = 0.3, g * 0.3
        rms = math.exp(rng.gauss(0, 0.03)) * scale
        absmax = 4.0 * rms * (rng.uniform(5.0, 16.0) if rng.random() < 0.02 else 1.0)
        buckets = None
        if i >= 200:  # per-timestep losses from here on; some buckets missing on some steps
            buckets = [None if rng.random() < 0.3 else loss * (3.0 if b == 0 else 1.0) * math.exp(rng.gauss(0, 0.1))
                       for b in range(4)]
        if rng.random() < 0.01:
            g = math.nan
        if rng.random() < 0.005:
            loss = math.inf
        lr = 1e-3 * (1.5 if 405 <= i < 415 else 1.0)  # above the schedule's peak during the run-up: a trend
        yield dict(step=i, grad_norm=g, loss=loss, max_grad_norm=clip, lr=lr, lr_peak=1e-3, lr_scheduled=1e-3,
                   input_rms=rms, input_absmax=absmax, timestep_bucket_loss=buckets or [],
                   param_norm=10.0 if i % 10 == 0 else None, update_ratio=1e-3 if i % 10 == 0 else None,
                   nonfinite_loss_ranks=[0] if not math.isfinite(loss) else [])


def _observe_counter(detectors):
    """Count the ``observe`` calls of the detectors that make promises."""
    calls = {"n": 0}
    for det in detectors:
        if det.screens:
            det.observe = (lambda fn: lambda s: calls.__setitem__("n", calls["n"] + 1) or fn(s))(det.observe)
    return calls


def test_screened_judge_finds_exactly_what_every_detector_finds_and_skips_most_calls():
    config = GuardConfig()
    screened, full = build_detectors(config, world_size=1), build_detectors(config, world_size=1)
    plan = DetectorPlan.of(screened)
    calls_screened, calls_full = _observe_counter(screened), _observe_counter(full)
    kinds, saved = set(), None
    quiet_healthy = healthy = 0  # healthy steps after the warm-ups, and those on which no promise broke
    for kw in _stream(seed=3, steps=1800):
        a, b = StepStats(**kw), StepStats(**kw)
        before = calls_screened["n"]
        judge(plan, a)
        judge(list(full), b)  # a fresh plan: no promises
        assert a.verdict == b.verdict, kw["step"]
        assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings], kw["step"]
        kinds.update(f.detector for f in a.findings)
        if not a.findings and kw["step"] > 300:
            healthy += 1
            quiet_healthy += calls_screened["n"] == before
        a.applied = b.applied = a.verdict <= Verdict.WARN
        absorb(plan, a)
        absorb(list(full), b)
        assert [d.state_dict() for d in screened] == [d.state_dict() for d in full], kw["step"]
        if kw["step"] == 1200:
            saved = [d.state_dict() for d in screened]
        if kw["step"] == 1400:  # a rollback: both sets reload the state of step 1200
            for dets in (screened, full):
                for d, st in zip(dets, saved):
                    d.load_state_dict(st)
            plan.screen.clear()
    # The stream reached every promise-making detector's finding, and the screen did its job.
    assert {"grad_spike", "grad_growth", "loss_spike", "clip_rate", "input_range", "input_scale", "nonfinite"} <= kinds
    assert quiet_healthy >= 0.6 * healthy  # the stream is rough on purpose: heavy clipping, drifts, spikes
    assert calls_screened["n"] < 0.25 * calls_full["n"]


def test_updates_made_later_change_nothing_but_when_they_are_made():
    """A deferring plan (the guard's) queues healthy steps' updates of steady promises and makes them before
    anything reads the detector. Against a fresh plan on every step (every detector judging and updating on its
    own step): the same findings and verdicts on every step, the same published thresholds in every step's
    record (written when the update is made), the same state at every catch-up, through a rollback's reload;
    and most healthy steps queue updates."""
    config = GuardConfig()
    deferred, full = build_detectors(config, world_size=1), build_detectors(config, world_size=1)
    screened = build_detectors(config, world_size=1)
    plan, screened_plan = DetectorPlan.of(deferred, defer=True), DetectorPlan.of(screened)
    records, expected, saved = [], [], None
    queued = healthy = 0
    for kw in _stream(seed=7, steps=1800):
        if kw["step"] in (350, 352, 1250):  # far below every norm so far: it would break grad_spike's promise
            kw["grad_norm"] *= 1e-4
        a, b, c = StepStats(**kw), StepStats(**kw), StepStats(**kw)
        judge(plan, a)
        judge(list(full), b)
        judge(screened_plan, c)
        assert a.verdict == b.verdict, kw["step"]
        assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings], kw["step"]
        a.applied = b.applied = c.applied = a.verdict <= Verdict.WARN
        absorb(plan, a)
        absorb(list(full), b)
        absorb(screened_plan, c)
        assert plan.screen.bounds == screened_plan.screen.bounds, kw["step"]  # a queued update broke no promise
        waiting = sum(1 for q in plan.screen.pending if q and q[-1][0] is a)
        queued += waiting
        healthy += not a.findings and kw["step"] > 300
        record = {"step": kw["step"]}
        record.update(published(plan, record))
        records.append(record)
        expected.append({"step": kw["step"], **published(list(full))})
        if kw["step"] % 37 == 0:  # what a checkpoint or a tracker would read
            catch_up(plan)
            assert [d.state_dict() for d in deferred] == [d.state_dict() for d in full], kw["step"]
        if kw["step"] == 1200:
            catch_up(plan)
            saved = [d.state_dict() for d in deferred]
        if kw["step"] == 1400:  # a rollback: catch up (the guard's load_state_dict does), reload step 1200's state
            catch_up(plan)
            for dets in (deferred, full, screened):
                for d, st in zip(dets, saved):
                    d.load_state_dict(st)
            plan.screen.clear()
            screened_plan.screen.clear()
    catch_up(plan)
    assert [d.state_dict() for d in deferred] == [d.state_dict() for d in full]
    assert records == expected
    assert any("grad_spike_threshold" in r for r in records)
    assert queued >= 1.5 * healthy, (queued, healthy)  # grad_spike, input_range, input_scale, clip_rate wait


def test_a_promise_is_used_for_the_next_step_only():
    """A plan whose promises were built on step t says nothing about any step but t + 1 (a rollback resumes
    at an earlier step with other state: its first step is judged in full)."""
    dets = build_detectors(GuardConfig(), world_size=1)
    plan = DetectorPlan.of(dets)
    for kw in _stream(seed=1, steps=120):
        s = StepStats(**kw)
        judge(plan, s)
        s.applied = True
        absorb(plan, s)
    assert plan.screen.step == 120 and all(b is not None for b in plan.screen.bounds)
    later = StepStats(**{**next(_stream(seed=1, steps=1)), "step": 50})
    assert plan.screen.quiet(later) == frozenset()


def _edge_steps(kw: dict, bounds, edge: int) -> list[dict]:
    """The step's fields moved to one end (``edge`` 1: lo, 2: hi) of a promise's finite intervals; a field
    derived from others (``StepStats`` properties) is reached through what it is derived from, one at a time."""
    plain = {f: b[edge] for f, *b in ((f, lo, lo, hi) for f, lo, hi in bounds)
             if f not in DERIVED and math.isfinite(b[edge])}
    out = [plain] if plain else []
    for f, lo, hi in bounds:
        v = (None, lo, hi)[edge]
        if f in DERIVED and math.isfinite(v):
            out.append({**plain, **DERIVED[f](kw, v)})
    return out


#: How to give a step a value of a derived field (a ``StepStats`` property some promise bounds).
DERIVED = {
    "lr_to_peak": lambda kw, v: {"lr": v * kw["lr_peak"]},
    "lr_to_scheduled": lambda kw, v: {"lr": v * kw["lr_scheduled"]},
    "timestep_buckets_filled": lambda kw, v: {"timestep_bucket_loss": [1.0] * int(v)},
    "update_per_lr": lambda kw, v: {"update_ratio": v * kw["lr"]},
}


def test_every_promise_holds_at_its_edges_for_as_long_as_it_is_kept():
    """A promise is checked where it is weakest: before every step, each detector's kept promise (made up to
    ``PROMISE_UPDATES`` updates ago) is probed with the step's statistics moved to each end of its
    intervals, on a copy of the detector as it is now; its ``observe`` must find nothing there."""
    import copy

    dets = build_detectors(GuardConfig(), world_size=1)
    plan = DetectorPlan.of(dets)
    probes = 0
    for kw in _stream(seed=5, steps=1800):
        screen = plan.screen
        if screen.step == kw["step"]:
            for slot, bounds in zip(screen.slots, screen.bounds):
                if not bounds:
                    continue
                det = plan.observers[slot][0]
                for edge in (1, 2):  # lo, hi
                    for values in _edge_steps(kw, bounds, edge):
                        probe = StepStats(**{**kw, **values})
                        if not all(lo <= getattr(probe, f) <= hi for f, lo, hi in bounds):
                            continue  # moving one derived field moved another out of its interval
                        finding = copy.deepcopy(det).observe(probe)
                        assert finding is None, (kw["step"], det.name, values, finding)
                        probes += 1
        s = StepStats(**kw)
        judge(plan, s)
        s.applied = s.verdict <= Verdict.WARN
        absorb(plan, s)
    assert probes > 3000


def test_escalations_expire_lazily_and_reach_what_expiring_every_step_reaches():
    """``trend``, ``repeated_spikes`` and ``consecutive_skips`` leave a quiet step's expiry of old findings to
    their next use or save. Against copies that expire on every step (their update before this change):
    the same findings on every step and the same saved state, through a rollback's reload."""
    from vidstab.detectors import ConsecutiveSkipsDetector, RepeatedSpikesDetector, TrendDetector

    class EagerTrend(TrendDetector):
        def update(self, s):
            if s.verdict >= Verdict.ROLLBACK:
                self.warnings.clear()
                self.timeline.clear()
                return
            self.timeline.add(s.step, s.findings)
            self.warnings.extend(self._counted(s))
            while self.warnings and self.warnings[0][0] <= s.step - self.config.window:
                self.warnings.popleft()

    class EagerSpikes(RepeatedSpikesDetector):
        def update(self, s):
            if s.verdict >= Verdict.ROLLBACK:
                self.steps.clear()
                self.timeline.clear()
                return
            self.timeline.add(s.step, s.findings)
            if self._is_spike(s):
                self.steps.append(s.step)
            while self.steps and self.steps[0] <= s.step - self.config.window:
                self.steps.popleft()

    class EagerSkips(ConsecutiveSkipsDetector):
        def update(self, s):
            self.timeline.add(s.step, s.findings)
            if s.verdict >= Verdict.ROLLBACK:
                self.count = 0
                self.timeline.clear()
            elif s.verdict >= Verdict.SKIP:
                self.count += 1
            elif s.applied:
                self.count = 0

    config = GuardConfig()
    step_detectors = build_detectors(config, world_size=1)[:-3]
    lazy = [TrendDetector(config.trend), RepeatedSpikesDetector(config.repeated_spikes),
            ConsecutiveSkipsDetector(config.consecutive_skips)]
    eager = [EagerTrend(config.trend), EagerSpikes(config.repeated_spikes), EagerSkips(config.consecutive_skips)]
    plan = DetectorPlan.of(step_detectors)
    kinds, saved = set(), None
    for kw in _stream(seed=11, steps=1800):
        s = StepStats(**kw)
        judge(plan, s)
        a, b = StepStats(**kw), StepStats(**kw)
        for x in (a, b):
            x.findings, x.verdict = list(s.findings), s.verdict
        judge(lazy, a)
        judge(eager, b)
        assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings], kw["step"]
        kinds.update(f.detector for f in a.findings)
        s.applied = a.applied = b.applied = a.verdict <= Verdict.WARN
        absorb(plan, s)
        absorb(lazy, a)
        absorb(eager, b)
        if kw["step"] % 7 == 0:
            assert [d.state_dict() for d in lazy] == [d.state_dict() for d in eager], kw["step"]
        if kw["step"] == 1200:
            saved = [d.state_dict() for d in lazy]
        if kw["step"] == 1400:
            for dets in (lazy, eager):
                for d, st in zip(dets, saved):
                    d.load_state_dict(st)
    assert {"trend", "repeated_spikes", "consecutive_skips"} <= kinds, kinds


@pytest.mark.parametrize("buckets,world", [(False, 1), (True, 1), (False, 2)])
def test_batched_healthy_steps_find_and_leave_exactly_what_judging_every_step_does(buckets, world):
    """The guard's batched healthy steps (``Screen.admits``, ``vidstab/guard/healthy.py``): a step the kept
    promises clear is applied without judging and absorbed later, with the others queued, each with
    ``absorb_batch`` before anything judges again. Against a fresh plan on every step:
    the same findings and verdicts on every step (a cleared step has none), the same thresholds in every
    step's record, the same state after every catch-up, through a rollback's reload; and, without timestep-bucket
    losses (the attached loop), most healthy steps after the warm-ups are cleared (with them ``loss_spike``'s
    promise is not steady: every such step is judged). With two ranks the ``straggler`` detector joins (its promise
    counts the steps no streak can reach ``patience`` in): rank 1 turns slow for a stretch, and is warned about on
    the same step either way."""
    from vidstab.detectors import screen_values

    config = GuardConfig()
    batched, full = build_detectors(config, world_size=world), build_detectors(config, world_size=world)
    plan = DetectorPlan.of(batched, defer=True)
    queue: list[StepStats] = []
    records, expected, saved = {}, {}, None
    cleared = healthy = 0
    judged_kinds: set[str] = set()

    def drain() -> None:
        if queue:
            for q, thresholds in zip(queue, absorb_batch(plan, queue)):
                records[q.step] = {"step": q.step, **thresholds}
        queue.clear()

    rng = random.Random(5)
    for kw in _stream(seed=13, steps=1800):
        if not buckets:
            kw["timestep_bucket_loss"] = []
        if world == 2:
            base = 0.010 * math.exp(rng.gauss(0, 0.05))
            slow = 500 <= kw["step"] < 560 or 1000 <= kw["step"] < 1004  # a straggler, then a passing hiccup
            kw["rank_seconds"] = [base, base * (3.0 if slow else math.exp(rng.gauss(0, 0.05)))]
            kw["world_size"] = 2
            kw["rank_loss"] = [kw["loss"], kw["loss"]]
        a, b = StepStats(**kw), StepStats(**kw)
        judge(list(full), b)
        b.applied = b.verdict <= Verdict.WARN
        absorb(list(full), b)
        expected[kw["step"]] = {"step": kw["step"], **published(list(full))}
        healthy += not b.findings and kw["step"] > 300
        room = plan.screen.admits(kw["step"], screen_values(a), len(queue))
        if room >= 0:
            assert not b.findings, kw["step"]  # a cleared step has no finding
            a.applied = True
            queue.append(a)
            cleared += kw["step"] > 300
            if room == 0:
                drain()
        else:
            drain()
            judge(plan, a)
            assert a.verdict == b.verdict, kw["step"]
            assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings], kw["step"]
            judged_kinds.update(f.detector for f in a.findings)
            a.applied = b.applied
            absorb(plan, a, defer=False)
            records[kw["step"]] = {"step": kw["step"], **published(plan)}
        if kw["step"] % 37 == 0 or kw["step"] in (1200, 1400):  # a checkpoint, a tracker, a rollback read
            drain()
            catch_up(plan)
            assert [d.state_dict() for d in batched] == [d.state_dict() for d in full], kw["step"]
        if kw["step"] == 1200:
            saved = [d.state_dict() for d in batched]
        if kw["step"] == 1400:
            for dets in (batched, full):
                for d, st in zip(dets, saved):
                    d.load_state_dict(st)
            plan.screen.clear()
    drain()
    assert [d.state_dict() for d in batched] == [d.state_dict() for d in full]
    assert records == expected
    assert cleared >= (0.0 if buckets else 0.5) * healthy, (cleared, healthy)
    if world == 2:
        assert "straggler" in judged_kinds, judged_kinds


def test_grad_growth_band_holds_for_every_step_it_covers_at_its_worst():
    """``grad_growth``'s band promise covers several updates: whatever in-band norms come in between, no
    judged window of known and in-band values reaches the warning. Probed at its worst for each step it covers
    (every unknown norm at the end of the band its coefficient in that step's fitted slope picks) and at random
    ends, on rising, flat and noisy windows."""
    import copy

    from vidstab.detectors import GradGrowthDetector

    config = GuardConfig().grad_growth
    rng = random.Random(2)
    bands = probes = 0
    for trial in range(300):
        det = GradGrowthDetector(config)
        drift, noise = rng.choice([0.0, 0.02, 0.05, 0.09]), rng.choice([0.01, 0.05, 0.1, 0.2])
        y = 0.0
        for step in range(config.warmup_steps + rng.randrange(10, 40)):
            y += drift + rng.gauss(0, noise)
            s = StepStats(step=step, grad_norm=math.exp(y), loss=1.0, applied=True)
            if det.observe(s) is None:
                det.update(s)
        band = det._band()
        if band is None:
            continue
        bands += 1
        ((_, lo, hi),), k = band
        n = det.logs.size
        worst = [[hi if n - u + i > (n - 1) / 2 else lo for i in range(u)] for u in range(1, k + 1)]
        for seq in worst + [[rng.choice([lo, hi]) for _ in range(k)] for _ in range(10)]:
            probe = copy.deepcopy(det)
            for j, x in enumerate(seq):
                s = StepStats(step=10**4 + j, grad_norm=x, loss=1.0, applied=True)
                assert probe.observe(s) is None, (trial, j, k, lo, hi)
                probe.update(s)
                probes += 1
    assert bands > 100 and probes > 10000, (bands, probes)
