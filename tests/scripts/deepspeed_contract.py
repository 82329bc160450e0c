"""Launched by tests/test_deepspeed_contract.py on 2 CPU processes: a user's unmodified loop under DeepSpeed ZeRO,
guarded with ``vidstab.attach(..., rollback_every=N)``, as the README shows it.

``padding:STAGE``: a model whose partitions are padded (odd sizes), the padding of every fp32 partition
overwritten with NaN or 1e30 before each step (DeepSpeed leaves it uninitialised: any bits). Each rank writes
``padding-rank{R}.json``: per step the norm of the module's weights gathered from the partitions (DeepSpeed's own
all-gather, in float64), and what the guard decided.

``readme:STAGE``: the guarded side of the README's diff (``attach-diff``), as it stands there, with its own
``accelerator.save_state`` every 4 steps and a NaN sample, on the DeepSpeed engine. Each rank writes
``readme-rank{R}.json``: the step it finished at and whether the weights are finite.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import os
import sys

import torch
import torch.nn.functional as F
from ds_common import batch, build, user_step

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
                    "(JOB: padding or readme)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rollback_every", type=int, default=3)
    args = ap.parse_args()
    for spec in args.jobs.split(","):
        job, stage = spec.split(":")
        run_job(args, job, int(stage), Path(args.out, f"{job}-{stage}"))


def readme(stage: int, out: Path) -> None:
    """The README's guarded loop, copied from the README, on a DeepSpeed engine (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_readme_loop import _diff, _side

    from vidstab.engines.deepspeed_support import ZeroPartitions

    accelerator, model, optimizer, lr_scheduler, dtype = build(stage, "no", 2, micro_batch=2, prepare=False)
    latents = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    latents[10, 0] = float("nan")
    data = [{"latents": latents[i], "ids": torch.tensor(i)} for i in range(len(latents))]
    scope = {"os": os, "vidstab": vidstab, "accelerator": accelerator, "model": model, "optimizer": optimizer,
             "lr_scheduler": lr_scheduler, "loader": torch.utils.data.DataLoader(data, batch_size=2),
             "num_train_epochs": 3, "compute_loss": lambda model, batch: model(batch["latents"]).pow(2).mean(),
             "args": argparse.Namespace(output_dir=str(out), resume_from_checkpoint=None, max_train_steps=6,
                                        checkpointing_steps=2, max_grad_norm=1.0)}
    exec(compile(_side(_diff("attach-diff"), "+"), "README.md:attach-diff", "exec"), scope)
    engine = scope["model"]
    finite = all(bool(torch.isfinite(t).all()) for t in ZeroPartitions(engine).real())
    Path(out, f"readme-rank{accelerator.process_index}.json").write_text(
        json.dumps({"global_step": scope["global_step"], "finite": finite}))


def run_job(args: argparse.Namespace, job: str, stage: int, out: Path) -> None:
    if job == "readme":
        return readme(stage, out)
    accelerator, model, optimizer, lr_scheduler, dtype = build(stage, "no", 1, hidden=33)
    rank = accelerator.process_index
    vidstab.claim_run_dir(accelerator, out)
    config = vidstab.GuardConfig.from_dict({"param_norm_every": 1})
    guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, config=config, run_dir=out,
                           rollback_every=args.rollback_every)
    record: dict = {"padding_written": [], "norms": [], "steps": []}
    for step in range(args.steps):
        record["padding_written"].append(fill_padding(model, math.nan if step % 2 else 1e30))
        x, y = batch(step, 0, rank, dtype)
        loss = F.mse_loss(model(x).float(), y)
        result = user_step(accelerator, model, optimizer, lr_scheduler, loss)
        record["steps"].append({"step": result.step, "verdict": result.verdict.name, "skipped": result.skipped,
                                "detectors": sorted({f.detector for f in result.findings})})
        record["norms"].append(gathered_norm(model))
    guard.close()
    Path(out, f"{job}-rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
