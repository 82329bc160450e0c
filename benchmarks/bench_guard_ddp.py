"""Two processes (DDP over gloo on CPU): the guard's work per optimizer step with healthy steps batched, against
every step judged, in one run.

In a run of several processes every step used to be judged (the ``straggler`` detector had no promise); now a
step the promises clear is applied at once on every rank and absorbed later, as on one process
(``vidstab/guard/healthy.py``). One run of ``accelerate launch --multi_gpu --num_processes 2`` trains
``bench_guard_overhead.py``'s model with the attached guard, alternating blocks of ``--block`` steps in each mode
(``guard._batchable`` on and off), so drift and the load of the machine hit both alike. Measured on each rank:
the time of the user's ``optimizer.step()`` minus the optimizer's own step and minus the gather (a collective:
its time is mostly waiting for the other rank), i.e. the guard's own work in that call; the first steps of each
block are left out (the switch). Rank 0 prints the medians and means of both modes side by side; last line one
JSON object.

    python benchmarks/bench_guard_ddp.py                          # transformer, 24 blocks of 60 steps (~1 min)
    python benchmarks/bench_guard_ddp.py --model mlp --blocks 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_guard_overhead as bench  # noqa: E402  (same models, same batches)


def worker(args) -> None:
    from accelerate import Accelerator

    import vidstab
    from vidstab import signals

    torch.set_num_threads(1)
    accelerator = Accelerator()
    factory, shape, description = bench.build(args.model, quick=False)
    model, opt, sched = bench.prepared_training(accelerator, factory)
    guard = vidstab.attach(accelerator, model, opt, sched, run_dir=args.run_dir)
    clock = time.perf_counter_ns
    inner = {"optimizer": 0, "gather": 0}
    optimizer_step, gather_and_read = guard._optimizer_step, signals.gather_and_read

    def timed_optimizer_step(*a, **k):
        t0 = clock()
        out = optimizer_step(*a, **k)
        inner["optimizer"] = clock() - t0
        return out

    def timed_gather(*a, **k):
        t0 = clock()
        out = gather_and_read(*a, **k)
        inner["gather"] = clock() - t0
        return out

    guard._optimizer_step, signals.gather_and_read = timed_optimizer_step, timed_gather  # observing only
    batches = bench.fixed_batches(shape)
    for i in range(args.warmup):
        bench.user_loop_step(accelerator, model, opt, sched, batches[i % len(batches)])
    own = {"batched": [], "judged": []}
    for b in range(args.blocks):
        mode = "batched" if b % 2 == 0 else "judged"
        guard._batchable = mode == "batched"
        for i in range(args.block):
            x, noise, t = batches[i % len(batches)]
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                inner["gather"] = 0
                t0 = clock()
                opt.step()
                took = clock() - t0 - inner["optimizer"] - inner["gather"]
                sched.step()
                opt.zero_grad(set_to_none=True)
            if i >= 5:
                own[mode].append(took / 1e3)
    batched_share = guard.steps_batched / (args.warmup + args.blocks * args.block)
    guard.close()
    if accelerator.is_main_process:
        print(f"{description}, 2 processes (DDP over gloo), {args.blocks} blocks of {args.block} steps; the guard's "
              "work in optimizer.step(), the optimizer's step and the gather left out (us):")
        print(f"{'mode':<10}{'median':>10}{'mean':>10}")
        for mode, values in own.items():
            print(f"{mode:<10}{statistics.median(values):>10.1f}{statistics.fmean(values):>10.1f}")
        print(f"steps applied at once: {batched_share:.1%} of all (half the blocks judge every step)")
        print(json.dumps({"benchmark": "guard_ddp", "model": description, "processes": accelerator.num_processes,
                          "median_us": {m: round(statistics.median(v), 1) for m, v in own.items()},
                          "mean_us": {m: round(statistics.fmean(v), 1) for m, v in own.items()},
                          "steps_batched_share": round(batched_share, 4)}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=["mlp", "transformer"])
    ap.add_argument("--blocks", type=int, default=24, help="blocks of steps, alternately batched and judged")
    ap.add_argument("--block", type=int, default=60, help="steps per block")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run_dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    run_dir = tempfile.mkdtemp(prefix="vidstab-bench-ddp-")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           os.path.abspath(__file__), "--worker", "--run_dir", run_dir, "--model", args.model,
           "--blocks", str(args.blocks), "--block", str(args.block), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(proc.returncode)
    sys.stdout.write(proc.stdout)


if __name__ == "__main__":
    main()
