"""Detectors on statistics that are noisier because the batch is tiny (benchmarks/RESULTS.md, "Small-batch
UNet on the tuning split"): each judges against the noise it measures, and a real fault still shows."""

from __future__ import annotations

import math
import random

from vidstab import GuardConfig, StepStats, Verdict
from vidstab.detectors import DETECTORS, Finding, InputScaleConfig
from vidstab.detectors.running import absorb, build_detectors, judge
from vidstab.detectors.input_scale import smooth_window


def run(detectors, seq):
    out = []
    for s in seq:
        judge(detectors, s)
        s.applied = s.verdict < Verdict.SKIP
        absorb(detectors, s)
        out.append((s.step, s.verdict, {f.detector for f in s.findings}))
    return out


def only(*names, **overrides):
    d = {k: {"enabled": k in names} for k in DETECTORS}
    for k, v in overrides.items():
        d[k].update(v)
    return build_detectors(GuardConfig.from_dict(d))


def warned(step, *detectors):
    """A step on which ``detectors`` (run before ``trend``) already warned."""
    s = StepStats(step=step, grad_norm=1.0, loss=1.0)
    s.findings = [Finding(d, Verdict.WARN, f"{d} warned") for d in detectors]
    s.verdict = Verdict.WARN if detectors else Verdict.OK
    return s


def test_trend_rolls_back_only_with_a_warning_about_the_update():
    # Unlucky small batches: loss_spike and input_scale (each judges one batch) warn within 40 steps.
    batch_only = [warned(100, "input_scale"), warned(139, "loss_spike", "grad_growth")]
    assert all(v < Verdict.ROLLBACK for _, v, _ in run(only("trend"), batch_only))
    # The same warnings with one from a detector of the update: a trend of the weights.
    with_witness = [warned(100, "input_scale"), warned(120, "update_ratio"), warned(139, "loss_spike")]
    out = run(only("trend"), with_witness)
    assert out[-2][1] == Verdict.ROLLBACK and "trend" in out[-2][2]
    # witnesses=[]: any two counted detectors on two steps, as before.
    out = run(only("trend", trend={"witnesses": []}), [warned(100, "input_scale"), warned(139, "loss_spike")])
    assert out[-1][1] == Verdict.ROLLBACK


def _batch(step, rng, timesteps, level=1.0, buckets=10):
    """A 2-sample epsilon-loss batch: a sample at t < 100 has 20x the loss of the others; per-bucket means recorded."""
    per = [0.0] * buckets
    cnt = [0] * buckets
    for t in timesteps:
        b = min(buckets - 1, t * buckets // 1000)
        per[b] += level * 0.1 * (20.0 if b == 0 else 1.0) * math.exp(rng.gauss(0, 0.1))
        cnt[b] += 1
    means = [p / c if c else None for p, c in zip(per, cnt)]
    loss = sum(per) / len(timesteps)
    return StepStats(step=step, grad_norm=1.0, loss=loss, timestep_bucket_loss=means)


def test_loss_spike_judges_the_loss_at_the_usual_timestep_mix():
    rng = random.Random(0)
    draws = [[rng.randrange(1000), rng.randrange(1000)] for _ in range(400)]
    draws[300] = [10, 40]  # both samples at t < 100: ~7x the EMA of the raw loss
    seq = [_batch(i, rng, t) for i, t in enumerate(draws)]
    raw = [s.loss for s in seq]
    assert raw[300] > 5 * (sum(raw[250:300]) / 50)
    out = run(only("loss_spike"), seq)
    assert "loss_spike" not in out[300][2]
    # Without the per-timestep losses the same batch is judged raw: flagged, as before.
    bare = [StepStats(step=s.step, grad_norm=1.0, loss=s.loss) for s in seq]
    assert "loss_spike" in run(only("loss_spike"), bare)[300][2]
    # A real fault raises the loss at every timestep: still flagged at once, also on a batch of large t.
    rng = random.Random(1)
    seq = [_batch(i, rng, t) for i, t in enumerate(draws[:300])] + [_batch(300, rng, [900, 950], level=8.0)]
    out = run(only("loss_spike"), seq)
    assert out[300][1] == Verdict.WARN and "loss_spike" in out[300][2]


def test_grad_growth_bar_rises_with_the_measured_noise_and_a_real_run_up_still_warns():
    def noise(n, sigma, seed):
        rng = random.Random(seed)
        return [StepStats(step=i, grad_norm=math.exp(rng.gauss(0, sigma)), loss=1.0) for i in range(n)]

    # Heavy log-norm noise (std 0.45, a batch of two): the fixed x3 bar warns often, the measured one rarely.
    fixed = sum("grad_growth" in n for _, _, n in run(only("grad_growth", grad_growth={"noise_z": 0}), noise(6000, 0.45, 3)))
    measured = sum("grad_growth" in n for _, _, n in run(only("grad_growth"), noise(6000, 0.45, 3)))
    assert measured * 3 <= fixed and fixed >= 3
    # Quiet norms (std 0.05): the bar is min_growth itself, so a x1.2-per-step run-up warns as early as before.
    firsts = []
    for noise_z in (0, 3.5):
        seq = noise(200, 0.05, 4) + [StepStats(step=200 + i, grad_norm=1.2 ** (i + 1), loss=1.0) for i in range(30)]
        out = run(only("grad_growth", grad_growth={"noise_z": noise_z}), seq)
        firsts.append(next(st for st, _, n in out if "grad_growth" in n))
    assert firsts[0] == firsts[1] <= 207  # inside the first window of the run-up
    # After heavy noise the bar is higher, yet a steep run-up (x1.5 per step) is still caught inside a window.
    seq = noise(300, 0.45, 5) + [StepStats(step=300 + i, grad_norm=1.5 ** (i + 1), loss=1.0) for i in range(30)]
    out = run(only("grad_growth"), seq)
    assert any("grad_growth" in n for st, _, n in out if 300 <= st <= 310)


def test_input_scale_window_grows_with_the_dispersion_of_tiny_batches():
    cfg = InputScaleConfig()
    rng = random.Random(0)
    four = [math.exp(rng.gauss(0, 0.12)) for _ in range(20)]  # batches of four images (RESULTS.md: 0.12-0.15)
    two = [math.exp(rng.gauss(0, 0.22)) for _ in range(20)]  # batches of two (0.19-0.22)
    assert smooth_window(four, cfg) == cfg.smooth_steps
    k = smooth_window(two, cfg)
    assert cfg.smooth_steps < k < cfg.max_smooth_steps
    assert smooth_window(two, InputScaleConfig(false_warn_rate=0)) == cfg.smooth_steps
    assert smooth_window([math.exp(rng.gauss(0, 2.0)) for _ in range(20)], cfg) == cfg.max_smooth_steps
    # End to end: healthy tiny batches with log-RMS std 0.22 for 20,000 steps: no warning; then x2.5 from
    # step 20,000: acted on within the (longer) median's half-window.
    seq = [StepStats(step=i, grad_norm=1.0, loss=1.0, input_rms=math.exp(rng.gauss(0, 0.22))) for i in range(20000)]
    seq += [StepStats(step=20000 + i, grad_norm=1.0, loss=1.0, input_rms=2.5 * math.exp(rng.gauss(0, 0.22))) for i in range(20)]
    fixed = sum("input_scale" in n for st, _, n in run(only("input_scale", input_scale={"false_warn_rate": 0}), seq[:20000]))
    seq = [StepStats(**{k: getattr(s, k) for k in ("step", "grad_norm", "loss", "input_rms")}) for s in seq]
    dets = only("input_scale")
    out = run(dets, seq)
    assert dets[0].smooth > cfg.smooth_steps
    sized = sum("input_scale" in n for st, _, n in out if st < 20000)
    assert fixed >= 10 and sized <= 2, (fixed, sized)
    first_act = next(st for st, v, n in out if v >= Verdict.SKIP)
    assert 20000 <= first_act <= 20000 + dets[0].smooth
    # The sized window survives a save and reload.
    again = only("input_scale")
    again[0].load_state_dict(dets[0].state_dict())
    assert again[0].smooth == dets[0].smooth and again[0].recent.size == dets[0].smooth
