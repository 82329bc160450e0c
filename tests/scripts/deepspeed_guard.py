"""Launched by tests/test_deepspeed.py on 2 CPU processes: a DeepSpeed ZeRO engine through Accelerate, guarded.

Run A takes ``--steps`` optimizer steps (``--accum`` micro-steps each) with three bad steps: a NaN input on
rank 1 (``--nan_step``), the loss x1e6 on every rank (a gradient spike, ``--spike_step``) and the LR x100 for
one step (a user's LR bug, ``--lr_step``). Then the engine, scheduler and guard go back to their state before
step 0 (:class:`vidstab.engines.deepspeed_support.ZeroPartitions`) and run B takes the same batches except the bad
steps'. Each rank writes ``rank{R}.json``: per step of run A what vidstab, Accelerate and DeepSpeed say, and
whether a skipped step left the fp32 partitions, the optimizer moments and the module weights bitwise
unchanged; and whether run A's final state equals run B's bitwise.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from ds_common import batch, build, same, state_copy, user_step

import vidstab
from vidstab.engines.deepspeed_support import ZeroPartitions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="2:no:attach", help="STAGE:PRECISION:MODE[,...], one engine after another")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--nan_step", type=int, default=3)
    ap.add_argument("--spike_step", type=int, default=7)
    ap.add_argument("--lr_step", type=int, default=9)
    args = ap.parse_args()
    for spec in args.configs.split(","):
        if spec == "refusals":
            refusals(Path(args.out, spec))
            continue
        stage, precision, mode = spec.split(":")
        run_config(args, int(stage), precision, mode, Path(args.out, spec.replace(":", "-")))


def refusals(out: Path) -> None:
    """What vidstab refuses at attach (and the checkpoint manager at construction), on real engines:
    ``out/rank{R}.json`` maps each set-up to the message (None: accepted)."""
    import deepspeed

    from vidstab import CheckpointManager
    from vidstab.checkpoint import CheckpointError
    from vidstab.engines.deepspeed_support import DeepSpeedUnsupported

    cases = {"stage0": dict(stage=0), "offload_param": dict(stage=3, zero_extra={"offload_param": {"device": "cpu"}}),
             "ds_scheduler": dict(ds_scheduler=True), "other_version": {}, "accepted": {}}
    found = {}
    for name, kwargs in cases.items():
        accelerator, engine, optimizer, lr_scheduler, _ = build(kwargs.pop("stage", 2), "no", 1, **kwargs)
        version = deepspeed.__version__
        if name == "other_version":
            deepspeed.__version__ = "0.99.0"
        messages = []
        try:
            for make in (lambda: vidstab.attach(accelerator, engine, optimizer, lr_scheduler, run_dir=out / name),
                         lambda: CheckpointManager(accelerator, str(out / name))):
                try:
                    made = make()
                    messages.append(None)
                    if isinstance(made, vidstab.Guard):
                        made.close()
                except (DeepSpeedUnsupported, CheckpointError) as e:
                    messages.append(str(e))
        finally:
            deepspeed.__version__ = version
        found[name] = messages
    out.mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(found, indent=1))


def run_config(args: argparse.Namespace, stage: int, precision: str, mode: str, out: Path) -> None:
    """Runs A and B of the module docstring for one engine; writes ``out/rank{R}.json``."""
    accelerator, model, optimizer, lr_scheduler, dtype = build(stage, precision, args.accum)
    engine = model
    rank = accelerator.process_index
    config = vidstab.GuardConfig.from_dict({"grad_spike": {"warmup_steps": 4, "ratio_warmup_steps": 3}})
    if mode == "attach":
        guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, config=config, run_dir=out)
    else:
        guard = vidstab.Guard(accelerator, model, optimizer, lr_scheduler, config=config, run_dir=out)
    start = (state_copy(engine), ZeroPartitions(engine).state(), lr_scheduler.state_dict(), guard.state_dict())
    start_tensors = {k: v.clone() for k, v in start[1][0].items()}
    bad = {args.nan_step, args.spike_step, args.lr_step}

    def run(steps: list[int], record: list | None) -> None:
        for step in steps:
            before = state_copy(engine)
            counters = engine.skipped_steps
            lr_before = [g["lr"] for g in optimizer.param_groups]
            if step == args.lr_step and record is not None:
                for g in optimizer.param_groups:  # a user's bug: the LR x100 for one step
                    g["lr"] *= 100
            for micro in range(args.accum):
                with accelerator.accumulate(model):
                    x, y = batch(step, micro, rank, dtype)
                    if step == args.nan_step and rank == 1 and record is not None:
                        x[0, 0] = math.nan
                    loss = F.mse_loss(model(x).float(), y)
                    if step == args.spike_step and record is not None:
                        loss = loss * 1e6
                    if mode == "attach":
                        result = user_step(accelerator, model, optimizer, lr_scheduler, loss)
                    else:
                        guard.backward(loss, batch={"x": x, "y": y})
                        result = guard.step()
            if step == args.lr_step and record is not None:
                for g, lr in zip(optimizer.param_groups, lr_before):
                    g["lr"] = lr
            if record is not None:
                record.append({"step": step, "skipped": result.skipped, "applied": result.applied,
                               "verdict": result.verdict.name, "bad_ranks": result.bad_ranks,
                               "detectors": sorted({f.detector for f in result.findings}),
                               "was_skipped": accelerator.optimizer_step_was_skipped,
                               "ds_skipped": engine.skipped_steps - counters,
                               "unchanged": same(before, state_copy(engine)),
                               "grad_norm": result.grad_norm, "lr": lr_scheduler.get_last_lr()[0]})

    steps: list[dict] = []
    run(list(range(args.steps)), steps)
    final_a = state_copy(engine)
    lr_a = lr_scheduler.get_last_lr()
    # Run B: back to the start (in place, from plain tensors), then every batch but the bad steps'.
    ZeroPartitions(engine).load(start_tensors, start[1][1])
    restored = same(state_copy(engine), start[0])
    lr_scheduler.load_state_dict(start[2])
    guard.load_state_dict(start[3])
    run([s for s in range(args.steps) if s not in bad], None)
    final_b = state_copy(engine)
    report = {"steps": steps, "restored": restored, "equal_to_reference": same(final_a, final_b),
           "lr_equal": lr_a == lr_scheduler.get_last_lr(),
           "finite": all(bool(torch.isfinite(v.float()).all()) for v in final_a.values()),
           "skipped_total": guard.skipped_total, "engine_skipped": engine.skipped_steps}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    guard.close()


if __name__ == "__main__":
    main()
