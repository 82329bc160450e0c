#!/usr/bin/env python
"""What closing the incident loop costs: the in-job rerun of a skipped step, against the run's own
healthy step, and the per-step batch fingerprint on the hot path.

Runs the reference trainer on 2 CPU processes three times (no fault; a NaN sample on rank 1 at step 10; one
activation corrupted on rank 1 at step 10, first pass only) and prints, side by side: the median compute time
of a healthy step (``local_seconds``), the rerun's ``seconds`` on each rank, the rerun as a multiple of a
step, and the wall time of each run against the fault-free one. Then times ``batch_crc`` on one micro-step's ids
(what every step pays for the fingerprint its reduction carries). Last line: one JSON object.

    python benchmarks/bench_rerun.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from trainer_utils import events, run_trainers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_rerun-"))
    common = ("--max_train_steps", str(args.steps), "--checkpointing_steps", "1000")
    scenarios = {"baseline": (), "nan_sample": ("--inject_fault", "nan_batch@10:1"),
                 "flaky_activation": ("--inject_fault", "flaky_activation@10:1")}
    out: dict = {"steps": args.steps, "processes": 2, "scenarios": {}}
    for name, fault in scenarios.items():  # one after the other: overlapping runs would distort the times
        started = time.perf_counter()
        run_trainers((work / name, *common, *fault), nproc=2, timeout=900)
        wall = time.perf_counter() - started
        healthy = [m["local_seconds"] for r in (0, 1) for m in events(work / name, r, kind="metrics")
                   if m.get("verdict") == "OK" and m.get("local_seconds")]
        reruns = {r: events(work / name, r, kind="rerun") for r in (0, 1)}
        step_s = statistics.median(healthy)
        row = {"wall_s": round(wall, 2), "median_step_s": round(step_s, 5)}
        if any(reruns.values()):
            row["verdict"] = reruns[0][0]["verdict"]
            row["rerun_s"] = {str(r): reruns[r][0]["seconds"] for r in (0, 1)}
            row["rerun_x_step"] = round(max(row["rerun_s"].values()) / step_s, 2)
        out["scenarios"][name] = row
    base = out["scenarios"]["baseline"]["wall_s"]
    print(f"{'scenario':<18} {'wall s':>8} {'vs base':>8} {'step s':>8} {'rerun s (r0, r1)':>20} {'x step':>7}  verdict")
    for name, row in out["scenarios"].items():
        rr = row.get("rerun_s")
        rerun = f"{rr['0']:.3f}, {rr['1']:.3f}" if rr else "-"
        print(f"{name:<18} {row['wall_s']:>8.2f} {row['wall_s'] / base:>8.2f} {row['median_step_s']:>8.4f} "
              f"{rerun:>20} {row.get('rerun_x_step', '-'):>7}  {row.get('verdict', '-')}")

    import torch

    from vidstab.run.resume_check import batch_crc

    strings = [["shapes-s0-00001", "shapes-s0-00002", "shapes-s0-00003", "shapes-s0-00004"]]
    tensor = [torch.arange(4)]
    none = [None]
    n = 20000
    per_call = {k: timeit.timeit(lambda r=ids: batch_crc(r), number=n) / n * 1e6
                for k, ids in (("4 string ids", strings), ("4 ids as a tensor", tensor), ("no ids", none))}
    print("batch fingerprint per step (us): " + ", ".join(f"{k} {v:.2f}" for k, v in per_call.items()))
    out["fingerprint_us"] = {k: round(v, 3) for k, v in per_call.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
