"""Smoke run of the guard overhead benchmark: it runs, counts host reads, and ends with one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_guard_overhead_quick():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_guard_overhead.py"), "--quick",
                           "--models", "mlp"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    mlp = summary["models"]["mlp"]
    assert set(mlp["added_ms"]) == {"plain", "attached", "explicit", "seed", "plain_again"}
    reads = mlp["host_reads_per_step"]
    assert reads["attached"] - reads["plain"] == 1 and reads["explicit"] - reads["plain"] == 1  # the one read
    # the per-parameter check: one read per parameter tensor, plus its two finiteness checks
    assert reads["seed"] - reads["plain"] == mlp_tensors(proc.stdout) + 2


def mlp_tensors(stdout: str) -> int:
    line = next(x for x in stdout.splitlines() if x.strip().startswith("mlp:"))
    return int(line.split(" in ")[1].split(" tensors")[0].split()[-1])


def test_profile_guard_step_names_every_piece():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_guard_step.py"), "--steps", "10",
                           "--warmup", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    pieces = summary["pieces_us_median"]
    assert {"Window.record", "Window.pack", "gather + host read", "_build_stats", "_report (+events)",
            "judge grad_spike", "judge clip_rate", "absorb grad_growth", "attach wrapper backward"} <= set(pieces)
    assert all(isinstance(summary[k], float) for k in ("added_us_median", "judge_us", "absorb_us"))  # no timing asserted


def test_guard_step_kinds_labels_the_periodic_work():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "guard_step_kinds.py"), "--model", "mlp",
                           "--rounds", "120", "--warmup", "30"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = summary["kinds"]
    assert "healthy, screened" in kinds and any("weights measured" in k for k in kinds)  # param_norm_every=10
    assert any("batch absorbed" in k for k in kinds)
    assert abs(sum(k["share"] for k in kinds.values()) - 1.0) < 1e-3 and isinstance(summary["median_us"], float)


def test_bench_guard_ddp_runs_both_modes_on_two_processes():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_guard_ddp.py"), "--model", "mlp",
                           "--blocks", "4", "--block", "30", "--warmup", "60"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["processes"] == 2 and set(summary["median_us"]) == {"batched", "judged"}
    assert summary["steps_batched_share"] > 0.2  # healthy steps of a run of two processes are applied at once


def test_ablate_guard_detectors_compares_the_defaults_with_a_part_left_out():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ablate_guard_detectors.py"), "--model", "mlp",
                           "--rounds", "5", "--warmup", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    counts = summary["detectors"]
    assert counts["no_detectors"] == 0 and counts["default"] == counts["default_again"] > 10  # every one off vs the defaults
    assert set(summary["us_vs_default"]) == {"default", "default_again", "no_detectors", "inputs_at_backward"}
    assert isinstance(summary["inputs_at_packing_saves_us"], float)  # no timing asserted
    assert counts["inputs_at_backward"] == counts["default"]


@pytest.mark.parametrize("calls", [[], ["--explicit"]])
def test_compare_guard_revisions_runs_a_revision_beside_the_working_tree(calls):
    """The revision's guard (a ``git archive`` copy) and the working tree's (a copy too), two guards each, guard the
    same model, in the attached loop or through the explicit calls; the script reports every figure for every
    variant (no timing asserted)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no revision to compare with")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare_guard_revisions.py"), "--model", "mlp",
                           "--rounds", "4", "--warmup", "2", *calls], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["explicit"] is bool(calls)
    assert set(summary["step_us_vs_base"]) == {"base", "base_again", "new", "new_again", "plain"}
    guards = {"base", "base_again", "new", "new_again"}  # two per package: each package's code is as warm
    assert set(summary["own_us"]) == guards and all(v > 0 for v in summary["own_us"].values())
    assert set(summary["read_to_step_us"]) == guards and isinstance(summary["own_us_new_vs_base_mean"], float)
