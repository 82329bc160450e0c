"""Validation sampling during and at the end of a run: clips on disk, in the tracker and in report.html.

Runs on the main process only (like diffusers' example scripts), with the EMA weights under --use_ema.
Writes ``OUTPUT_DIR/validation/step_XXXXXX/{clip_XX.mp4, strip.png}`` and logs an event
``kind="validation"`` (paths relative to the run folder; how far the sampled latents are from the nearest data
clip, next to the same figure for plain noise and for the data itself) that ``report.html`` shows.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from vidstab.reference.sampling import latent_statistics, make_scheduler, sample_clips

#: Clips of the latent cache whose statistics stand for "the data" (enough for stable figures, cheap to read).
REFERENCE_CLIPS = 64


def reference_latents(cache) -> torch.Tensor:
    """Up to :data:`REFERENCE_CLIPS` clips of the cache (read item by item), what samples are compared with."""
    return torch.stack([cache[i]["latents"] for i in range(min(len(cache), REFERENCE_CLIPS))])


def log_to_trackers(accelerator, step: int, result: dict) -> None:
    """The preview strip to TensorBoard, the clips to wandb, and the statistics gap as a scalar."""
    scalars = {k: result[k] for k in ("nn_distance", "noise_nn_distance", "data_nn_distance") if k in result}
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            strip = np.stack([np.concatenate(list(clip), axis=1) for clip in result["frames"]])  # [B, H, T*W, 3]
            tracker.writer.add_images("validation", strip, step, dataformats="NHWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Video(v, fps=8, format="mp4") for v in result["videos"]]}, step=step)
    if scalars:
        accelerator.log({f"validation/{k}": v for k, v in scalars.items()}, step=step)


def run_validation(run, step: int, model=None, ema=None) -> dict | None:
    """Sample ``--num_validation_videos`` clips on the main process; returns the logged event (None elsewhere).
    ``model``: the plain model to sample (``sharding.full_model`` under ``--fsdp``); default the unwrapped one.
    ``ema``: the EMA to sample (``sharding.full_ema`` under ``--fsdp``); default ``run.ema``."""
    args, acc = run.args, run.accelerator
    if args.num_validation_videos < 1 or not acc.is_main_process:
        return None
    model = acc.unwrap_model(run.model) if model is None else model
    ema = run.ema if ema is None else ema
    if ema is not None:  # diffusers' convention: validate the EMA weights, then put the live ones back
        ema.store(model.parameters())
        ema.copy_to(model.parameters())
    try:
        if run.vae_on_device is None:
            run.vae_on_device = run.vae.to(acc.device)
        out_dir = Path(args.output_dir) / "validation" / f"step_{step:06d}"
        if run.reference_latents is None:
            run.reference_latents = reference_latents(run.cache)
        scheduler = make_scheduler(args.prediction_type, args.num_train_timesteps, args.flow_shift)
        result = sample_clips(model, scheduler, run.vae_on_device, run.cache.normalization, run.cache.latent_shape,
                              num_videos=args.num_validation_videos, num_inference_steps=args.validation_num_inference_steps,
                              seed=args.seed, out_dir=out_dir, reference_latents=run.reference_latents)
    finally:
        if ema is not None:
            ema.restore(model.parameters())
    log_to_trackers(acc, step, result)
    root = Path(args.output_dir)
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    return run.guard.events.log(
        "validation", step, videos=[rel(v) for v in result["videos"]], strip=rel(result["strip"]), ema=run.ema is not None,
        stats=result["stats"], data_stats=latent_statistics(run.reference_latents), nn_distance=result.get("nn_distance"),
        noise_nn_distance=result.get("noise_nn_distance"), data_nn_distance=result.get("data_nn_distance"), scheduler=type(scheduler).__name__,
        num_inference_steps=args.validation_num_inference_steps,
    )
