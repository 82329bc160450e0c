"""ETTR of fixed checkpoint intervals against ``auto``, on one scripted failure schedule (a simulation).

A run of ``--steps`` steps of ``--step-seconds`` each saves every k steps (a ``--save-seconds`` stall); failures
come at the same wall-clock times for every configuration (a Poisson process of mean ``--mtbf-hours``, seeded);
each costs ``--restart-seconds`` and the work since the last save. ``auto`` is the real controller
(:class:`vidstab.run.checkpoint_interval.AutoInterval`) reading the real ledger (:class:`vidstab.run.goodput.LedgerBuilder`)
fed the run's events as they happen, starting from ``--prior-hours``. Printed: the ETTR of each configuration,
the interval ``auto`` settled on and the formula's value for the true inputs. Last line: one JSON object.

``--real``: the same comparison on real runs. The reference trainer (``recipes/train.py``, tiny settings, 2 CPU
processes) runs under the documented elastic launch (``accelerate launch --rdzv_backend c10d --max_restarts N``,
tests/test_resilience.py's ``launch_cmd``) once per interval, and the benchmark SIGKILLs rank 1 on one seeded
schedule: attempt ``i`` is killed once it has executed ``gap[i]`` steps (gaps exponential of mean
``--kill-every-steps``: failures at a known rate per step of compute, the same for every configuration, and
unmoved by the shared machine's load, which changes the seconds a step takes from run to run). The
trainer's own ``kill`` fault fires once per launch and never in a restart, so the schedule's kills come from
outside, with the same signal. ``--kill-every-seconds S`` kills in wall time instead: at seconds after the launch
drawn as a Poisson process of mean ``S`` (the failure model the interval formula assumes, and a cluster's: a kill
can land in a restart). With ``--window-seconds W`` every run lasts W seconds and is then sent SIGTERM (a
scheduler's end of allocation: the trainer saves and stops), so every row meets the same kills over the same
time, where with ``--steps`` a row that is faster, or lucky, finishes before a kill that another row meets. Each
row's ETTR and buckets are its run's ledger (``vidstab goodput RUN --json``); ``auto``'s row adds the interval
it settled on and the formula's value for its run's measured inputs.

    python benchmarks/bench_goodput.py                   # the CPU drill's measured costs (tests/test_goodput.py)
    python benchmarks/bench_goodput.py --quick           # 5,000 steps
    python benchmarks/bench_goodput.py --real            # real runs: 1,200 steps, every 20/100/400 and auto,
                                                         # a kill every 400 steps (about 8 min on 2 CPU cores)
    python benchmarks/bench_goodput.py --real --prior-hours-real 0.0025   # and auto with that prior
    python benchmarks/bench_goodput.py --real --seeds 1 2 --steps 2400 --fixed 20 50 100 400 --timeout 900
                                   # two schedules, pooled: ETTR, and the runs' counts priced at pooled costs
    python benchmarks/bench_goodput.py --real --seeds 1 2 --fixed 20 50 100 400 --timeout 400 \
        --kill-every-seconds 40 --window-seconds 240    # kills in wall time, every run 240 s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vidstab.run.checkpoint_interval import AutoInterval, optimal_interval_seconds  # noqa: E402
from vidstab.run.goodput import LedgerBuilder  # noqa: E402


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
            "failures": fi, "ledger_ettr": book.ledger()["ettr"], "rework_steps": book.ledger()["steps"]["rework"]}


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


def kill_gaps(mean_steps: float, seed: int, count: int) -> list[int]:
    """Steps each attempt executes before its rank 1 is killed (the schedule; at least 1)."""
    rng = random.Random(seed)
    return [max(1, round(rng.expovariate(1.0 / mean_steps))) for _ in range(count)]


def kill_times(mean_seconds: float, seed: int, count: int) -> list[float]:
    """Seconds after the launch at which rank 1 is killed (a Poisson process in wall time: restarts included)."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(1.0 / mean_seconds)
        times.append(round(t, 1))
    return times


class Schedule:
    """The kills of one seed: after ``gaps[i]`` steps of attempt ``i`` (``unit`` "steps"), or at ``gaps[i]``
    seconds of wall time after the launch (``unit`` "seconds": whatever is running then, a restart included)."""

    def __init__(self, unit: str, mean: float, seed: int, count: int = 40) -> None:
        self.unit, self.mean = unit, mean
        self.gaps = kill_gaps(mean, seed, count) if unit == "steps" else kill_times(mean, seed, count)

    def due(self, kills: int, attempt_steps: int, seconds: float) -> bool:
        if kills >= len(self.gaps):
            return False
        return (attempt_steps if self.unit == "steps" else seconds) >= self.gaps[kills]

    def formula_steps(self, save: float, step: float, restart: float) -> float:
        """The formula's interval in steps for this schedule's true failure rate: the time between failures is
        the mean gap's steps of compute plus a failure's cost (steps), or the mean gap itself (seconds)."""
        mtbf = self.mean * step + restart if self.unit == "steps" else self.mean
        return optimal_interval_seconds(save, mtbf, restart) / step


class _NewLines:
    """The complete lines appended to a JSONL file since the last call (a killed writer may leave a torn one)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def __call__(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def _worker(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's live worker process of ``rank`` (torch elastic sets RANK in its environment)."""
    import psutil

    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and child.status() != psutil.STATUS_ZOMBIE:
                return child.pid
        except psutil.Error:
            pass
    return None


def real_run(out: Path, every: str, steps: int, schedule: Schedule, prior_hours: float | None,
             timeout: float, window: float | None = None) -> dict:
    """One launch of the reference trainer, its rank 1 killed on ``schedule``; returns its ledger row. ``window``:
    the launch runs that many seconds and is then sent SIGTERM (a scheduler's end of allocation: it saves and
    stops), ``steps`` ignored."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_resilience import launch_cmd, launch_env

    steps = 10**8 if window else steps
    args = ["--max_train_steps", str(steps), "--checkpointing_steps", every, "--goodput_steps", "0"]
    if prior_hours is not None:
        args += ["--expected_mtbf_hours", str(prior_hours)]
    cmd = launch_cmd(out, *args, max_restarts=len(schedule.gaps) + 1, resume=False)
    log = out.parent / f"{out.name}.log"
    launched = time.monotonic()
    deadline, kills, starts, done, last_step = launched + timeout, [], 0, 0, -1
    ended = False
    new_lines = _NewLines(out / "vidstab" / "events-rank0.jsonl")
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"every {every}: still running after {timeout:.0f} s (log: {log})")
                for e in new_lines():
                    if e.get("kind") == "start":
                        starts, done = starts + 1, 0
                    elif e.get("kind") == "metrics":
                        last_step = max(last_step, int(e["step"]))
                        done += starts == len(kills) + 1  # a step of the attempt the next kill is for
                training = last_step < steps - 1  # no kill once the last step is done: the run is ending
                if window and not ended and time.monotonic() - launched >= window:
                    proc.send_signal(signal.SIGTERM)  # torch elastic forwards it: the workers save and stop
                    ended = True
                if training and not ended and schedule.due(len(kills), done, time.monotonic() - launched):
                    pid = _worker(proc.pid, 1)  # none between attempts: the kill waits for the next one
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"time": time.time(), "at_step": last_step, "attempt_steps": done})
                        done = 0
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0 and not (ended and proc.returncode in (1, 128 + signal.SIGTERM, -signal.SIGTERM)):
        raise RuntimeError(f"every {every}: the launch exited {proc.returncode}; see {log}")
    cli = subprocess.run([sys.executable, "-m", "vidstab", "goodput", str(out), "--json"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    led = json.loads(cli.stdout)
    changes = [e for e in _NewLines(out / "vidstab" / "events-rank0.jsonl")() if e.get("kind") == "checkpoint_interval"]
    formula = led["interval"]
    return {"ettr": led["ettr"], "wall_seconds": led["wall_seconds"], "buckets": led["buckets"],
            "steps": led["steps"], "restarts": led["restarts"], "kills": len(kills), "saves": led["counts"]["checkpoint"],
            "first_startup": led["attempts"][0]["buckets"]["startup"],
            "failure_seconds": sum(led["buckets"][b] for b in ("restart", "hang", "rollback"))
            + sum(a["buckets"]["startup"] for a in led["attempts"][1:]),
            "killed_at_steps": [k["at_step"] for k in kills],
            "interval": changes[-1]["steps"] if changes else None,
            "interval_changes": [(e["step"], e["steps"]) for e in changes],
            "formula_steps": None if formula is None else formula["interval_steps"], "measured": formula}


def compare_real(steps: int, fixed: list[int], schedule: Schedule, priors: list[float | None],
                 work: Path, timeout: float, window: float | None = None) -> dict:
    """Every fixed interval, then ``auto`` with each prior (None: the trainer's default), on one kill schedule."""
    import shutil

    work.mkdir(parents=True, exist_ok=True)
    runs = [(str(k), str(k), None) for k in fixed] + [
        ("auto" if prior is None else f"auto, prior {prior:g} h", "auto", prior) for prior in priors]
    rows = {}
    for name, every, prior in runs:
        out = work / f"every-{len(rows)}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.monotonic()
        rows[name] = real_run(out, every, steps, schedule, prior, timeout, window)
        rows[name]["run_seconds"] = time.monotonic() - started
        _print_real_row(name, rows[name])
    best = max((r["ettr"], k) for k, r in rows.items() if not k.startswith("auto"))
    formula = schedule_formula_steps(rows, schedule)
    autos = {k: {"minus_best_points": 100 * (r["ettr"] - best[0]), "interval": r["interval"],
                 "formula_steps": r["formula_steps"],
                 "interval_vs_formula": r["interval"] / r["formula_steps"] if r["interval"] and r["formula_steps"]
                 else None, "interval_vs_schedule_formula": r["interval"] / formula if r["interval"] else None}
             for k, r in rows.items() if k.startswith("auto")}
    return {"rows": rows, f"kill_schedule_{schedule.unit}": schedule.gaps, "best_fixed": best[1],
            "best_fixed_ettr": best[0], "schedule_formula_steps": formula, "auto": autos}


def pool(runs: list[dict], schedule: Schedule) -> dict:
    """Every seed's rows together, per configuration: ETTR as the sum of productive over the sum of wall time,
    the kills, and ``ettr_at_pooled_costs``: each run's own counts (kept and redone steps, saves, kills) priced
    at the costs pooled over every run (step, save stall, failure, first start-up, the rest), so that the
    shared machine's load, which moves start-up and restarts by up to 2x between runs, drops out of the
    comparison and what is left is what the interval trades (with ``--window-seconds`` it does not: the steps a run
    keeps are then what its restarts left it); and ``traded_seconds``, the seconds the interval itself trades
    (rework and the save stall, from the ledgers)."""
    every = [r for run in runs for r in run["rows"].values()]
    kept = sum(r["steps"]["productive"] for r in every)
    step = sum(r["buckets"]["productive"] for r in every) / kept
    save = sum(r["buckets"]["checkpoint"] for r in every) / max(1, sum(r["saves"] for r in every))
    failure = sum(r["failure_seconds"] for r in every) / max(1, sum(r["restarts"] for r in every))
    first = sum(r["first_startup"] for r in every) / len(every)
    traded = ("productive", "rework", "checkpoint", "restart", "hang", "rollback", "startup")
    rest = sum(r["wall_seconds"] - sum(r["buckets"][b] for b in traded) for r in every) / len(every)
    out = {}
    for name in runs[0]["rows"]:
        rows = [run["rows"][name] for run in runs]
        useful = sum(r["steps"]["productive"] for r in rows) * step
        priced = useful + sum(r["steps"]["rework"] * step + r["saves"] * save + r["restarts"] * failure
                              + first + rest for r in rows)
        out[name] = {"ettr": sum(r["buckets"]["productive"] for r in rows) / sum(r["wall_seconds"] for r in rows),
                     "ettr_at_pooled_costs": useful / priced, "kills": sum(r["kills"] for r in rows),
                     "traded_seconds": sum(r["buckets"]["rework"] + r["buckets"]["checkpoint"] for r in rows),
                     "rework_steps": sum(r["steps"]["rework"] for r in rows),
                     "saves": sum(r["saves"] for r in rows), "intervals": [r["interval"] for r in rows]}
    fixed = [k for k in out if not k.startswith("auto")]
    for key in ("ettr", "ettr_at_pooled_costs"):
        best = max(fixed, key=lambda k: out[k][key])
        for name in out:
            if name.startswith("auto"):
                out[name][f"minus_best_points ({key})"] = 100 * (out[name][key] - out[best][key])
                out[name][f"best_fixed ({key})"] = best
    rows = {f"{i}:{k}": r for i, run in enumerate(runs) for k, r in run["rows"].items()}
    return {"rows": out, "costs": {"step_seconds": step, "save_seconds": save, "failure_seconds": failure,
                                   "first_startup_seconds": first, "rest_seconds": rest},
            "schedule_formula_steps": schedule_formula_steps(rows, schedule)}


def schedule_formula_steps(rows: dict, schedule: Schedule) -> float:
    """The formula's interval in steps for the schedule's true failure rate and the costs pooled over every run
    (mean save stall, step and failure cost measured by the ledgers)."""
    measured = [r["measured"] for r in rows.values() if r["measured"]]
    failed = [m["restart_seconds"] for m in measured if m["failures"]]
    save = sum(m["save_seconds"] for m in measured) / len(measured)
    step = sum(m["step_seconds"] for m in measured) / len(measured)
    restart = sum(failed) / len(failed) if failed else 0.0
    return schedule.formula_steps(save, step, restart)


def _print_real_row(every: str, r: dict) -> None:
    b = r["buckets"]
    print(f"every {every:>18}: ETTR {100 * r['ettr']:6.2f}%  wall {r['wall_seconds']:6.1f} s  kills {r['kills']}  "
          f"productive {b['productive']:5.1f}  checkpoint {b['checkpoint']:4.1f}  rework {b['rework']:5.1f}  "
          f"restart+startup {b['restart'] + b['startup']:5.1f} s  formula {r['formula_steps']} steps"
          + (f"  (settled on {r['interval']} steps; changes {r['interval_changes']})"
             if every.startswith("auto") else ""),
          flush=True)


def main_real(args) -> int:
    started = time.monotonic()
    priors = [None, *(args.prior_hours_real or [])]
    seeds, runs = args.seeds or [args.seed], []
    for seed in seeds:
        work = Path(args.work) if len(seeds) == 1 else Path(args.work) / f"seed-{seed}"
        print(f"seed {seed}:", flush=True)
        schedule = (Schedule("seconds", args.kill_every_seconds, seed) if args.kill_every_seconds
                    else Schedule("steps", args.kill_every_steps, seed))
        r = compare_real(args.steps, args.fixed, schedule, priors, work, args.timeout, args.window_seconds)
        runs.append(r)
        unit = "seconds after the launch" if schedule.unit == "seconds" else "steps each attempt executes before its kill"
        print(f"kill schedule ({unit}): {schedule.gaps[:12]} ...")
        for name, a in r["auto"].items():
            ratio = a["interval_vs_formula"]
            print(f"{name}: settled on {a['interval']} steps, the formula for its run's measured inputs "
                  f"{a['formula_steps']} steps ({'n/a' if ratio is None else f'{ratio:.2f}x'}); minus best fixed "
                  f"(every {r['best_fixed']}) = {a['minus_best_points']:+.2f} points; the formula for the "
                  f"schedule's true rate and this seed's pooled costs: {r['schedule_formula_steps']:.0f} steps "
                  f"({a['interval_vs_schedule_formula'] or float('nan'):.2f}x)", flush=True)
    pooled = pool(runs, schedule)
    print(f"pooled over seeds {seeds} (costs: {', '.join(f'{k} {v:.3f}' for k, v in pooled['costs'].items())}); "
          f"the formula for the schedule's rate and these costs: {pooled['schedule_formula_steps']:.0f} steps")
    formula = pooled["schedule_formula_steps"]
    for name, row in pooled["rows"].items():
        print(f"every {name:>18}: ETTR {100 * row['ettr']:6.2f}%  at pooled costs "
              f"{100 * row['ettr_at_pooled_costs']:6.2f}%  traded (rework + save stall) {row['traded_seconds']:6.1f} s"
              f"  kills {row['kills']:>3}  redone steps "
              f"{row['rework_steps']:>5}  saves {row['saves']:>4}"
              + (f"  settled on {row['intervals']} steps "
                 f"({', '.join(f'{i / formula:.2f}x' for i in row['intervals'] if i)}); "
                 f"minus best fixed: {row['minus_best_points (ettr)']:+.2f} points (every "
                 f"{row['best_fixed (ettr)']}), at pooled costs {row['minus_best_points (ettr_at_pooled_costs)']:+.2f}"
                 f" (every {row['best_fixed (ettr_at_pooled_costs)']})" if name.startswith("auto") else ""))
    print(f"{time.monotonic() - started:.0f} s")
    print(json.dumps({"inputs": {**vars(args)}, "seconds": time.monotonic() - started, "pooled": pooled,
                      "seeds": dict(zip(map(str, seeds), runs))}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="default: 20,000 (--real: 1,200)")
    p.add_argument("--step-seconds", type=float, default=0.09, help="a productive step (default: the drill's)")
    p.add_argument("--save-seconds", type=float, default=0.07, help="the save stall (default: the drill's)")
    p.add_argument("--restart-seconds", type=float, default=22.0, help="cost of a failure (default: the drill's)")
    p.add_argument("--mtbf-hours", type=float, default=0.25, help="mean time between failures of the job")
    p.add_argument("--prior-hours", type=float, default=24.0, help="auto's prior MTBF (expected_mtbf_hours)")
    p.add_argument("--fixed", type=int, nargs="+", default=None, help="default: 5 20 100 500 (--real: 20 100 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="--real: one run per configuration per seed, then the rows pooled over the seeds")
    p.add_argument("--quick", action="store_true", help="5,000 steps")
    real = p.add_argument_group("--real: real runs and real kills")
    real.add_argument("--real", action="store_true", help="run the reference trainer instead of the simulation")
    real.add_argument("--kill-every-steps", type=float, default=400.0,
                      help="mean steps an attempt executes before the schedule kills it")
    real.add_argument("--kill-every-seconds", type=float, default=None,
                      help="instead: kills at seconds of wall time after the launch, exponential gaps of this "
                           "mean (a Poisson process in wall time, as a cluster's failures: a restart can be killed)")
    real.add_argument("--prior-hours-real", type=float, nargs="+", default=None,
                      help="besides auto with the trainer's default prior, auto with each of these "
                           "--expected_mtbf_hours")
    real.add_argument("--window-seconds", type=float, default=None,
                      help="instead of --steps: every run lasts this many seconds of wall time, then SIGTERM (it "
                           "saves and stops): every row exposed to the same kills for the same time")
    real.add_argument("--work", default="/tmp/bench_goodput_real", help="where the real runs' folders go")
    real.add_argument("--timeout", type=float, default=400.0, help="seconds one real run may take")
    args = p.parse_args(argv)
    if args.real:
        args.steps, args.fixed = args.steps or 1200, args.fixed or [20, 100, 400]
        return main_real(args)
    args.steps, args.fixed = args.steps or 20_000, args.fixed or [5, 20, 100, 500]
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
