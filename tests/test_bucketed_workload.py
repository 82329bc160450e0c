"""The guard on a bucketed video-diffusion workload (``benchmarks/scenarios/buckets.py``): a tiny diffusers
``WanTransformer3DModel`` trained for real with flow matching on four token-balanced latent buckets, vidstab
attached to a plain Accelerate loop.

A planned change of bucket (a random mix, a low-res -> high-res switch, a batch-size switch) is neither a
skip nor an alarm, while a fault inside a bucket (a NaN sample, a one-step LR x1000, latents x5) is caught at
its first step. The full figures, on tuning and held-out seeds: ``benchmarks/bench_buckets.py``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.scenarios import buckets as B  # noqa: E402

# One worker for the module: its tests read the same cached runs (under pytest -n 2 each worker would run them again).
pytestmark = pytest.mark.xdist_group("bucketed_workload")

SEED = B.TUNING_SEEDS[0]
HEALTHY_STEPS = 200
FAULT_RUN_STEPS = 120  # switch at step 60; faults at step 100 in the random mix, 80 after the switch
SWITCH_WINDOW = 50
LOOPS = ["attached"] + (["explicit_bucket"] if B.guard_accepts_bucket() else [])


@functools.lru_cache(maxsize=None)
def _run(schedule: str, loop: str, steps: int, fault: B.Fault | None = None) -> B.RunRecord:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return B.run(B.RunSpec(schedule, SEED, steps, fault=fault, loop=loop))
    finally:
        torch.set_num_threads(threads)


def _findings(record: B.RunRecord, start: int = 0, stop: int | None = None) -> list[tuple[int, str, str]]:
    return [(s.step, d, v) for s in record.steps[start:stop] for d, v in s.findings]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("schedule", B.SCHEDULES)
def test_healthy_bucket_schedules_never_skip(schedule, loop):
    record = _run(schedule, loop, HEALTHY_STEPS)
    assert len(record.steps) == HEALTHY_STEPS
    acted = [e for e in record.events if e["kind"] in ("skip", "rollback_request")]
    assert not acted, f"{schedule}: a healthy bucketed run was skipped or rolled back: {acted}"
    assert all(s.verdict in ("OK", "WARN") for s in record.steps)


@pytest.mark.parametrize("loop", LOOPS)
def test_random_bucket_mix_raises_no_alarm(loop):
    record = _run("random", loop, HEALTHY_STEPS)
    assert {s.key for s in record.steps} == {b.key for b in B.BUCKETS}
    assert not _findings(record), f"findings on a healthy random bucket mix: {_findings(record)}"
    assert not record.events


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("schedule", ["low_to_high", "batch_switch"])
def test_a_bucket_switch_raises_no_alarm(schedule, loop):
    record = _run(schedule, loop, HEALTHY_STEPS)
    switch = HEALTHY_STEPS // 2
    assert record.steps[switch - 1].key != record.steps[switch].key
    near = _findings(record, switch, switch + SWITCH_WINDOW)
    assert not near, f"{schedule}: findings within {SWITCH_WINDOW} steps of the switch: {near}"


# Every bucket past its detectors' warm-up (about 25 steps each by step 100 of a four-bucket random mix); a bucket
# still in its warm-up: the last test.
@pytest.mark.parametrize("schedule,at", [("random", 100), ("low_to_high", 80)])
@pytest.mark.parametrize("kind", B.FAULTS)
def test_a_fault_inside_a_bucket_is_caught_at_its_first_step(kind, schedule, at, loop="attached"):
    largest = len(B.BUCKETS) - 1
    record = _run(schedule, loop, FAULT_RUN_STEPS, B.Fault(kind, at, largest))
    first = record.steps[record.fault_step]
    assert first.fault and first.key == B.BUCKETS[largest].key
    assert record.fault_step - record.steps[0].step >= 40  # after every detector's warm-up
    if kind == "latents_x5":
        assert first.findings, f"latents x5 at step {first.step} went unnoticed"
    else:
        assert first.verdict in ("SKIP", "ROLLBACK"), f"{kind} at step {first.step}: {first.verdict} {first.findings}"
        assert record.steps[record.fault_step + 1].verdict in ("OK", "WARN")  # the fault lasted one step


@pytest.mark.parametrize("schedule,at", [("low_to_high", FAULT_RUN_STEPS // 2), ("random", 30)])
def test_latents_x5_in_a_bucket_still_in_its_warm_up_is_caught(schedule, at, loop="attached"):
    """The bucket's own statistics cannot judge yet (the first high-res step after the switch; a few steps of the
    random mix's smallest bucket): every bucket's steps do, by the ratio test at a wider ratio."""
    bucket = 0 if schedule == "random" else len(B.BUCKETS) - 1  # the smallest; after the switch, the high-res one
    record = _run(schedule, loop, FAULT_RUN_STEPS, B.Fault("latents_x5", at, bucket))
    first = record.steps[record.fault_step]
    own = sum(s.key == first.key for s in record.steps[:record.fault_step])
    assert first.fault and own < 20, own  # the bucket's detectors are still in their warm-up
    assert first.findings, f"latents x5 at step {first.step}, its bucket's step {own}, went unnoticed"
