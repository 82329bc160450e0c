"""Launched by tests/test_deepspeed.py: vidstab checkpoints, rollback, resume and recovery of a DeepSpeed ZeRO
engine through Accelerate on CPU, with the guard attached to the user's loop.

``--phase first``: ``--steps`` steps, a save every ``--save_every`` (each save's state digest recorded), then an
in-process rollback to an earlier checkpoint (state equal to that save's, bitwise) and the same steps again
(equal to the first pass's end). ``--phase resume``: a fresh launch loads ``latest`` (equal to that save) and
finishes the run (equal to the first launch's end). ``--phase recovery``: a gradient spike on batches
``--spike_batches`` asks for a rollback each time: rollback to ``last_good``, the LR backed off on the engine's
optimizer, the bad batches skipped, and the run aborted once the retry budget is spent. ``--phase other_world``:
a launch of another size asks for the checkpoint. Each rank writes ``{phase}-rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.nn.functional as F
from ds_common import batch, build, digest

import vidstab
from vidstab import CheckpointConfig, CheckpointManager, Recovery, RecoveryConfig, RunAborted
from vidstab.checkpoint import CheckpointError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", required=True, help="PHASE:STAGE:PRECISION[,...] one engine after another; "
                    "each in OUT/STAGE-PRECISION (PHASE: first, resume, recovery, other_world)")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--save_every", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--spike_batches", default="5,6,7")
    ap.add_argument("--retyped", default="", help="resume: then try to load this checkpoint folder (expect a refusal)")
    args = ap.parse_args()
    for job in args.jobs.split(","):
        phase, stage, precision = job.split(":")
        run_job(args, phase, int(stage), precision, os.path.join(args.out, f"{stage}-{precision}"))


def run_job(args: argparse.Namespace, phase: str, stage: int, precision: str, out: str) -> None:
    """One phase of the module docstring for one engine; writes ``out/{phase}-rank{R}.json``."""
    accelerator, engine, optimizer, lr_scheduler, dtype = build(stage, precision, args.accum)
    rank = accelerator.process_index
    spikes = {int(b) for b in args.spike_batches.split(",")} if phase == "recovery" else set()
    actions = {"grad_spike": {"warmup_steps": 3, "ratio_warmup_steps": 2, "action": "rollback"}}
    guard = vidstab.attach(accelerator, engine, optimizer, lr_scheduler, run_dir=out,
                           config=vidstab.GuardConfig.from_dict(actions if spikes else {}))
    if phase == "other_world":
        refusals = {}
        for allow in (False, True):
            ckpt = CheckpointManager(accelerator, out, CheckpointConfig(allow_world_size_change=allow))
            for name, obj in (("model", engine), ("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
                ckpt.register(name, obj)
            try:
                ckpt.load("latest")
                refusals[str(allow)] = None
            except CheckpointError as e:
                refusals[str(allow)] = str(e)
        Path(out, f"{phase}-rank{rank}.json").write_text(json.dumps(refusals, indent=1))
        guard.close()
        return
    ckpt = CheckpointManager(accelerator, out, CheckpointConfig(keep=10))
    for name, obj in (("model", engine), ("optimizer", optimizer), ("lr_scheduler", lr_scheduler), ("guard", guard)):
        ckpt.register(name, obj)
    recovery = Recovery(accelerator, ckpt, guard, RecoveryConfig(max_retries=2, lr_backoff=0.5))

    def train(step: int, until: int, position: int, log: dict) -> tuple[int, int]:
        """Steps ``step..until-1`` from batch ``position`` on; returns (step, position) at the end."""
        while step < until:
            index, position = position, position + 1
            for micro in range(args.accum):
                with accelerator.accumulate(engine):
                    x, y = batch(index, micro, rank, dtype)
                    loss = F.mse_loss(engine(x).float(), y)
                    if index in spikes:
                        loss = loss * 1e6
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            result = guard.last_result
            log.setdefault("batches", []).append(index)
            state = recovery.after_step(result, step + 1)
            if state is not None:  # rolled back: the data iterator stays where it is (skip_data)
                step = int(state["step"])
                log.setdefault("rollbacks", []).append({
                    "at_batch": index, "to_step": step, "multiplier": guard.lr_multiplier,
                    "lr": optimizer.param_groups[0]["lr"], "scheduled": lr_scheduler.get_last_lr()[0],
                    "restored": digest(engine) == log["saved"].get(str(step))})
                continue
            step += 1
            if step % args.save_every == 0:
                ckpt.save(step, healthy=guard.healthy, trainer_state={"step": step, "position": position})
                log.setdefault("saved", {})[str(step)] = digest(engine)
        return step, position

    log: dict = {"saved": {}}
    if phase == "first":
        step, position = train(0, args.steps, 0, log)
        log["final"] = digest(engine)
        # In-process rollback to an earlier save, then the same steps again.
        back = args.save_every * 2
        state = ckpt.load(os.path.join(ckpt.root, f"step_{back:06d}"))
        log["rollback_restored"] = digest(engine) == log["saved"][str(back)]
        train(state["step"], args.steps, state["position"], {"saved": {}})
        log["rollback_continued"] = digest(engine) == log["final"]
    elif phase == "resume":
        state = recovery.resume("latest")
        log["resumed_step"] = state["step"]
        log["resumed"] = digest(engine)
        train(state["step"], args.steps, state["position"], log)
        log["final"] = digest(engine)
        if args.retyped and os.path.isdir(retyped := os.path.join(ckpt.root, args.retyped)):
            # a folder whose optimizer moments the test cast to another dtype (manifest recomputed): skipped, named,
            # in favour of the previous valid one
            log["retyped"] = ckpt.load(retyped)["_checkpoint"]
    else:
        try:
            train(0, args.steps, 0, log)
            log["aborted"] = None
        except RunAborted as e:
            log["aborted"] = str(e)
        log["finite"] = ckpt.engine.params_finite({"model": engine})
    ckpt.wait()
    Path(out, f"{phase}-rank{rank}.json").write_text(json.dumps(log, indent=1))
    guard.close()


if __name__ == "__main__":
    main()
