"""ETTR of fixed checkpoint intervals against ``auto``, on one scripted failure schedule (a simulation).

A run of ``--steps`` steps of ``--step-seconds`` each saves every k steps (a ``--save-seconds`` stall); failures
come at the same wall-clock times for every configuration (a Poisson process of mean ``--mtbf-hours``, seeded);
each costs ``--restart-seconds`` and the work since the last save. ``auto`` is the real controller
(:class:`vidstab.checkpoint_interval.AutoInterval`) reading the real ledger (:class:`vidstab.goodput.LedgerBuilder`)
fed the run's events as they happen, starting from ``--prior-hours``. Printed: the ETTR of each configuration,
the interval ``auto`` settled on and the formula's value for the true inputs. Last line: one JSON object.

    python benchmarks/bench_goodput.py                   # the CPU drill's measured costs (tests/test_goodput.py)
    python benchmarks/bench_goodput.py --quick           # 5,000 steps
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vidstab.checkpoint_interval import AutoInterval, optimal_interval_seconds  # noqa: E402
from vidstab.goodput import LedgerBuilder  # noqa: E402


class _Ledger:
    """What :class:`AutoInterval` reads: the ledger of the events fed so far (the main process)."""

    main = True

    def __init__(self) -> None:
        self.builder = LedgerBuilder()

    def ledger(self) -> dict:
        return self.builder.result()


def simulate(steps: int, step_s: float, save_s: float, restart_s: float, failures: list[float],
             every: int | None, prior_hours: float) -> dict:
    """One run; ``every=None``: auto. Returns its ETTR and the interval it ended on."""
    book = _Ledger()
    feed = book.builder.feed
    auto = None if every is not None else AutoInterval(book, lambda n: n, first=10, floor=10, ceiling=1_000_000,
                                                       expected_mtbf_hours=prior_hours)
    t, step, saved, fi = 0.0, 0, 0, 0
    feed({"kind": "start", "time": t, "step": 0, "process_started": t})
    while step < steps:
        next_failure = failures[fi] if fi < len(failures) else math.inf
        due = auto.due(step + 1) if auto is not None else (step + 1) % every == 0
        work = step_s + (save_s if due else 0.0)
        if t + work > next_failure:  # lost: this step, and everything since the last save
            feed({"kind": "crash", "time": next_failure, "step": step})
            t, step, fi = next_failure + restart_s, saved, fi + 1
            feed({"kind": "start", "time": t, "step": step, "process_started": next_failure + restart_s / 2})
            feed({"kind": "restart", "time": t, "step": step})
            if auto is not None:
                auto.last_saved = saved
            continue
        t += step_s
        step += 1
        feed({"kind": "metrics", "time": t, "step": step - 1, "applied": True})
        if due:
            t += save_s
            saved = step
            feed({"kind": "checkpoint", "time": t, "step": step, "blocking_seconds": save_s, "blocking_ended": t})
            if auto is not None:
                auto.saved(_NoEvents, step)
    return {"ettr": steps * step_s / t, "interval": auto.steps if auto is not None else every,
            "failures": fi, "ledger_ettr": book.ledger()["ettr"]}


class _NoEvents:
    @staticmethod
    def log(*_args, **_kwargs) -> None:
        pass


def compare(steps: int, step_s: float, save_s: float, restart_s: float, mtbf_s: float, prior_hours: float,
            fixed: list[int], seed: int) -> dict:
    rng = random.Random(seed)
    horizon, failures, t = 20 * steps * step_s + 100 * mtbf_s, [], 0.0
    while t < horizon:
        t += rng.expovariate(1.0 / mtbf_s)
        failures.append(t)
    rows = {str(k): simulate(steps, step_s, save_s, restart_s, failures, k, prior_hours) for k in fixed}
    rows["auto"] = simulate(steps, step_s, save_s, restart_s, failures, None, prior_hours)
    formula = optimal_interval_seconds(save_s, mtbf_s, restart_s) / step_s
    best = max((r["ettr"], k) for k, r in rows.items() if k != "auto")
    return {"rows": rows, "formula_steps": formula, "best_fixed": best[1],
            "auto_minus_best_points": 100 * (rows["auto"]["ettr"] - best[0]),
            "auto_interval_vs_formula": rows["auto"]["interval"] / formula}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--step-seconds", type=float, default=0.09, help="a productive step (default: the drill's)")
    p.add_argument("--save-seconds", type=float, default=0.07, help="the save stall (default: the drill's)")
    p.add_argument("--restart-seconds", type=float, default=22.0, help="cost of a failure (default: the drill's)")
    p.add_argument("--mtbf-hours", type=float, default=0.25, help="mean time between failures of the job")
    p.add_argument("--prior-hours", type=float, default=24.0, help="auto's prior MTBF (expected_mtbf_hours)")
    p.add_argument("--fixed", type=int, nargs="+", default=[5, 20, 100, 500])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="5,000 steps")
    args = p.parse_args(argv)
    steps = 5_000 if args.quick else args.steps
    r = compare(steps, args.step_seconds, args.save_seconds, args.restart_seconds, 3600.0 * args.mtbf_hours,
                args.prior_hours, args.fixed, args.seed)
    for k, v in r["rows"].items():
        print(f"every {k:>5}: ETTR {100 * v['ettr']:6.2f}%  failures {v['failures']:>3}"
              + (f"  (settled on {v['interval']} steps)" if k == "auto" else ""))
    print(f"formula for the true inputs: {r['formula_steps']:.0f} steps; auto settled at "
          f"{r['auto_interval_vs_formula']:.2f}x it; auto - best fixed (every {r['best_fixed']}) = "
          f"{r['auto_minus_best_points']:+.2f} points")
    print(json.dumps({"inputs": {**vars(args), "steps": steps}, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
