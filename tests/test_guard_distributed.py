"""Two real processes (DDP over gloo on CPU): a NaN batch on rank 1 only must be skipped by every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vidstab import read_events

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def launch(script: str, *args: str, nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu`` on CPU; a hang (the baseline's deadlock) fails instead of blocking."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(SCRIPTS / script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_in_lockstep(tmp_path):
    launch("guard_ddp.py", "--out", str(tmp_path), "--steps", "7", "--nan_step", "2", "--nan_rank", "1",
           "--stop_step", "4", "--stop_rank", "1", "--error_step", "5", "--error_rank", "0")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # Same decisions on every rank, step by step (no rank-local `continue`).
    strip = lambda rs: [{k: v for k, v in x.items() if k not in ("incident", "host_reads")} for x in rs]  # noqa: E731
    assert strip(r0["results"]) == strip(r1["results"])
    s2 = r0["results"][2]
    assert s2["skipped"] and not s2["applied"] and s2["was_skipped"] and s2["bad_ranks"] == [1]
    assert all(x["applied"] for i, x in enumerate(r0["results"]) if i not in (2, 5))
    # The stop requested on rank 1 alone is seen by both ranks at the same step.
    assert [x["stop"] for x in r0["results"]] == [False, False, False, False, True, False, False]
    # An exception caught on rank 0 alone: both ranks get the rollback request at the same step.
    s5 = r0["results"][5]
    assert s5["verdict"] == "ROLLBACK" and s5["rollback"].startswith("exception") and s5["bad_ranks"] == [0]
    assert not s5["applied"]
    # Replicas stayed identical and finite.
    assert r0["finite"] and r1["finite"] and r0["sha256"] == r1["sha256"]
    # Rank 0's log names rank 1 (the quiet error hides on non-zero ranks); only rank 1 captured the batch.
    skip0 = [e for e in read_events(tmp_path, "skip") if e["rank"] == 0]
    assert [(e["step"], e["detector"], e["bad_ranks"]) for e in skip0] == [(2, "nonfinite", [1])]
    incidents = read_events(tmp_path, "incident")
    assert [(e["rank"], e["step"]) for e in incidents] == [(1, 2), (0, 5)]
    assert incidents[0]["sample_ids"] == ["r1-s2-m0-0", "r1-s2-m0-1"]
    assert r0["results"][2]["incident"] is None and r1["results"][2]["incident"] is not None
    # One host read per healthy optimizer step on every rank; a step whose summary shows a bad rank reads every
    # rank's vector once more (and a rank that captures an incident, its micro-steps).
    assert [x["host_reads"] for x in r0["results"] if x["incident"] is None] == [1, 1, 2, 1, 1, 1]
    assert [x["host_reads"] for x in r1["results"] if x["incident"] is None] == [1, 1, 1, 1, 2, 1]
    # Rank 0 logs metrics every step; the other ranks every ``rank_log_every`` steps and on every finding.
    metrics = read_events(tmp_path, "metrics")
    assert sorted({(e["rank"], e["step"]) for e in metrics}) == [(0, s) for s in range(7)] + [(1, 0), (1, 2), (1, 5)]


@pytest.mark.slow
def test_four_ranks_take_the_same_branch_and_name_the_bad_rank(tmp_path):
    """Four processes: a NaN on rank 3, an LR x1000 written into every rank's param_groups, a gradient spike from
    rank 2's batch and an exception on rank 1, each at its own step; every rank reaches the same verdict at every
    step, the bad rank is named, and only it writes the bundle."""
    launch("guard_ddp.py", "--out", str(tmp_path), "--steps", "12", "--nan_step", "2", "--nan_rank", "3",
           "--stop_step", "-1", "--lr_step", "4", "--spike_step", "9", "--spike_rank", "2", "--error_step", "10",
           "--error_rank", "1", nproc=4, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    strip = lambda rs: [{k: v for k, v in x.items() if k not in ("incident", "host_reads")} for x in rs]  # noqa: E731
    assert all(strip(r["results"]) == strip(ranks[0]["results"]) for r in ranks)
    res = ranks[0]["results"]
    verdicts = {i: (x["verdict"], x["bad_ranks"]) for i, x in enumerate(res) if x["verdict"] != "OK"}
    assert verdicts[2] == ("SKIP", [3]) and verdicts[4][0] == "SKIP" and verdicts[9][0] == "SKIP"
    assert 2 in verdicts[9][1] and verdicts[10] == ("ROLLBACK", [1])
    assert set(verdicts) == {2, 4, 9, 10}, verdicts
    assert all(x["applied"] for i, x in enumerate(res) if i not in verdicts)
    assert len({r["sha256"] for r in ranks}) == 1 and all(r["finite"] for r in ranks)
    findings = {(e["step"], e["detector"]) for e in read_events(tmp_path, ("skip", "rollback_request")) if e["rank"] == 0}
    assert {(2, "nonfinite"), (4, "lr_bound"), (9, "grad_spike"), (10, "exception")} <= findings
    incidents = sorted((e["rank"], e["step"]) for e in read_events(tmp_path, "incident"))
    assert (3, 2) in incidents and (1, 10) in incidents and all(r in (1, 2, 3) for r, _ in incidents)
    # Healthy steps read the summary once on every rank; a step with a bad rank also reads every rank's vector.
    assert all(x["host_reads"] == 1 for i, x in enumerate(ranks[0]["results"]) if i not in verdicts)
