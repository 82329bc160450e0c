"""What parts of the guard's step cost: an explicit guard with the defaults against the same guard without
one part, on one model, paired per round.

Three explicit guards (``vidstab.Guard``) train ONE model, optimizer and scheduler of ``bench_guard_overhead.py``'s
size classes: ``default`` twice (the second, ``default_again``, is the A/A noise floor) and ``no_detectors``
(every detector's ``enabled=False``). Each round runs one step of each in a random order; reported: the median
of the per-round differences of this thread's CPU time to ``default``. ``no_detectors - default`` is what the
detectors add (judging, updates, published thresholds). Last line: one JSON object.

    python benchmarks/ablate_guard_detectors.py                       # transformer, ~1 minute
    python benchmarks/ablate_guard_detectors.py --model mlp --rounds 3000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_guard_overhead as bench  # noqa: E402  (same models, same batches)

import vidstab  # noqa: E402
from vidstab import GuardConfig  # noqa: E402

VARIANTS = ("default", "default_again", "no_detectors")


def every_detector_off() -> GuardConfig:
    """A :class:`vidstab.GuardConfig` with each detector section's ``enabled`` set to False."""
    cfg = GuardConfig()
    sections = [f.name for f in dataclasses.fields(cfg) if hasattr(getattr(cfg, f.name), "enabled")]
    return GuardConfig(**{n: dataclasses.replace(getattr(cfg, n), enabled=False) for n in sections})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=["mlp", "transformer", "dit"])
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=50, help="steps per variant before timing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    factory, shape, description = bench.build(args.model, quick=False)
    accelerator = Accelerator(cpu=True)
    model, opt, sched = bench.prepared_training(accelerator, factory)
    run_dir = tempfile.mkdtemp(prefix="vidstab-ablate-")
    off = every_detector_off()
    guards = {name: vidstab.Guard(accelerator, model, opt, sched, config=off if name == "no_detectors" else None,
                                  run_dir=os.path.join(run_dir, name)) for name in VARIANTS}
    batches = bench.fixed_batches(shape)

    def one_step(name: str, i: int) -> None:
        guard = guards[name]
        x, noise, t = batches[i % len(batches)]
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
            guard.backward(loss, batch={"latents": x})
            guard.step(max_grad_norm=1.0)

    for i in range(args.warmup):
        for name in VARIANTS:
            one_step(name, i)
    cpu = {name: [] for name in VARIANTS}
    shuffler = random.Random(0)
    for r in range(args.rounds):
        for name in shuffler.sample(VARIANTS, len(VARIANTS)):
            c0 = time.thread_time_ns()
            one_step(name, r)
            cpu[name].append(time.thread_time_ns() - c0)
    for guard in guards.values():
        guard.close()
    default_ms = statistics.median(cpu["default"]) / 1e6
    diff_us = {name: statistics.median((a - b) / 1e3 for a, b in zip(cpu[name], cpu["default"])) for name in VARIANTS}
    detectors = {name: len(guards[name].detectors) for name in VARIANTS}
    print(f"{description}, {args.rounds} rounds; guarded step with the default detectors {default_ms:.3f} ms (thread CPU)")
    print(f"{'variant':<16}{'detectors':>10}{'us vs default (median)':>26}")
    for name in VARIANTS:
        print(f"{name:<16}{detectors[name]:>10}{diff_us[name]:>+26.1f}")
    print(f"the detectors cost {-diff_us['no_detectors']:.1f} us per step (A/A {diff_us['default_again']:+.1f} us)")
    print(json.dumps({"benchmark": "ablate_guard_detectors", "model": description, "rounds": args.rounds,
                      "default_step_ms": round(default_ms, 3), "detectors": detectors,
                      "us_vs_default": {k: round(v, 1) for k, v in diff_us.items()},
                      "detectors_us": round(-diff_us["no_detectors"], 1)}))


if __name__ == "__main__":
    main()
