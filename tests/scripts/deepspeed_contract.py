"""Launched by tests/test_deepspeed_contract.py on 2 CPU processes: a user's unmodified loop under DeepSpeed ZeRO,
guarded with ``vidstab.attach(..., rollback_every=N)``, as the README shows it.

``padding:STAGE``: a model whose partitions are padded (odd sizes), the padding of every fp32 partition
overwritten with NaN or 1e30 before each step (DeepSpeed leaves it uninitialised: any bits). Each rank writes
``padding-rank{R}.json``: per step the norm of the module's weights gathered from the partitions (DeepSpeed's own
all-gather, in float64), and what the guard decided.

``lr_fault:STAGE``: from ``--fault_step`` on the loop writes the LR x1e4 into the optimizer before every
step (a persistent bug). Nothing catches anything: the script ends as vidstab ends it. Each rank appends one line
per step to ``lr_fault-rank{R}.jsonl``: the loop's step count, whether the step asked for a rollback, and a digest of everything a step can change (fp32
partitions, optimizer moments, module weights).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from ds_common import batch, build, digest, user_step

import vidstab


def fill_padding(engine, value: float) -> int:
    """Write ``value`` into the padding of this rank's fp32 partitions, located with DeepSpeed's own
    ``groups_padding`` (per group at stages 1/2; per parameter at stage 3, of each ``ds_tensor``). Returns how many
    elements were written."""
    zero = engine.optimizer
    written = 0
    if engine.zero_optimization_stage() == 3:
        for flat, parts, pads in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups,
                                     zero.groups_padding):
            offset = 0
            for part, pad in zip(parts, pads):
                size = part.ds_numel
                if pad:
                    flat.data[offset + size - pad:offset + size] = value
                    written += pad
                offset += size
    else:
        for flat, pad in zip(zero.single_partition_of_fp32_groups, zero.groups_padding):
            if pad:
                flat.data[flat.numel() - pad:] = value
                written += pad
    return written


@torch.no_grad()
def gathered_norm(engine) -> float:
    """The global norm of the module's weights, gathered by DeepSpeed (a collective: every rank)."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return math.sqrt(sum(float(p.double().pow(2).sum()) for p in params))
    return math.sqrt(sum(float(p.double().pow(2).sum()) for p in params))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", required=True, help="JOB:STAGE[,...] one engine after another, each in OUT/JOB-STAGE "
                    "(JOB: padding or lr_fault; an lr_fault job ends the script)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rollback_every", type=int, default=3)
    ap.add_argument("--fault_step", type=int, default=5)
    args = ap.parse_args()
    for spec in args.jobs.split(","):
        job, stage = spec.split(":")
        run_job(args, job, int(stage), Path(args.out, f"{job}-{stage}"))


def run_job(args: argparse.Namespace, job: str, stage: int, out: Path) -> None:
    accelerator, model, optimizer, lr_scheduler, dtype = build(stage, "no", 1, hidden=33)
    rank = accelerator.process_index
    vidstab.claim_run_dir(accelerator, out)
    config = vidstab.GuardConfig.from_dict({"param_norm_every": 1})
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, config=config, run_dir=out,
                           rollback_every=args.rollback_every)
    record: dict = {"padding_written": [], "norms": [], "steps": []}
    steps = args.steps if job == "padding" else 10 * args.steps  # a persistent fault: until vidstab ends the run
    for step in range(steps):
        if job == "padding":
            record["padding_written"].append(fill_padding(model, math.nan if step % 2 else 1e30))
        if job == "lr_fault" and step >= args.fault_step:
            for group in optimizer.param_groups:
                group["lr"] = lr_scheduler.get_last_lr()[0] * 1e4
        x, y = batch(step, 0, rank, dtype)
        loss = F.mse_loss(model(x).float(), y)
        result = user_step(accelerator, model, optimizer, lr_scheduler, loss)
        record["steps"].append({"step": result.step, "verdict": result.verdict.name, "skipped": result.skipped,
                                "detectors": sorted({f.detector for f in result.findings})})
        if job == "padding":
            record["norms"].append(gathered_norm(model))
        else:
            with open(out / f"{job}-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"count": guard.global_step, "rollback": result.rollback is not None,
                                    "digest": digest(model)}) + "\n")
    guard.close()
    Path(out, f"{job}-rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
