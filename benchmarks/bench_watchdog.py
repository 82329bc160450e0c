#!/usr/bin/env python
"""Claim: the hang watchdog and the straggler bookkeeping keep a healthy guarded run within 1.02x.

The same guarded training step as the reference trainer (``recipes/train.py``'s
``train_step``: ``guard.backward(loss, batch=...)`` + ``guard.step``) on the reference video DiT, in two
variants, on 2 real CPU processes (gloo, DDP) so the straggler detector has ranks to compare:

* ``guard``      - the guard with the ``straggler`` detector off and no watchdog;
* ``resilient``  - the same guard with the ``straggler`` detector on (its default) and a running
  :class:`vidstab.run.watchdog.Watchdog` (its default timeouts, its thread polling once a second), beaten at the
  three phases the trainer reports (``data``, ``forward_backward``, ``guard``).

Each rank's own compute time travels in the vector the guard reduces in both variants (it is part of the guard,
whose own cost ``bench_guard_overhead.py`` measures); what differs is exactly what item 7 asks about. Each
variant has its own model, optimizer and guard. The variants run interleaved, one step each per round in
alternating order (both ranks in the same order, their collectives in step), so drift and the load of a shared
machine hit both alike. Reported per rank: the median step time of each, the median of the per-round paired
difference (wall clock, and this thread's CPU time, which other processes' load inflates least), in
microseconds per step, and the ratio of the medians; the headline is the worse rank. Last line: one JSON object.

    python benchmarks/bench_watchdog.py              # 2 processes, ~1 minute
    python benchmarks/bench_watchdog.py --quick      # smoke run (CI)
    python benchmarks/bench_watchdog.py --nproc 1    # one process: the watchdog alone (no straggler to compare)

It starts its own workers with ``python -m torch.distributed.run`` (torchrun) when ``--nproc`` > 1.
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
from pathlib import Path

VARIANTS = ("guard", "resilient")
TARGET_RATIO = 1.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="processes (2: the straggler detector has ranks to compare)")
    ap.add_argument("--seconds", type=float, default=40.0, help="timed seconds (both variants)")
    ap.add_argument("--min_rounds", type=int, default=100)
    ap.add_argument("--max_rounds", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=10, help="steps per variant before timing")
    ap.add_argument("--hidden_size", type=int, default=64, help="DiT width (default: the trainer's default model)")
    ap.add_argument("--num_layers", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=8, help="per-process micro-batch (the trainer's default)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a few seconds")
    ap.add_argument("--run_dir", default=None, help="where the guards write their event logs (default: a temp folder)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.min_rounds, args.warmup = 2.0, 20, 3
    if args.nproc < 1:
        ap.error(f"--nproc must be >= 1, got {args.nproc}")
    return args


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.nproc`` workers of this script with torchrun and pass rank 0's output through."""
    import socket

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="vidstab-bench-watchdog-")
    with socket.socket() as s:  # a free port (with --master_port 0 the workers' store never forms here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(Path(__file__).resolve()), *argv, "--run_dir", run_dir]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "ACCELERATE_USE_CPU": "1"}
    return subprocess.run(cmd, env=env).returncode


def worker(args: argparse.Namespace) -> dict | None:
    import torch
    from accelerate import Accelerator

    import vidstab
    from vidstab.reference.model import VideoDiT
    from vidstab.run.watchdog import Watchdog

    torch.set_num_threads(1)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="vidstab-bench-watchdog-"))
    variants = {}
    for name in VARIANTS:
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = VideoDiT(in_channels=4, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        config = vidstab.GuardConfig.from_dict({"straggler": {"enabled": name == "resilient"}})
        guard = vidstab.attach(accelerator, model, opt, sched, config=config, run_dir=run_dir / name)
        watchdog = Watchdog(run_dir / name, rank=accelerator.process_index).start() if name == "resilient" else None
        variants[name] = (accelerator, model, guard, watchdog)
    rank, world = variants["guard"][0].process_index, variants["guard"][0].num_processes
    # The trainer's default data: 9 frames of 32x32 through the 8x Wan VAE -> 4 x 3 x 4 x 4 latents.
    shape = (args.batch_size, 4, 3, 4, 4)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randint(0, 1000, (shape[0],), generator=g))
               for _ in range(8)]
    steps = {name: 0 for name in VARIANTS}

    def one_step(name: str, i: int) -> None:
        accelerator, model, guard, watchdog = variants[name]
        step = steps[name]
        if watchdog is not None:
            watchdog.beat(step, "data")
        x, noise, t = batches[i % len(batches)]
        if watchdog is not None:
            watchdog.beat(step, "forward_backward")
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
            guard.backward(loss, batch={"latents": x, "noise": noise, "timesteps": t})
            if watchdog is not None:
                watchdog.beat(step, "guard")
            guard.step(max_grad_norm=1.0)
        steps[name] += 1

    for name in VARIANTS:
        for i in range(args.warmup):
            one_step(name, i)
    # Size the run to about args.seconds; every rank must run the same number of rounds (collectives).
    t0 = time.perf_counter()
    one_step("guard", 0)
    one_step("resilient", 0)
    pair_s = torch.tensor([time.perf_counter() - t0])
    if world > 1:
        torch.distributed.all_reduce(pair_s, op=torch.distributed.ReduceOp.MAX)
    rounds = max(args.min_rounds, min(args.max_rounds, int(args.seconds / max(float(pair_s), 1e-4))))
    times = {name: [] for name in VARIANTS}
    cpu = {name: [] for name in VARIANTS}
    started = time.perf_counter()
    for r in range(rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            c0, w0 = time.thread_time(), time.perf_counter()
            one_step(name, r)
            times[name].append(time.perf_counter() - w0)
            cpu[name].append(time.thread_time() - c0)
    elapsed = time.perf_counter() - started
    watchdog = variants["resilient"][3]
    fired = watchdog.fired
    watchdog.stop()
    for name in VARIANTS:
        variants[name][2].close()
    if world > 1:
        torch.distributed.barrier()  # every rank's event log is closed before rank 0 reads them all
    findings = {name: sum(1 for e in vidstab.read_events(run_dir / name)
                          if e["kind"] in ("warn", "skip", "rollback_request", "incident", "hang")) for name in VARIANTS}
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    mine = {
        "rank": rank, "rounds": rounds, "seconds": round(elapsed, 1),
        "median_step_us": {k: round(v, 1) for k, v in med.items()},
        "added_us": round(statistics.median(a - b for a, b in zip(times["resilient"], times["guard"])) * 1e6, 1),
        "added_cpu_us": round(statistics.median(a - b for a, b in zip(cpu["resilient"], cpu["guard"])) * 1e6, 1),
        "ratio": round(med["resilient"] / med["guard"], 4),
        "findings_on_healthy_steps": findings, "watchdog_fired": fired is not None,
    }
    rows = [mine]
    if world > 1:
        rows = [None] * world
        torch.distributed.all_gather_object(rows, mine)
    return {"rows": rows, "world": world, "shape": list(shape), "hidden_size": args.hidden_size,
            "num_layers": args.num_layers} if rank == 0 else None


def report(result: dict, load: tuple[float, float], quick: bool) -> dict:
    rows = result["rows"]
    print(f"{result['world']} process(es), reference VideoDiT hidden {result['hidden_size']}, {result['num_layers']} blocks, "
          f"latents {result['shape']} per process; load average {load[0]:.1f} before, {load[1]:.1f} after")
    print("guard: straggler detector off, no watchdog. resilient: straggler detector on + watchdog thread + 3 beats/step.")
    print("+us = median over rounds of (resilient step - guard step in the same round), wall clock [thread CPU time]; "
          "x = ratio of median wall times.")
    print(f"{'rank':>4}{'rounds':>8}{'guard us':>12}{'resilient us':>14}{'+us':>10}{'[cpu +us]':>11}{'x':>8}"
          f"{'findings':>10}{'fired':>7}")
    for r in rows:
        print(f"{r['rank']:>4}{r['rounds']:>8}{r['median_step_us']['guard']:>12.0f}{r['median_step_us']['resilient']:>14.0f}"
              f"{r['added_us']:>+10.1f}{r['added_cpu_us']:>+11.1f}{r['ratio']:>8.4f}"
              f"{sum(r['findings_on_healthy_steps'].values()):>10}{str(r['watchdog_fired']):>7}")
    worst = max(rows, key=lambda r: r["ratio"])
    summary = {
        "benchmark": "watchdog_overhead", "quick": quick, "processes": result["world"],
        "load_average": [round(load[0], 2), round(load[1], 2)], "model": {"hidden_size": result["hidden_size"],
                                                                        "num_layers": result["num_layers"], "latents": result["shape"]},
        "ranks": rows, "worst_ratio": worst["ratio"], "worst_added_us": max(r["added_us"] for r in rows),
        "worst_added_cpu_us": max(r["added_cpu_us"] for r in rows), "target_ratio": TARGET_RATIO,
        "findings_on_healthy_steps": sum(sum(r["findings_on_healthy_steps"].values()) for r in rows),
        "watchdog_fired": any(r["watchdog_fired"] for r in rows),
        "meets_target": bool(worst["ratio"] <= TARGET_RATIO),
    }
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return launch(args, argv)
    load = os.getloadavg()[0]
    result = worker(args)
    if result is not None:
        report(result, (load, os.getloadavg()[0]), args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
