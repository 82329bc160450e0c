"""The trainer's ``--audit`` preflight of memory: one forward, backward and optimizer step of the run's shape bucket
(``--num_frames`` x ``--height`` x ``--width``) at ``--train_batch_size``, its peak memory and headroom
(:mod:`vidstab.tools.audit.memory`; ``oom_batch_above@0=N`` drills a device that fits N samples). The guard is
bypassed: the optimizer is torch's own, the backward a plain one, and an OOM reaches the preflight."""

from __future__ import annotations

import contextlib
from typing import Any

from oom_retry import bucket_of
from vidstab.reference.objective import step_generator
from vidstab.tools.audit import finding
from vidstab.tools.audit.memory import audit_bucket_memory


def bucket_memory(run: Any, sample: dict) -> list[dict]:
    acc, model = run.accelerator, run.model
    if run.guard.sharded:  # the weights are partitions the engine steps itself: a plain step would not be its own
        return [finding("memory.method", "info", "the per-bucket memory preflight runs without --fsdp or DeepSpeed "
                        "(one process or DDP): not measured here")]
    latents = sample["latents"].to(acc.device)
    draws = run.objective.sample(latents, step_generator(run.args.seed, 0, 0, acc.process_index, latents.device))

    def loss():
        run.faults.maybe_oom(0, latents.shape[0])
        with acc.autocast():
            return run.objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"]).mean()

    forward = getattr(run.guard.patches, "forward_oom", None)
    with forward.off() if forward is not None else contextlib.nullcontext():
        return audit_bucket_memory(acc.unwrap_model(model), getattr(run.optimizer, "optimizer", run.optimizer),
                                   {bucket_of(latents): (latents.shape[0], loss)}, acc.device)
