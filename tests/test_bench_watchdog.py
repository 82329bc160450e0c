"""benchmarks/bench_watchdog.py --quick: the A/B of the watchdog and straggler bookkeeping
runs on 2 real processes and ends with one JSON line; a healthy run has no finding and no hang."""

import json
import math
import os
import subprocess
import sys

from trainer_utils import REPO


def test_bench_watchdog_quick_measures_both_variants_on_two_ranks():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_watchdog.py"), "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["benchmark"] == "watchdog_overhead" and summary["processes"] == 2
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for r in summary["ranks"]:
        assert r["rounds"] >= 20 and set(r["median_step_us"]) == {"guard", "resilient"}
        assert math.isfinite(r["added_us"]) and math.isfinite(r["ratio"])  # figures, not asserted (timing)
    assert summary["findings_on_healthy_steps"] == 0 and summary["watchdog_fired"] is False
