"""Smoke tests of the benchmarks: the quick subsets run, print one JSON object last, and the key figures
hold (vidstab catches the NaN batch; chaos loses no checkpoint and leaves no run unrecoverable).

Real components throughout: the tiny reference DiT is trained for real (recordings are cached under
``benchmarks/.cache/``, so a second run is faster) and the chaos test kills real trainer processes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _run(script: str, *args: str, timeout: float = 600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


def test_baselines_follow_their_published_rules():
    """Each baseline on a hand-made signal: fires where its source says, and not before."""
    from benchmarks import baselines as B
    from benchmarks.scenarios.recorder import StepRecord

    def rec(step, loss=1.0, g=1.0):
        return StepRecord(step, loss, g, 1e-4, g > 1.0, 10.0, 1e-3, not math.isfinite(loss), False, 3.0, 0, None)

    # Megatron: 100 samples set the max (2.0); 19.9 passes, 20.0 (= 10x) fires.
    m = B.MegatronLargeGrads()
    assert not any(m.observe(rec(i, g=2.0 if i == 50 else 1.0)) for i in range(100))
    assert not m.observe(rec(100, g=19.9)) and m.observe(rec(101, g=20.0))
    # KillLossSpike: only the 5th consecutive loss >= 2x the window mean fires.
    k = B.KillLossSpike()
    for i in range(100):
        assert not k.observe(rec(i, loss=1.0))
    assert [k.observe(rec(100 + i, loss=5.0)) for i in range(5)] == [False, False, False, False, True]
    # OLMo-core: warm-up of 64 steps, then |z| > 6 skips; a NaN loss is skipped too.
    o = B.OLMoSkipStep()
    for i in range(70):
        assert not o.observe(rec(i, loss=1.0 + 0.01 * (i % 3), g=1.0 + 0.01 * (i % 2)))
    assert o.observe(rec(70, loss=2.0)) and o.observe(rec(71, loss=float("nan")))
    # Article A's fixed rule (docs/PRACTICES.md A2) misses nothing non-finite.
    assert B.FixedThreshold().observe(rec(0, g=float("nan"))) and not B.FixedThreshold().observe(rec(0, g=9e3))


def test_vidstab_replay_uses_the_guards_own_statistics_builder():
    """The replay judges the vector a rank packs (vidstab.signals) through the guard's one statistics producer."""
    import torch

    from benchmarks import baselines as B
    from vidstab import signals

    v = B.VidstabReplay()
    w = signals.Window(torch.device("cpu"), v.config.timestep_buckets, 1000, ("latents",))
    x = 2.0 * torch.ones(2, 3)
    w.record(torch.tensor(0.5), {"latents": x}, None, None, False)
    vector = w.pack(torch.tensor(0.7), stop=False, param_sq=None, update_sq=None, loss_scale=None, seconds=-1.0,
                    rank=0).tolist()
    s = v.stats_of_vector(0, vector, lr=1e-4, lr_peak=2e-4, lr_scheduled=1e-4, bucket=w.shape_bucket)
    assert (s.grad_norm, s.loss, s.input_absmax, s.input_rms, s.lr, s.lr_peak, s.lr_scheduled) == pytest.approx(
        (0.7, 0.5, 2.0, 2.0, 1e-4, 2e-4, 1e-4))
    assert s.bucket == "2x3"
    # An LR x10^4 the scheduled one at the first step of a run: refused by lr_bound, no history needed.
    found = v.observe_vector(0, vector, lr=1.0, lr_peak=2e-4, lr_scheduled=1e-4)
    assert any(f.detector == "lr_bound" and f.verdict >= 2 for f in found)
    v.close()


def test_vidstab_replay_of_a_record_reads_back_what_was_recorded():
    """A tuning-split StepRecord made into a vector reads back, through the guard's producer, as recorded."""
    from benchmarks import baselines as B
    from benchmarks.scenarios.recorder import StepRecord

    v = B.VidstabReplay()
    v.observe(StepRecord(0, 0.4, 0.9, 1e-4, False, 10.0, 1e-3, False, False, 3.0, 0, None))  # measures the weights
    r = StepRecord(1, 0.5, 1.5, 1e-4, True, 11.0, 2e-3, False, False, 3.5, 0, None)
    s = v.stats_of_vector(1, v.vector_of_record(r), r.lr, None, None)
    assert (s.loss, s.grad_norm, s.input_absmax, s.param_norm, s.update_ratio) == pytest.approx((0.5, 1.5, 3.5, 10.0, 1e-3))
    assert s.clipped and s.first_bad_rank is None and s.world_size == 1
    bad = StepRecord(2, float("nan"), float("inf"), 1e-4, False, 11.0, 2e-3, True, False, 3.5, 7, None)
    s = v.stats_of_vector(2, v.vector_of_record(bad), bad.lr, None, None)
    assert math.isnan(s.loss) and s.grad_norm == math.inf and s.input_nonfinite == 1
    assert s.first_bad_rank == 0 and s.nonfinite_loss_ranks == [0] and s.nonfinite_input_ranks == [0]


def test_vidstab_replay_skips_a_nan_step():
    from benchmarks import baselines as B
    from benchmarks.scenarios.recorder import StepRecord

    v = B.VidstabReplay()
    for i in range(30):
        assert not v.observe(StepRecord(i, 0.5, 0.5, 1e-4, False, 10.0, 1e-3, False, False, 3.0, 0, None))
    found = v.observe(StepRecord(30, float("nan"), float("nan"), 1e-4, False, 10.0, 1e-3, True, False, 3.0, 12, None))
    assert any(f.detector == "nonfinite" and f.verdict >= 2 for f in found)


def test_bench_detection_quick():
    out = _run("bench_detection.py", "--quick")
    assert out["bench"] == "detection" and out["quick"]
    assert out["healthy_steps"] >= 1000
    # vidstab detects the NaN batch no later than the step it happens (lead >= 0).
    leads = out["scenarios"]["nan_batch"]["vidstab_leads"]
    assert leads and all(x is not None and x >= 0 for x in leads)
    assert out["detectors"]["vidstab"]["detection_rate"] == 1.0
    for name, d in out["detectors"].items():
        assert d["false_alarms_per_1k"] is None or 0 <= d["false_alarms_per_1k"] <= 1000, name
    # The held-out subset: another model family and schedule, an LR bug in a 30-step fine-tune, a x5.5 input.
    held = out["heldout"]["summary"]
    assert held["divergent_runs"] >= 1 and held["detection_rate"] == 1.0
    assert held["max_skips_per_1k_family"] == 0.0  # no SKIP on the healthy held-out runs


def test_bench_escalation_quick():
    """The guarded held-out loop (attach + CheckpointManager + Recovery): an LR ramp that makes the unguarded
    run non-finite is rolled back to a checkpoint from before it, and the run finishes with a finite loss."""
    out = _run("bench_escalation.py", "--quick")
    row = out["scenarios"]["lr_ramp_x1.3"]
    assert row["unguarded_failure_step"] is not None
    v = row["vidstab"]
    assert v["finished"] and v["rollbacks"] >= 1 and all(s <= 40 for s in v["rollback_to"])
    assert isinstance(v["final_loss"], float) and math.isfinite(v["final_loss"])
    assert row["clean_vidstab"]["steps_lost"] == 0  # the clean twin, guarded: no skip, no rollback


def test_heldout_draw_c_scenarios():
    """Draw C: logit growth runs long enough to fail; the small-batch UNet trains on batches of 2."""
    from benchmarks.scenarios import heldout as H
    from vidstab import signals as S

    qk = [r for r in H.fault_runs(seeds=H.DRAW_SEEDS["C"], qk_growth=H.QK_GROWTH_C) + H.logit_growth_runs()
          if r.kind == "qk_growth"]
    assert len(qk) == 4 and all(r.steps == 640 and r.fault.endswith("=0.1") for r in qk)
    assert not set(H.DRAW_SEEDS["C"]) & set(H.DRAW_SEEDS["A"] + H.DRAW_SEEDS["B"] + tuple(range(20)))
    rec = H._run(H.HeldoutRun(H.SMALL_BATCH_FAMILY, "constant_nowarmup", 0, steps=3, tail=0), None)
    L = S.Layout(10)
    assert [v[L.in_numel] for v in rec.vectors] == [2 * 4 * 8 * 8] * 3 and rec.bucket == ["2x4x8x8"] * 3


def test_bench_guard_scale_quick():
    """The scale benchmark runs every world size: the new healthy step's bytes are the same at every size while the
    old gather grows with the world, and both paths name the same bad rank on the anomalous step (no timing
    asserted)."""
    out = _run("bench_guard_scale.py", "--quick")
    assert out["benchmark"] == "guard_scale" and out["worlds"] == [1, 8, 64, 1024, 8192]
    wire = out["bytes_per_rank"]
    assert {b["new_healthy"] for w, b in wire.items() if w != "1"} == {8 * out["width_new"]} and out["bytes_flat_new_healthy"]
    assert wire["1"] == {"new_healthy": 0, "new_anomalous": 0, "old": 0}  # one process: nothing on the wire
    assert wire["8192"]["old"] == 4 * out["width_old"] * 8192 and wire["8"]["old"] == 4 * out["width_old"] * 8
    for world, c in out["checks"].items():
        n = int(world)
        assert c["verdict_new"] == c["verdict_old"] == "SKIP"
        assert c["bad_ranks_new"] == c["bad_ranks_old"] == [n // 2]
        assert c["rows_read_on_anomaly"] is (n > 1) and c["rows_read_on_healthy"] is False  # only on the anomaly
        assert c["healthy_verdict_new"] == "OK" and c["healthy_stats_agree"]  # the baseline reads the same figures
    for figures in out["host_us_median"].values():
        assert set(figures) == {"new_healthy", "new_anomalous", "old_healthy", "old_anomalous"}
        assert all(isinstance(x, float) and x > 0 for x in figures.values())


@pytest.mark.slow
def test_bench_chaos_quick():
    out = _run("bench_chaos.py", "--quick")
    assert out["bench"] == "chaos" and out["reference_finished"]
    assert out["checkpoints_lost"] == 0
    assert out["unrecoverable"] == 0
    assert out["damaged_checkpoints_loaded"] == 0
    assert out["runs_finished"] == out["runs"]
    assert out["steps_without_metrics_line"] == 0  # a kill loses no line of a step a checkpoint covers
    assert out["drills"]["total"] >= 19 and out["drills"]["failed"] == 0, out["drills"]["failed_names"]


def test_clip_rate_rule_separates_mild_from_heavy_clipping():
    """vidstab's clip_rate (adopted from the RESULTS.md proposal): silent at 1.3x max_grad_norm on every
    step, fires once when the median pre-clip norm is >= 2.5x."""
    from benchmarks import baselines as B
    from benchmarks.scenarios.recorder import StepRecord

    def fired(norm: float) -> list[int]:
        v = B.VidstabReplay()
        steps = []
        for i in range(300):
            found = v.observe(StepRecord(i, 0.3, norm, 3e-4, norm > 1.0, 26.0, 1e-3, False, False, 3.0, 0, None))
            steps += [i for f in found if f.detector == "clip_rate"]
        return steps

    assert fired(1.3) == []
    assert len(fired(3.0)) == 1


def test_small_batch_scenario_is_on_the_tuning_split_and_draw_d_is_new():
    """The small-batch defaults are chosen on tuning seeds (0-19); every held-out draw has seeds of its own,
    >= 100, and none uses 105 (the seed that sized the small-batch UNet)."""
    from benchmarks.scenarios import catalogue as C
    from benchmarks.scenarios import heldout as H

    runs = C.small_batch_runs()
    assert {r.family for r in runs} == {H.SMALL_BATCH_FAMILY} and all(r.fault is None for r in runs)
    assert {r.seed for r in runs} == set(C.SMALL_BATCH_SEEDS) <= set(C.HEALTHY_SEEDS)
    assert {r.schedule for r in runs} == set(H.SMALL_BATCH_SCHEDULES) and all(r.steps == H.SMALL_BATCH_STEPS for r in runs)
    seeds = [s for draw in H.DRAW_SEEDS.values() for s in draw]
    assert len(seeds) == len(set(seeds)) and min(seeds) >= 100 and 105 not in seeds
    assert "D" in H.C_SCENARIO_DRAWS


def test_logit_growth_and_family_runs_are_on_the_tuning_split():
    """The logit-growth behaviour of the defaults is chosen on tuning seeds (0-19) at onsets no draw uses; the
    held-out families' healthy tuning runs use tuning seeds too."""
    from benchmarks.scenarios import catalogue as C
    from benchmarks.scenarios import heldout as H

    runs = C.logit_growth_runs()
    assert {r.kind for r in runs} == {"qk_growth"} and {r.family for r in runs} == {"plain_tf_flow"}
    assert {r.seed for r in runs} == set(C.LOGIT_GROWTH_SEEDS) <= set(C.HEALTHY_SEEDS)
    assert not {r.onset for r in runs} & set(H.FAULT_STEPS)
    fam = C.family_healthy_runs()
    assert {r.family for r in fam} == set(H.FAMILIES) and all(r.fault is None for r in fam)
    assert {r.seed for r in fam} <= set(C.HEALTHY_SEEDS)
    assert not {r.seed for r in runs + fam} & {s for draw in H.DRAW_SEEDS.values() for s in draw}


def test_input_drift_runs_are_on_the_tuning_split():
    """input_scale's drift test is chosen on tuning seeds (0-19), at onsets no draw uses, on the three batch-4
    held-out families and every held-out schedule."""
    from benchmarks.scenarios import catalogue as C
    from benchmarks.scenarios import heldout as H

    runs = C.input_drift_runs()
    assert {r.kind for r in runs} == {"input_drift"} and {r.family for r in runs} == set(H.FAMILIES)
    assert {r.seed for r in runs} == set(C.INPUT_DRIFT_SEEDS) <= set(C.HEALTHY_SEEDS)
    assert not {r.onset for r in runs} & set(H.FAULT_STEPS) and {r.schedule for r in runs} == set(H.SCHEDULES)
    assert not {r.seed for r in runs} & {s for draw in H.DRAW_SEEDS.values() for s in draw}
