"""Two processes (DDP over gloo on CPU): the attached guard's cost per optimizer step beside the plain loop, in one run.

One run of ``accelerate launch --multi_gpu --num_processes 2`` trains ``bench_guard_overhead.py``'s model with the
user's own loop (``bench_guard_overhead.user_loop_step``), alternating blocks of ``--block`` steps with the guard
attached (``guard.wrap()``) and detached (``guard.detach()``: the plain loop), so drift and the load of the machine
hit both alike; the first steps of each block are left out (the switch). Measured on each rank, with public hooks
only: the wall time of the whole step in both modes, and in the attached blocks the time of the user's
``optimizer.step()`` minus the optimizer's own step (timed by ``torch.optim.Optimizer.register_step_pre_hook`` /
``register_step_post_hook``), i.e. the guard's work in that call: packing, the two fixed-size all_reduces (which
include waiting for the other rank) and the one host read, judging, reporting. Rank 0 prints the medians and means
side by side. ``--baseline_src DIR`` runs the same measurement a second time with the ``vidstab`` package of
``DIR`` (a checkout of an older revision: ``git worktree add /tmp/old REV``) and prints both side by side. Last line
one JSON object.

    python benchmarks/bench_guard_ddp.py                          # transformer, 24 blocks of 60 steps (~1 min)
    python benchmarks/bench_guard_ddp.py --model mlp --blocks 40
    python benchmarks/bench_guard_ddp.py --baseline_src /tmp/old  # this tree's guard beside an older revision's
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

MODES = ("plain", "attached")


def worker(args) -> None:
    from accelerate import Accelerator

    import vidstab

    torch.set_num_threads(1)
    accelerator = Accelerator()
    factory, shape, description = bench.build(args.model, quick=False)
    model, opt, sched = bench.prepared_training(accelerator, factory)
    guard = vidstab.attach(accelerator, model, opt, sched, run_dir=args.run_dir)
    clock = time.perf_counter_ns
    inner = {"start": 0, "optimizer": 0}
    torch_optimizer = getattr(opt, "optimizer", opt)  # Accelerate's wrapper steps the torch optimizer inside

    def before_step(*_):
        inner["start"] = clock()

    def after_step(*_):
        inner["optimizer"] = clock() - inner["start"]

    handles = [torch_optimizer.register_step_pre_hook(before_step), torch_optimizer.register_step_post_hook(after_step)]
    batches = bench.fixed_batches(shape)
    for i in range(args.warmup):
        bench.user_loop_step(accelerator, model, opt, sched, batches[i % len(batches)])
    step_us = {m: [] for m in MODES}
    own_us = []
    for b in range(args.blocks):
        mode = MODES[b % 2]
        if mode == "attached":
            guard.wrap()
        else:
            guard.detach()
        for i in range(args.block):
            x, noise, t = batches[i % len(batches)]
            t_step = clock()
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                inner["optimizer"] = 0
                t0 = clock()
                opt.step()
                took = clock() - t0 - inner["optimizer"]
                sched.step()
                opt.zero_grad(set_to_none=True)
            total = clock() - t_step
            if i >= 5:
                step_us[mode].append(total / 1e3)
                if mode == "attached":
                    own_us.append(took / 1e3)
    for h in handles:
        h.remove()
    findings: dict[str, int] = {}
    for e in vidstab.read_events(args.run_dir):
        if e["kind"] in ("warn", "skip", "rollback_request"):
            findings[e.get("detector", "?")] = findings.get(e.get("detector", "?"), 0) + 1
    guard.close()
    if accelerator.is_main_process:
        med = {m: statistics.median(v) for m, v in step_us.items()}
        print(f"{description}, 2 processes (DDP over gloo), {args.blocks} blocks of {args.block} steps, alternately "
              "plain and attached (us per optimizer step, rank 0):")
        print(f"{'':<44}{'median':>10}{'mean':>10}")
        for m in MODES:
            print(f"{'whole step, ' + m:<44}{med[m]:>10.1f}{statistics.fmean(step_us[m]):>10.1f}")
        print(f"{'guard in optimizer.step() (optimizer left out)':<44}{statistics.median(own_us):>10.1f}"
              f"{statistics.fmean(own_us):>10.1f}")
        print(f"attached / plain (medians): {med['attached'] / med['plain']:.3f}; findings on healthy steps: {findings or 'none'}")
        print(json.dumps({"benchmark": "guard_ddp", "vidstab": os.path.dirname(os.path.dirname(vidstab.__file__)), "model": description, "processes": accelerator.num_processes,
                          "step_median_us": {m: round(v, 1) for m, v in med.items()},
                          "step_mean_us": {m: round(statistics.fmean(v), 1) for m, v in step_us.items()},
                          "guard_in_optimizer_step_median_us": round(statistics.median(own_us), 1),
                          "guard_in_optimizer_step_mean_us": round(statistics.fmean(own_us), 1),
                          "ratio_of_medians": round(med["attached"] / med["plain"], 4),
                          "findings_on_healthy_steps": sum(findings.values()), "findings_by_detector": findings}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=["mlp", "transformer"])
    ap.add_argument("--blocks", type=int, default=24, help="blocks of steps, alternately plain and attached")
    ap.add_argument("--block", type=int, default=60, help="steps per block")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--baseline_src", default=None,
                    help="a checkout of another revision whose vidstab is measured the same way, side by side")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run_dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs = {"current": None}
    if args.baseline_src:
        runs["baseline"] = os.path.abspath(args.baseline_src)
    results = {}
    for name, src in runs.items():
        stdout = launch(args, src)
        print(f"== {name} ({src or 'this tree'})")
        sys.stdout.write("\n".join(stdout.strip().splitlines()[:-1]) + "\n")
        results[name] = json.loads(stdout.strip().splitlines()[-1])
    if len(results) == 1:
        print(json.dumps(results["current"]))
        return
    cur, base = results["current"], results["baseline"]
    print(f"{'us per step (rank 0)':<44}{'current':>10}{'baseline':>10}")
    for label, key in (("whole step, plain (median)", ("step_median_us", "plain")),
                       ("whole step, attached (median)", ("step_median_us", "attached")),
                       ("guard in optimizer.step() (median)", ("guard_in_optimizer_step_median_us",)),
                       ("guard in optimizer.step() (mean)", ("guard_in_optimizer_step_mean_us",))):
        c, b = cur, base
        for k in key:
            c, b = c[k], b[k]
        print(f"{label:<44}{c:>10.1f}{b:>10.1f}")
    print(json.dumps({"benchmark": "guard_ddp", "processes": cur["processes"], "current": cur, "baseline": base}))


def launch(args, src: str | None) -> str:
    """One 2-process run of :func:`worker` (with the vidstab package of ``src`` first on the path when given)."""
    run_dir = tempfile.mkdtemp(prefix="vidstab-bench-ddp-")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           os.path.abspath(__file__), "--worker", "--run_dir", run_dir, "--model", args.model,
           "--blocks", str(args.blocks), "--block", str(args.block), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(proc.returncode)
    return proc.stdout


if __name__ == "__main__":
    main()
