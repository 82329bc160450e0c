"""The reference trainer's answer to an out-of-memory step: the same batch again, in smaller pieces.

The guard skips a step on which some rank ran out of memory (the ``oom`` detector, the same verdict on every rank).
The trainer then re-runs the step's micro-batches, each cut into pieces of half the failed size (a quarter if that
fails too, down to one sample), with gradient accumulation over the pieces, every rank on the same split: the loss
of each piece is weighted by its share of the micro-batch, so the applied update is the whole batch's up to
floating-point rounding (same samples, same noise and timesteps). The size that fitted is remembered per shape
bucket in the ``oom`` detector's state (a resume keeps it): later steps of that bucket go straight to pieces. A
sample that does not fit alone is quarantined with its shape by the rank it failed on (kept out of later epochs).

Under DeepSpeed the engine accumulates over its own ``gradient_accumulation_steps`` and steps inside ``backward``:
a batch cannot be re-split there, so the step stays skipped (no rollback) and the event says what to lower.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch

import vidstab
import vidstab.recovery.oom
from vidstab.signals import shape_bucket


class Kept(NamedTuple):
    """One micro-batch of the step, kept (by reference) for a re-run."""

    latents: torch.Tensor
    draws: dict
    sample_ids: Any


def oom_detector(guard: vidstab.Guard):
    return next((d for d in guard.detectors if d.name == "oom"), None)


def bucket_of(latents: torch.Tensor) -> str:
    """The guard's default shape bucket of a micro-batch (its latents' shape)."""
    return shape_bucket([latents])


def remembered_size(guard: vidstab.Guard, latents: torch.Tensor) -> int | None:
    """The micro-batch that fits this bucket, when an OOM taught a smaller one than ``latents`` has."""
    det = oom_detector(guard)
    fit = det.fits.get(bucket_of(latents)) if det is not None and guard.engine.name != "deepspeed" else None
    return fit if fit is not None and fit < latents.shape[0] else None


def failed_size(result: vidstab.StepResult) -> int | None:
    """The micro-batch that ran out of memory on some rank, when the step was skipped for an OOM."""
    finding = next((f for f in result.findings if f.detector == "oom"), None)
    return int(finding.figures.get("micro_batch", 1)) if finding is not None and result.skipped else None


def _pick(ids: Any, idx: list[int]) -> Any:
    if ids is None:
        return None
    return ids[torch.tensor(idx)] if isinstance(ids, torch.Tensor) else [ids[i] for i in idx]


def run_in_pieces(ctx: Any, step: int, kept: list[Kept], size: int) -> vidstab.StepResult:
    """One optimizer step over ``kept`` cut into pieces of at most ``size`` samples (see the module docstring)."""
    acc, model, guard = ctx.accelerator, ctx.model, ctx.guard
    batch = kept[0].latents.shape[0]
    per_micro = math.ceil(batch / size)
    pieces = [(k, list(range(i, min(i + size, batch)))) for k in kept for i in range(0, batch, size)]
    bucket = bucket_of(kept[0].latents)
    accumulation = acc.gradient_accumulation_steps
    acc.gradient_accumulation_steps = accumulation * per_micro  # Accelerate divides each piece's loss by it
    guard.global_step = step  # the same optimizer step, judged again
    try:
        for n, (k, idx) in enumerate(pieces):
            last = n == len(pieces) - 1
            acc.gradient_state._set_sync_gradients(last)
            with contextlib.nullcontext() if last else acc.no_sync(model):
                latents, draws = k.latents[idx], {name: v[idx] for name, v in k.draws.items()}
                error, per_sample = None, None
                try:
                    ctx.faults.maybe_oom(step, len(idx))
                    with acc.autocast():
                        per_sample = ctx.objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"])
                    loss = per_sample.mean() * (len(idx) * per_micro / batch)  # the piece's share of the micro-batch
                except RuntimeError as exc:  # as in train_step: the same collectives on every rank
                    error = exc
                    if vidstab.recovery.oom.is_oom(exc):
                        vidstab.recovery.oom.release(exc, latents.device)
                        if len(idx) == 1:
                            _quarantine(ctx, step, _pick(k.sample_ids, idx), latents.shape, bucket)
                    loss = model(torch.zeros_like(latents[:1]), draws["timesteps"][:1]).float().sum() * 0.0
                guard.backward(loss, batch={"latents": latents, **draws}, sample_ids=_pick(k.sample_ids, idx),
                               per_sample_loss=per_sample, timesteps=draws["timesteps"], error=error, bucket=bucket)
        return guard.step(ctx.args.max_grad_norm)
    finally:
        acc.gradient_accumulation_steps = accumulation
        acc.gradient_state._set_sync_gradients(True)


def _quarantine(ctx: Any, step: int, sample_ids: Any, shape: torch.Size, bucket: str) -> None:
    """One sample ran out of memory alone: no split can train on it."""
    ids = [str(i) for i in (sample_ids.tolist() if isinstance(sample_ids, torch.Tensor) else sample_ids or [])]
    vidstab.QuarantineList(ctx.args.output_dir).add(
        ids, f"out of memory alone: one sample of shape {list(shape)} (bucket {bucket})", step=step,
        rank=ctx.accelerator.process_index, source="oom")


def retry_in_pieces(ctx: Any, step: int, kept: list[Kept], result: vidstab.StepResult) -> vidstab.StepResult:
    """After a step skipped for an OOM: the same micro-batches in pieces of half the failed size, then a quarter...
    down to one sample; the size that fitted is remembered for the bucket. Every rank takes the same path."""
    failed = failed_size(result)
    det = oom_detector(ctx.guard)
    bucket = bucket_of(kept[0].latents)
    if ctx.guard.engine.name == "deepspeed":
        ctx.guard.events.log("oom_retry", step, bucket=bucket, micro_batch=failed, failed=failed, applied=False,
                             message=f"under DeepSpeed the engine's own gradient accumulation cannot re-split a batch: "
                                     f"the step stays skipped; lower --train_batch_size below {failed} for bucket "
                                     f"{bucket} and raise --gradient_accumulation_steps to keep the batch")
        return result
    size = failed // 2 if failed else 0
    while size >= 1:
        result = run_in_pieces(ctx, step, kept, size)
        if result.applied:
            det.fitted(bucket, size)
            ctx.guard.events.log("oom_retry", step, bucket=bucket, micro_batch=size, failed=failed, applied=True)
            return result
        if failed_size(result) is None:  # skipped for another reason: that verdict stands
            return result
        size //= 2
    ctx.guard.events.log("oom_retry", step, bucket=bucket, micro_batch=1, failed=failed, applied=False,
                         message=f"one sample of bucket {bucket} does not fit: the step stays skipped")
    return result
