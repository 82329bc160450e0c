"""Claim: the guard tells a change of bucket (resolution, frame count, batch size) from a fault.

Runs the bucketed workload of ``benchmarks/scenarios/buckets.py`` (a tiny diffusers ``WanTransformer3DModel``,
flow matching, four token-balanced latent buckets, AdamW + warm-up/cosine, clip 1.0, vidstab attached to a
plain Accelerate loop) on the tuning seeds and two held-out draws (``B.SPLITS``), side by side:

* healthy schedules (random bucket mix, low-res -> high-res switch, batch-size switch): SKIP and ROLLBACK
  counts, warnings per 1,000 healthy steps by detector, and the findings within 50 steps of a switch;
* faults inside a bucket (a NaN sample, a one-step LR x1000, latents x5 from then on), in the random mix and
  20 steps after a switch: the guard's verdict at the fault's first step;
* per bucket: the median pre-clip grad norm and the share of steps clipped.

Loops: ``attached`` (the bucket key, if any, left to the guard: derived from the inputs' shapes) always; when
``guard.backward`` takes ``bucket=`` also ``explicit_bucket`` (``guard.backward(loss, batch=..., bucket=KEY)``).
Figures read the guard's ``StepResult`` per step and its event log (``RUN_DIR/vidstab/events-rank0.jsonl``).

    python benchmarks/bench_buckets.py            # about 15 minutes on 2 cores (2 worker processes)
    python benchmarks/bench_buckets.py --quick    # under a minute

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.scenarios import buckets as B  # noqa: E402

HEALTHY_STEPS = 800
FAULT_RUN_STEPS = 300  # the LR schedule's length of a fault run; it stops B.RunSpec.tail steps after the fault
SWITCH_WINDOW = 50  # findings this many steps from a switch count as the switch's alarms
QUICK = {"healthy_steps": 200, "fault_run_steps": 120,
         "splits": {"tuning": B.TUNING_SEEDS[:1], "heldout": B.HELDOUT_SEEDS[:1]}}


def fault_placements(run_steps: int, switch_at: float = 0.5) -> list[tuple[str, B.Fault]]:
    """(schedule, fault) pairs: in the random mix's smallest and largest bucket after the warm-up, and 20 steps
    into the second phase of each switch schedule."""
    after_switch = int(run_steps * switch_at) + 20
    out = []
    for kind in B.FAULTS:
        out += [("random", B.Fault(kind, int(run_steps * 0.4), 0)),
                ("random", B.Fault(kind, int(run_steps * 0.4), len(B.BUCKETS) - 1)),
                ("low_to_high", B.Fault(kind, after_switch, len(B.BUCKETS) - 1)),
                ("batch_switch", B.Fault(kind, after_switch, 1))]
    return out


def plan(quick: bool, loops: list[str]) -> list[tuple[str, str, B.RunSpec]]:
    """``(loop, split, spec)`` of every run."""
    healthy_steps = QUICK["healthy_steps"] if quick else HEALTHY_STEPS
    fault_steps = QUICK["fault_run_steps"] if quick else FAULT_RUN_STEPS
    splits = QUICK["splits"] if quick else B.SPLITS
    placements = fault_placements(fault_steps)
    if quick:
        placements = [p for p in placements if p[0] in ("random", "low_to_high") and p[1].bucket != 0]
    runs = []
    for loop in loops:
        for split, seeds in splits.items():
            for seed in seeds:
                runs += [(loop, split, B.RunSpec(s, seed, healthy_steps, loop=loop)) for s in B.SCHEDULES]
                runs += [(loop, split, B.RunSpec(s, seed, fault_steps, fault=f, loop=loop)) for s, f in placements]
    return runs


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core


def _run_one(spec: B.RunSpec) -> B.RunRecord:
    return B.run(spec)


def _progress(records, total: int, started: float):
    """Pass the records on, a line on stderr every tenth of the runs."""
    for done, record in enumerate(records, 1):
        if done % -(-total // 10) == 0 or done == total:
            print(f"  {done}/{total} runs, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        yield record


def switch_alarms(record: B.RunRecord) -> int:
    """Findings within :data:`SWITCH_WINDOW` steps from the schedule's switch (0 for the random mix)."""
    if record.spec.schedule == "random":
        return 0
    switch = int(record.spec.steps * record.spec.switch_at)
    return sum(len(s.findings) for s in record.steps[switch:switch + SWITCH_WINDOW])


def summarize(runs: list[tuple[str, str, B.RunSpec]], records: list[B.RunRecord]) -> dict:
    out: dict = {}
    for (loop, split, spec), rec in zip(runs, records):
        mine = out.setdefault(loop, {"healthy": {}, "faults": {}, "buckets": {}})
        if spec.fault is None:
            mine["healthy"].setdefault(spec.schedule, {}).setdefault(split, []).append(rec)
        else:
            name = f"{spec.fault.kind} {spec.schedule}/{B.schedule_buckets(spec.schedule)[spec.fault.bucket].key}"
            mine["faults"].setdefault(name, {}).setdefault(split, []).append(rec)
    summary: dict = {}
    for loop, mine in out.items():
        s = summary[loop] = {"healthy": {}, "faults": {}, "buckets": {}}
        for schedule, by_split in mine["healthy"].items():
            for split, recs in by_split.items():
                counts = B.healthy_counts(recs)
                counts["switch_findings"] = sum(switch_alarms(r) for r in recs)
                s["healthy"].setdefault(schedule, {})[split] = counts
        for name, by_split in mine["faults"].items():
            for split, recs in by_split.items():
                verdicts = [B.first_step_verdict(r) for r in recs]
                needed = "WARN" if name.startswith("latents_x5") else "SKIP"
                caught = sum(rank(v["verdict"]) >= rank(needed) for v in verdicts)
                s["faults"].setdefault(name, {})[split] = {
                    "caught_first_step": caught, "runs": len(verdicts), "needed": needed,
                    "verdicts": [v["verdict"] for v in verdicts],
                    "detectors": sorted({d for v in verdicts for d in v["detectors"]}),
                    "findings_before_fault": sum(v["findings_before"] for v in verdicts)}
        for split, recs in mine["healthy"].get("random", {}).items():
            s["buckets"][split] = B.bucket_figures(recs)
    return summary


def rank(verdict: str) -> int:
    return ("OK", "WARN", "SKIP", "ROLLBACK").index(verdict)


def print_tables(summary: dict) -> None:
    for loop, s in summary.items():
        print(f"\n=== loop: {loop} ===")
        print(f"{'healthy schedule':<14} {'split':<8} {'steps':>6} {'SKIP':>5} {'RB':>3} {'warn/1k':>8} "
              f"{'switch+50':>9}  warnings by detector")
        for schedule, by_split in s["healthy"].items():
            for split in B.SPLITS:
                c = by_split.get(split)
                if c:
                    print(f"{schedule:<14} {split:<8} {c['steps']:>6} {c['skip']:>5} {c['rollback']:>3} "
                          f"{c['warn_per_1k']:>8.2f} {c['switch_findings']:>9}  {c['warn_by_detector'] or '-'}")
                    for a in c["alarms"]:
                        if a["kind"] != "warn":
                            print(f"    {a['kind']} seed {a['seed']} step {a['step']}: {a['detector']}: {a['message']}")
        print(f"\n{'fault (schedule/bucket)':<42} " + " ".join(f"{split + ': first-step caught':<32}" for split in B.SPLITS))
        for name, by_split in s["faults"].items():
            cells = []
            for split in B.SPLITS:
                f = by_split.get(split)
                cells.append(f"{f['caught_first_step']}/{f['runs']} >= {f['needed']} {','.join(f['verdicts'])}"
                             if f else "-")
            dets = sorted({d for f in by_split.values() for d in f["detectors"]})
            print(f"{name:<42} " + " ".join(f"{c:<32}" for c in cells) + f" {dets}")
        print("\nper bucket (healthy random mix): median pre-clip grad norm, clip rate (norm > 1.0)")
        keys = [b.key for b in B.BUCKETS]
        print(f"{'split':<8} " + " ".join(f"{k:>22}" for k in keys))
        for split, figs in s["buckets"].items():
            print(f"{split:<8} " + " ".join(
                f"{figs[k]['median_grad_norm']:>10.3f} {100 * figs[k]['clip_rate']:>9.1f}%" if k in figs else f"{'-':>22}"
                for k in keys))


def strip(summary: dict) -> dict:
    """The summary without the alarm lists (the JSON line stays one short object)."""
    out = json.loads(json.dumps(summary))
    for s in out.values():
        for by_split in s["healthy"].values():
            for c in by_split.values():
                c.pop("alarms", None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tuning and one held-out seed, short runs")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--loops", default=None,
                        help="comma-separated: attached, explicit, explicit_bucket (default: attached, and "
                             "explicit_bucket when guard.backward takes bucket=)")
    args = parser.parse_args(argv)
    has_bucket = B.guard_accepts_bucket()
    loops = args.loops.split(",") if args.loops else ["attached"] + (["explicit_bucket"] if has_bucket else [])
    if "explicit_bucket" in loops and not has_bucket:
        parser.error("--loops explicit_bucket: this guard's backward() takes no bucket= keyword")
    runs = plan(args.quick, loops)
    started = time.perf_counter()
    print(f"{len(runs)} runs ({sum(r.steps for _, _, r in runs)} steps at most), loops {loops}, "
          f"guard.backward takes bucket=: {has_bucket}, {args.jobs} worker(s)", flush=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
            records = list(_progress(pool.map(_run_one, [spec for _, _, spec in runs]), len(runs), started))
    else:
        _init_worker()
        records = list(_progress(map(_run_one, [spec for _, _, spec in runs]), len(runs), started))
    seconds = time.perf_counter() - started
    summary = summarize(runs, records)
    print_tables(summary)
    steps = sum(len(r.steps) for r in records)
    print(f"\n{steps} steps in {seconds:.0f} s ({1000 * sum(r.seconds for r in records) / steps:.1f} ms per step "
          f"in a worker)")
    print(json.dumps({"bench": "buckets", "quick": args.quick, "bucket_kwarg": has_bucket, "loops": loops,
                      "seeds": {k: list(v) for k, v in (QUICK["splits"] if args.quick else B.SPLITS).items()},
                      "seconds": round(seconds, 1), "results": strip(summary)}, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
