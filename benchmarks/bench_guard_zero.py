"""Measures the guard's added time per step on a small model under DeepSpeed ZeRO-2 (2 CPU processes), beside
the figures reported before this benchmark existed (no target: a measurement, as the small models'
figures of ``bench_guard_overhead.py``).

Run directly, the script launches itself on 2 CPU processes through ``accelerate launch --use_deepspeed
--zero_stage 2 --gradient_clipping 1.0`` (``ACCELERATE_USE_CPU`` unset, as docs/deepspeed.md says; the gloo
process group through ``vidstab.engines.deepspeed_support.accelerator_kwargs_handlers``). Each rank trains one
``bench_guard_overhead.py`` model (``--model``: ``transformer``, a one-layer encoder of hidden 64 on 128 tokens,
the default; or ``mlp``) prepared by Accelerate under ZeRO (fp32, AdamW, a constant LambdaLR, DeepSpeed's
gradient_clipping 1.0), with two step variants on the SAME engine, one step of each per round in a random order
(seeded: every rank takes the same order, since their collectives must match), so drift and the load of a
shared machine hit both alike:

* ``plain``: the plain Accelerate loop after the forward (``bench_guard_overhead.user_loop_after_forward``):
  ``accelerator.backward(loss)``, which under DeepSpeed runs ``engine.backward`` and then ``engine.step()``,
  then ``accelerator.clip_grad_norm_`` (the engine's norm), ``optimizer.step()`` and ``optimizer.zero_grad()``
  (Accelerate's no-ops under DeepSpeed) and ``lr_scheduler.step()``;
* ``guarded``: the explicit form, ``guard.backward(loss, batch=...)`` + ``guard.step(1.0)`` of one
  ``vidstab.Guard``: the engine's backward without its step, DeepSpeed's own pre-step gradient norm, the guard's
  vector through two fixed-size all_reduces over gloo and one host read, the verdict, then ``engine.step()``
  reading that norm, the scheduler step and ``zero_grad``; every ``param_norm_every`` steps the weights and the
  update are measured around the step.

Measured per step, from after the forward to the end of the step (the forward is the user's, left out of
both), on rank 0: the wall time (it includes waiting for the other rank in every collective: the engine's
gradient reduction and norm, and in the guarded step the guard's two all_reduces), this thread's CPU time, and
the process's CPU time (gloo runs a collective on its own threads: thread CPU time leaves that work out,
process CPU time counts it, and with it any other thread of the process). Reported: the median of each per
variant, the ratio guarded / plain of the medians and the difference (``extra_ms``: wall), and the means. And,
as ``bench_guard_memory.py`` does for the UNet step, the guard's own host time: the guarded step's thread CPU
time less that of the calls it makes for the user, timed around each (``bench_guard_memory.UserWork``): the
engine's backward (``guard.engine.backward``), DeepSpeed's pre-step norm (``guard.engine.pre_step_norm``: work
the plain step does too, inside ``engine.step()``), ``engine.step()`` (``guard.control.optimizer_step``), the
scheduler step and ``zero_grad``; per step its median, and ``own_ratio`` = ``1 +`` its mean over each
``param_norm_every`` cycle of guarded steps over the plain step's thread CPU time, medians over the cycles (the
measured step is in each cycle; with fewer steps than one cycle, the means). The guard's all_reduces are in
its own time only by the calling thread's share (the rest is on gloo's threads, in the process CPU time and the
wall time).

    python benchmarks/bench_guard_zero.py             # 300 rounds
    python benchmarks/bench_guard_zero.py --quick     # 60 rounds
    python benchmarks/bench_guard_zero.py --smoke     # 4 rounds: every part runs, the figures mean nothing
    python benchmarks/bench_guard_zero.py --stage 3 --model mlp

Rank 0 prints a table and, last, one JSON object (``ratio``, ``extra_ms``, ``plain_ms``, ``guarded_ms``: wall
medians in ms); the launching process prints the table and the same
last line, and exits non-zero when the launch fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REPORT = "report.txt"
"""Rank 0's table and JSON line, written into the run folder for the launching process (DeepSpeed logs to
stdout too)."""


def worker(args: argparse.Namespace) -> None:
    """One rank: the two variants, interleaved; rank 0 prints and writes the report."""
    import logging

    import torch
    from accelerate import Accelerator
    from deepspeed.utils import logger as ds_logger

    sys.path[:0] = [str(REPO), str(HERE)]
    import bench_guard_overhead as bench  # the same models, batches and user loop
    from bench_guard_memory import UserWork

    import vidstab
    from vidstab.engines.deepspeed_support import accelerator_kwargs_handlers, is_deepspeed

    ds_logger.setLevel(logging.WARNING)
    torch.set_num_threads(1)
    accelerator = Accelerator(kwargs_handlers=accelerator_kwargs_handlers())
    if not is_deepspeed(accelerator) or accelerator.num_processes < 2:
        raise SystemExit(f"bench_guard_zero: expected DeepSpeed on 2 processes, got {accelerator.distributed_type} "
                         f"on {accelerator.num_processes} (is ACCELERATE_USE_CPU set? it turns DeepSpeed off)")
    factory, shape, description = bench.build(args.model, quick=False)
    # No dataloader is prepared: DeepSpeed's micro-batch size ("auto" from accelerate launch) is set here.
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = shape[0]
    model, opt, sched = bench.prepared_training(accelerator, factory)
    stage = int(model.zero_optimization_stage())
    if stage != args.stage:
        raise SystemExit(f"bench_guard_zero: asked for ZeRO-{args.stage}, the engine is ZeRO-{stage}")
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.module.parameters())  # ZeRO-3: partitioned
    guard = vidstab.Guard(accelerator, model, opt, sched, run_dir=args.run_dir)
    work = UserWork()  # the calls the guarded step makes for the user (module docstring)
    guard.engine.backward = work.timed(guard.engine.backward)
    guard.engine.pre_step_norm = work.timed(guard.engine.pre_step_norm)
    guard.control.optimizer_step = work.timed(guard.control.optimizer_step)
    guard.control.scheduler_step = work.timed(guard.control.scheduler_step)
    opt.zero_grad = work.timed(opt.zero_grad)  # a no-op under DeepSpeed, in both variants

    rank = accelerator.process_index
    batches = bench.fixed_batches(shape)
    times: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": [], "process": [], "own": []}
                                                for v in ("plain", "guarded")}
    skipped, findings = 0, 0

    def step(variant: str, i: int, record: bool) -> None:
        nonlocal skipped, findings
        x, noise, t = batches[(i + rank) % len(batches)]  # each rank its own data
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x + noise, t), noise)
            work.cpu = 0.0
            w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            if variant == "plain":
                bench.user_loop_after_forward(accelerator, model, opt, sched, loss)
            else:
                guard.backward(loss, batch={"latents": x, "noise": noise, "timesteps": t})
                result = guard.step(1.0)
            wall, cpu, process = time.perf_counter() - w0, time.thread_time() - c0, time.process_time() - p0
        if not record:
            return
        figures = times[variant]
        figures["wall"].append(wall)
        figures["cpu"].append(cpu)
        figures["process"].append(process)
        if variant == "guarded":
            figures["own"].append(cpu - work.cpu)
            skipped += result.skipped
            findings += len(result.findings)

    rng = random.Random(args.seed)  # the same order on every rank: the variants' collectives differ
    for r in range(args.warmup + args.rounds):
        order = ["plain", "guarded"]
        rng.shuffle(order)
        for variant in order:
            step(variant, r, record=r >= args.warmup)
    every = guard.config.param_norm_every
    guard.close()
    if rank == 0:
        lines = report(args, times, every, description, params,
                       stage, accelerator.num_processes, skipped, findings)
        print("\n".join(lines), flush=True)
        Path(args.run_dir, REPORT).write_text("\n".join(lines) + "\n")
    accelerator.wait_for_everyone()
    accelerator.end_training()


def cycle_median(values: list[float], every: int) -> float:
    """The median over consecutive ``every``-step cycles of their means (the mean without a full cycle)."""
    cycles = [statistics.fmean(values[i:i + every]) for i in range(0, len(values) - every + 1, every)]
    return statistics.median(cycles) if cycles else statistics.fmean(values)


def report(args: argparse.Namespace, times: dict, every: int, description: str, params: int, stage: int,
           processes: int, skipped: int, findings: int) -> list[str]:
    """Rank 0's table and, last, the JSON line."""
    ms = {v: {k: 1e3 * statistics.median(ts) for k, ts in kinds.items() if ts} for v, kinds in times.items()}
    mean = {v: {k: 1e3 * statistics.fmean(ts) for k, ts in kinds.items() if ts} for v, kinds in times.items()}
    plain, guarded = ms["plain"], ms["guarded"]
    own_cycles = 1e3 * cycle_median(times["guarded"]["own"], every)
    plain_cycles = 1e3 * cycle_median(times["plain"]["cpu"], every)
    own_ratio = 1 + own_cycles / plain_cycles
    lines = [f"{description} ({params:,} params), DeepSpeed ZeRO-{stage}, {processes} CPU processes over gloo, fp32, "
             f"AdamW, clip 1.0: {args.rounds} rounds of one plain and one guarded step in a random order "
             "(ms per step after the forward, rank 0)",
             f"{'':<34}{'wall med':>10}{'wall mean':>11}{'thread CPU':>12}{'process CPU':>13}"]
    for v in ("plain", "guarded"):
        lines.append(f"{v:<34}{ms[v]['wall']:>10.2f}{mean[v]['wall']:>11.2f}{ms[v]['cpu']:>12.2f}"
                     f"{ms[v]['process']:>13.2f}")
    lines.append(f"{'guarded / plain (medians)':<34}{guarded['wall'] / plain['wall']:>10.3f}{'':>11}"
                 f"{guarded['cpu'] / plain['cpu']:>12.3f}{guarded['process'] / plain['process']:>13.3f}")
    lines.append(f"{'guard own host time (thread CPU)':<34}{'':>10}{'':>11}{guarded['own']:>12.2f}")
    lines.append(f"extra wall per step {guarded['wall'] - plain['wall']:+.2f} ms = {guarded['wall'] / plain['wall']:.3f}x; "
                 f"the guard's own host time {own_cycles:.2f} ms per step ({every}-step cycle means) on a "
                 f"{plain_cycles:.2f} ms plain step: {own_ratio:.3f}x; guarded steps skipped {skipped}, findings "
                 f"{findings}")
    r3 = lambda x: round(x, 3)  # noqa: E731
    result = {"benchmark": "guard_zero", "stage": stage, "model": description, "params": params,
              "processes": processes, "rounds": args.rounds, "plain_ms": r3(plain["wall"]),
              "guarded_ms": r3(guarded["wall"]), "ratio": r3(guarded["wall"] / plain["wall"]),
              "extra_ms": r3(guarded["wall"] - plain["wall"]),
              "thread_cpu_ms": {"plain": r3(plain["cpu"]), "guarded": r3(guarded["cpu"]),
                                "ratio": r3(guarded["cpu"] / plain["cpu"])},
              "process_cpu_ms": {"plain": r3(plain["process"]), "guarded": r3(guarded["process"]),
                                 "ratio": r3(guarded["process"] / plain["process"])},
              "wall_mean_ms": {v: r3(mean[v]["wall"]) for v in ("plain", "guarded")},
              "own_ms": {"median": r3(guarded["own"]), "cycle_mean": r3(own_cycles),
                         "plain_cpu_cycle_mean": r3(plain_cycles)},
              "own_ratio": r3(own_ratio), "skipped": skipped, "findings": findings,
              "quick": args.quick, "smoke": args.smoke}
    return [*lines, json.dumps(result)]


def launch(args: argparse.Namespace, run_dir: str) -> list[str]:
    """One 2-process ``accelerate launch --use_deepspeed`` run of :func:`worker`: rank 0's report lines."""
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # it turns DeepSpeed off
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", str(args.stage),
           "--gradient_clipping", "1.0", "--gradient_accumulation_steps", "1", "--zero3_init_flag", "false",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", str(Path(__file__).resolve()), "--worker", "--run_dir", run_dir,
           "--stage", str(args.stage), "--model", args.model, "--rounds", str(args.rounds), "--warmup",
           str(args.warmup), "--seed", str(args.seed), *(["--quick"] if args.quick else []),
           *(["--smoke"] if args.smoke else [])]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    written = Path(run_dir, REPORT)
    if proc.returncode != 0 or not written.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_guard_zero: the launch failed (exit {proc.returncode})")
    return written.read_text().splitlines()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 rounds")
    ap.add_argument("--smoke", action="store_true", help="4 rounds: every part runs, the figures mean nothing")
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="ZeRO stage")
    ap.add_argument("--model", default="transformer", choices=("transformer", "mlp"),
                    help="bench_guard_overhead.py's small models")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 300; --quick 60; --smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="rounds left out first (default 10; --smoke 1)")
    ap.add_argument("--seed", type=int, default=0, help="the order of the variants in each round")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run_dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rounds = args.rounds or (4 if args.smoke else 60 if args.quick else 300)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 10)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="vidstab-bench-zero-") as run_dir:
        lines = launch(args, run_dir)
    print("\n".join(lines))
    json.loads(lines[-1])  # the last line is one JSON object


if __name__ == "__main__":
    main()
