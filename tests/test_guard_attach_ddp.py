"""Two real processes (DDP over gloo on CPU) running a user's unmodified loop after ``vidstab.attach``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_guard_distributed import launch
from vidstab import read_events


def ranks(out):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_nan_on_rank1_skips_in_lockstep_and_a_slow_rank_is_named_not_jitter(tmp_path):
    """One run, 2 processes: every rank jitters 0-10 ms per micro-step; a NaN on rank 1 at step 3; from
    step 14 on rank 1 is 60 ms slower per micro-step. (The straggler rule on 3000 jittery steps: test_detectors.)"""
    launch("attach_ddp.py", "--out", str(tmp_path), "--steps", "26", "--nan_step", "3", "--nan_rank", "1",
           "--slow_rank", "1", "--slow_ms", "60", "--slow_from", "14", "--jitter_ms", "10", timeout=240)
    r0, r1 = ranks(tmp_path)
    strip = lambda rs: [{k: v for k, v in x.items() if k != "incident"} for x in rs]  # noqa: E731
    assert strip(r0["steps"]) == strip(r1["steps"])  # the same decision on every rank, step by step
    s3 = r0["steps"][3]
    assert s3["skipped"] and not s3["applied"] and s3["was_skipped"] and s3["bad_ranks"] == [1]
    assert r0["steps"][3]["epoch"] == r0["steps"][2]["epoch"]  # the user's lr_scheduler.step() was held
    assert r0["steps"][-1]["epoch"] == 2 * 25  # 26 steps, one skipped (Accelerate steps it once per process)
    assert all(x["applied"] for i, x in enumerate(r0["steps"]) if i != 3)
    assert r0["finite"] and r1["finite"] and r0["sha256"] == r1["sha256"]
    # Per-rank logs: rank 0 names rank 1; only rank 1 wrote the bundle (its own model inputs).
    skips = read_events(tmp_path, "skip")
    assert sorted((e["rank"], e["step"], tuple(e["bad_ranks"])) for e in skips) == [(0, 3, (1,)), (1, 3, (1,))]
    assert [(e["rank"], e["step"]) for e in read_events(tmp_path, "incident")] == [(1, 3)]
    assert not r0["steps"][3]["incident"] and r1["steps"][3]["incident"]
    # Jitter alone raised nothing; the straggler is named on every rank, once, with the factor.
    warns = read_events(tmp_path, "warn")
    assert {e["detector"] for e in warns} == {"straggler"} and all(e["step"] >= 14 for e in warns)
    assert sorted(e["rank"] for e in warns) == [0, 1] and all(e["bad_ranks"] == [1] for e in warns)
    assert all(e["figures"]["factor"] > 1.5 for e in warns) and "rank 1" in warns[0]["message"]
    metrics = read_events(tmp_path, "metrics")
    late = {e["rank"]: e["local_seconds"] for e in metrics if e["step"] == 20}
    assert late[1] > late[0] + 0.1  # 2 micro-steps x 60 ms on rank 1, not counted as waiting on rank 0
    # The report's rank table shows each rank's own step time and how much slower it is than the others.
    from vidstab.tools.report import write_report

    page = Path(write_report(tmp_path)).read_text()
    cells = re.findall(r"<td>([0-9.]+) ms \(x([0-9.]+)\)</td>", page)
    assert len(cells) == 2 and float(cells[1][1]) > 1.5 > float(cells[0][1])
