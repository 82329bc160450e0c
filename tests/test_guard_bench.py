"""Smoke run of the guard overhead benchmark: it runs, counts host reads, and ends with one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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


def test_bench_guard_ddp_measures_the_attached_guard_beside_the_plain_loop_on_two_processes():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_guard_ddp.py"), "--model", "mlp",
                           "--blocks", "4", "--block", "30", "--warmup", "60"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["processes"] == 2 and set(summary["step_median_us"]) == {"plain", "attached"}
    assert summary["guard_in_optimizer_step_median_us"] > 0  # the guard did work inside the user's optimizer.step()
    assert isinstance(summary["findings_by_detector"], dict)  # no timing asserted (nor a straggler on a loaded host)


def test_ablate_guard_detectors_compares_the_defaults_with_a_part_left_out():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ablate_guard_detectors.py"), "--model", "mlp",
                           "--rounds", "5", "--warmup", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    counts = summary["detectors"]
    assert counts["no_detectors"] == 0 and counts["default"] == counts["default_again"] > 10  # every one off vs the defaults
    assert set(summary["us_vs_default"]) == {"default", "default_again", "no_detectors"}
    assert isinstance(summary["detectors_us"], float)  # no timing asserted
