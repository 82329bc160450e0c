"""Where the guard's per-step time goes: each piece of one attached optimizer step, timed on the host.

The small MLP of ``bench_guard_overhead.py`` (the ~3 ms case) runs the user's plain Accelerate loop and the
same loop after ``vidstab.attach``, interleaved one step each per round. Every piece of the guarded step is
wrapped with a ``time.perf_counter_ns`` timer (the wrappers themselves cost ~0.2 us each, included), each
piece's time exclusive of the timed pieces it calls: the attach wrappers (minus the originals they call),
``Window.record``, ``Window.pack``, the gather + host read, ``_build_stats``, every detector's ``observe``
(judge) and ``update`` (absorb), ``_apply`` minus the optimizer step, ``_report`` (events included), the
``StepClock``, the LR figures, and for the batched healthy steps (``vidstab/guard/healthy.py``)
``host_row_values``, ``Screen.clears``, the queueing and the metrics lines of the queued steps (their statistics
and updates are in the pieces above, on the step that absorbs them: medians over steps then show the healthy
step). Printed: per-piece median microseconds per step next to the paired added time of the whole step; last
line one JSON object.

    python benchmarks/profile_guard_step.py                # ~30 s
    python benchmarks/profile_guard_step.py --steps 300    # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_guard_overhead as bench  # noqa: E402  (same model, same batches)

import vidstab  # noqa: E402
from vidstab import signals  # noqa: E402
from vidstab.guard import core  # noqa: E402


class Timers:
    """Exclusive nanoseconds per piece for the current step (its time minus the timed pieces it called, whichever
    they are: a piece such as ``Window.record`` runs inside the backward's wrapper on one micro-step and inside
    the optimizer step's on another); one list entry per step."""

    def __init__(self) -> None:
        self.now: dict[str, int] = defaultdict(int)
        self.steps: dict[str, list[int]] = defaultdict(list)
        self.stack: list[str] = []  # the timed pieces running now, innermost last

    def wrap(self, name: str, fn):
        now, stack = self.now, self.stack
        self.steps[name]  # every piece gets an entry per step (0 on steps it is not called)

        def timed(*a, **k):
            stack.append(name)
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                spent = time.perf_counter_ns() - t0
                stack.pop()
                now[name] += spent
                if stack:
                    now[stack[-1]] -= spent  # the caller's own time excludes this piece
        return timed

    def end_step(self) -> None:
        for k, v in self.steps.items():
            v.append(self.now.get(k, 0))
        self.now.clear()


def instrument(guard, timers: Timers) -> None:
    """Wrap the pieces of ``guard``'s step (instance attributes, and the module functions the guard looks up at
    call time: ``signals.gather_and_read``, ``host_row_values``)."""
    w = timers.wrap
    guard._backward = w("original backward", guard._backward)
    guard._clip = w("original clip_grad_norm_", guard._clip)
    guard._optimizer_step = w("original optimizer.step", guard._optimizer_step)
    guard._scheduler_step = w("original scheduler.step", guard._scheduler_step)
    guard.window.record = w("Window.record", guard.window.record)
    guard.window.pack = w("Window.pack", guard.window.pack)  # more than one process
    guard.window.pack_for_host = w("Window.pack_for_host", guard.window.pack_for_host)  # one process
    for det in guard.detectors:
        det.observe = w(f"judge {det.name}", det.observe)
        if type(det).update is not vidstab.detectors.Detector.update:
            det.update = w(f"absorb {det.name}", det.update)
        if det.screens:  # its promise about the next steps, taken after its update
            det.quiet_bounds = w(f"promise {det.name}", det.quiet_bounds)
    guard._build_stats = w("_build_stats", guard._build_stats)  # also of the queued healthy steps, when absorbed
    guard._report = w("_report (+events)", guard._report)
    guard._log_queued = w("metrics lines of queued steps", guard._log_queued)
    guard._plan.screen.clears = w("Screen.clears", guard._plan.screen.clears)
    guard._apply = w("_apply", guard._apply)
    signals.gather_and_read = w("gather + host read", signals.gather_and_read)
    core.host_row_values = w("host_row_values", core.host_row_values)
    guard._lr.figures = w("LR figures", guard._lr.figures)
    guard._healthy_step = w("_healthy_step (queueing)", guard._healthy_step)
    for name in ("mark", "seconds", "restart"):
        setattr(guard.clock, name, w("StepClock", getattr(guard.clock, name)))
    acc = guard.accelerator
    acc.backward = w("attach wrapper backward", acc.backward)
    acc.clip_grad_norm_ = w("attach wrapper clip_grad_norm_", acc.clip_grad_norm_)
    guard.optimizer.step = w("guarded optimizer.step (rest)", guard.optimizer.step)
    guard.lr_scheduler.step = w("attach wrapper scheduler.step", guard.lr_scheduler.step)


def timer_cost_us(timers_cls=Timers, n: int = 20000) -> float:
    """What one timed call costs on top of the call itself (charged to the piece's parent)."""
    t = timers_cls()
    f = t.wrap("x", lambda: None)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        f()
    timed = time.perf_counter_ns() - t0
    g = lambda: None  # noqa: E731
    t0 = time.perf_counter_ns()
    for _ in range(n):
        g()
    return (timed - (time.perf_counter_ns() - t0)) / n / 1e3


def detectors_warm_and_cold(guard, one_step, rounds: int = 300, promises: bool = True) -> tuple[float, float]:
    """Median microseconds of the detectors' two phases (judge + absorb) on one recorded healthy step,
    run three times in a row (warm CPU caches) and once right after a training step (cold, as in the
    guard's real step): what the cold caches cost, which is why the guard reads the detectors'
    declarations once (``vidstab.detectors.DetectorPlan``) and keeps per-step lookups few.

    ``promises``: through the guard's own plan, whose detectors' promises (``vidstab.detectors.screen``)
    spare the judging of the next steps; False: through a fresh plan on every step, so every detector
    judges (the baseline the promises are measured against)."""
    import copy

    from vidstab.detectors import absorb, judge

    seen = []
    build, batchable = guard._build_stats, guard._batchable
    guard._build_stats = lambda *a, **k: seen.append(build(*a, **k)) or seen[-1]
    guard._batchable = False  # a step judged in full, whose stats are the template
    one_step("attached", 0)
    guard._build_stats, guard._batchable = build, batchable
    template, step = seen[-1], 10**6 * (2 if promises else 1)
    detectors = guard._plan if promises else guard.detectors

    def phases() -> int:
        nonlocal step
        step += 1
        s = copy.copy(template)
        s.step, s.findings, s.applied = step, [], True
        t0 = time.perf_counter_ns()
        judge(detectors, s)
        absorb(detectors, s)
        return time.perf_counter_ns() - t0

    warm, cold = [], []
    for i in range(rounds):
        warm += [phases() for _ in range(3)]
        one_step("plain", i)
        cold.append(phases())
    return statistics.median(warm) / 1e3, statistics.median(cold) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--model", default="mlp", choices=["mlp", "transformer", "dit"], help="bench_guard_overhead's size classes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    factory, shape, description = bench.build(args.model, quick=False)
    run_dir = tempfile.mkdtemp(prefix="vidstab-profile-")
    variants = {}
    for name in ("plain", "attached"):
        accelerator = Accelerator(cpu=True)
        model, opt, sched = bench.prepared_training(accelerator, factory)
        guard = vidstab.attach(accelerator, model, opt, sched, run_dir=run_dir) if name == "attached" else None
        variants[name] = (accelerator, model, opt, sched, guard)
    batches = bench.fixed_batches(shape)

    def one_step(name: str, i: int) -> None:
        accelerator, model, opt, sched, _ = variants[name]
        bench.user_loop_step(accelerator, model, opt, sched, batches[i % len(batches)])

    for i in range(args.warmup):
        one_step("plain", i)
        one_step("attached", i)
    # Before the timers go in: every detector judging, then the guard's own plan (promises kept across steps).
    every_warm_us, every_cold_us = detectors_warm_and_cold(variants["attached"][4], one_step, promises=False)
    warm_us, cold_us = detectors_warm_and_cold(variants["attached"][4], one_step, promises=True)
    timers = Timers()
    instrument(variants["attached"][4], timers)
    for i in range(args.warmup):
        one_step("attached", i)
        timers.end_step()
    for v in timers.steps.values():
        v.clear()
    added, plain_ms = [], []
    for i in range(args.steps):
        order = ("plain", "attached") if i % 2 else ("attached", "plain")
        cpu = {}
        for name in order:
            c0 = time.thread_time_ns()
            one_step(name, i)
            cpu[name] = time.thread_time_ns() - c0
        timers.end_step()
        added.append((cpu["attached"] - cpu["plain"]) / 1e3)
        plain_ms.append(cpu["plain"] / 1e6)
    variants["attached"][4].close()
    exclusive = timers.steps
    # Medians per piece (a loaded machine's preemptions land in means); they need not add up exactly.
    means = {k: statistics.median(v) / 1e3 for k, v in exclusive.items() if not k.startswith("original")}
    wrapped = sum(1 for k in timers.steps if k.startswith(("judge ", "absorb ", "promise "))) + 10
    per_timer = timer_cost_us()
    load = os.getloadavg()[0]
    print(f"{description}, {args.steps} paired steps, load average {load:.1f}; plain step (thread CPU) "
          f"{statistics.median(plain_ms):.2f} ms")
    print(f"{'piece (exclusive, median over steps)':<40}{'us/step':>10}")
    judge_total = sum(v for k, v in means.items() if k.startswith("judge "))
    absorb_total = sum(v for k, v in means.items() if k.startswith(("absorb ", "promise ")))
    for k in sorted(means, key=lambda k: -means[k]):
        print(f"{k:<40}{means[k]:>10.1f}")
    print(f"{'= all detectors judge':<40}{judge_total:>10.1f}")
    print(f"{'= all detectors absorb (+ promises)':<40}{absorb_total:>10.1f}")
    print(f"{'= sum of pieces':<40}{sum(means.values()):>10.1f}")
    print(f"{'  of which timers (~{0} x {1:.2f} us)'.format(wrapped, per_timer):<40}{wrapped * per_timer:>10.1f}")
    print(f"{'paired added step time, thread CPU (median)':<40}{statistics.median(added):>10.1f}")
    print(f"detectors' judge + absorb of one healthy step (no timers), every detector judging -> with the "
          f"detectors' promises: {every_warm_us:.1f} -> {warm_us:.1f} us in a warm loop, "
          f"{every_cold_us:.1f} -> {cold_us:.1f} us right after a training step")
    print(json.dumps({"benchmark": "guard_step_profile", "model": description, "steps": args.steps,
                      "load_average": round(load, 2), "plain_step_cpu_ms": round(statistics.median(plain_ms), 3),
                      "added_us_median": round(statistics.median(added), 1),
                      "pieces_us_median": {k: round(v, 2) for k, v in means.items()},
                      "judge_us": round(judge_total, 1), "absorb_us": round(absorb_total, 1),
                      "timer_us_per_call": round(per_timer, 3),
                      "detectors_warm_us": round(warm_us, 1), "detectors_after_step_us": round(cold_us, 1),
                      "every_detector_warm_us": round(every_warm_us, 1),
                      "every_detector_after_step_us": round(every_cold_us, 1)}))


if __name__ == "__main__":
    main()
