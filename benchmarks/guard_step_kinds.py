"""What the median step carries: the attached guard's added time per step, by what the step did besides guarding.

``bench_guard_overhead.py`` gates the median of the per-round paired differences. About a quarter of a healthy
run's steps do periodic work on top of the screened healthy step: the end of a batch of held-back steps
(their statistics, detector updates and metrics lines, ``vidstab/guard/healthy.py``), the weights' and the
update's norms (every ``param_norm_every`` steps, ``vidstab/guard/param_probe.py``), the event log's flush
(every 100 lines or 1 s, ``vidstab/events.py``), a step the promises do not clear (judged in full). With that
many steps above the healthy one, the median of the paired differences sits well above the healthy step's own
added time; this script shows by how much.

The user's plain loop and the same loop after ``vidstab.attach`` (one model, optimizer and scheduler, as in
``bench_guard_overhead.py``), one step each per round in a random order; each attached step is labelled by the
pieces of periodic work it ran (observed by wrapping the guard's methods: the labels cost a few calls on those
steps only). Printed: per label, the share of steps and the median and mean added wall time; then the
overall median and mean. Last line: one JSON object.

    python benchmarks/guard_step_kinds.py                     # transformer, 2,000 rounds (~1 min)
    python benchmarks/guard_step_kinds.py --model mlp --rounds 3000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_guard_overhead as bench  # noqa: E402  (same models, same batches)

import vidstab  # noqa: E402


def label_steps(guard) -> set[str]:
    """Wrap the guard's periodic work so that each piece adds its name to the returned set when it runs."""
    seen: set[str] = set()

    def tag(obj, attr: str, label: str, when=lambda result: True) -> None:
        fn = getattr(obj, attr)

        def tagged(*a, **k):
            result = fn(*a, **k)
            if when(result):
                seen.add(label)
            return result
        setattr(obj, attr, tagged)

    tag(guard, "_absorb_queued", "batch absorbed")
    tag(guard, "_measure_params", "weights measured", when=bool)
    tag(guard.events, "flush", "event log flushed")
    batched = guard._healthy_step

    def healthy(*a, **k):
        seen.add("screened")
        return batched(*a, **k)
    guard._healthy_step = healthy
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=["mlp", "transformer"])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    factory, shape, description = bench.build(args.model, quick=False)
    accelerator = Accelerator(cpu=True)
    model, opt, sched = bench.prepared_training(accelerator, factory)
    guard = vidstab.attach(accelerator, model, opt, sched, run_dir=tempfile.mkdtemp(prefix="vidstab-kinds-"))
    backward, clip, optimizer_step, scheduler_step = guard._backward, guard._clip, guard._optimizer_step, guard._scheduler_step
    hooks = bench.forward_hook_switch(model)
    seen = label_steps(guard)
    batches = bench.fixed_batches(shape)

    def one_step(attached: bool, i: int) -> float:
        x, noise, t = batches[i % len(batches)]
        t0 = time.perf_counter()
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
            (accelerator.backward if attached else backward)(loss)
            (accelerator.clip_grad_norm_ if attached else clip)(model.parameters(), 1.0)
            (opt.step if attached else optimizer_step)()
            (sched.step if attached else scheduler_step)()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for i in range(args.warmup):
        hooks(False)
        one_step(False, i)
        hooks(True)
        one_step(True, i)
    rng = random.Random(0)
    rows = []
    for i in range(args.rounds):
        took, label = {}, ""
        for attached in rng.sample([True, False], 2):
            hooks(attached)
            seen.clear()
            took[attached] = one_step(attached, i)
            if attached:
                periodic = sorted(seen - {"screened"})
                label = " + ".join(periodic) if periodic else ("healthy, screened" if "screened" in seen else "judged")
                if periodic and "screened" not in seen:
                    label += " (judged)"
        rows.append((label, (took[True] - took[False]) * 1e6))
    hooks(True)
    guard.close()
    by_label = defaultdict(list)
    for label, added in rows:
        by_label[label].append(added)
    added = [a for _, a in rows]
    print(f"{description}: the attached guard's added wall time per step (us), {args.rounds} paired rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'what the step did':<60}{'share':>8}{'median':>10}{'mean':>10}")
    kinds = {}
    for label, values in sorted(by_label.items(), key=lambda kv: -len(kv[1])):
        kinds[label] = {"share": round(len(values) / len(rows), 4), "median_us": round(statistics.median(values), 1),
                        "mean_us": round(statistics.fmean(values), 1)}
        print(f"{label:<60}{len(values) / len(rows):>8.1%}{statistics.median(values):>10.1f}{statistics.fmean(values):>10.1f}")
    print(f"{'all steps':<60}{1:>8.0%}{statistics.median(added):>10.1f}{statistics.fmean(added):>10.1f}")
    print(json.dumps({"benchmark": "guard_step_kinds", "model": description, "rounds": args.rounds,
                      "median_us": round(statistics.median(added), 1), "mean_us": round(statistics.fmean(added), 1),
                      "kinds": kinds}))


if __name__ == "__main__":
    main()
