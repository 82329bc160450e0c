#!/usr/bin/env python
"""Reference latent video DiT trainer on Hugging Face Accelerate, with vidstab on by default.

    accelerate launch recipes/train.py                        # tiny built-in run, a few minutes on 2 CPU cores
    accelerate launch recipes/train.py --config recipes/configs/small.yaml --output_dir runs/small
    accelerate launch recipes/train.py --resume_from_checkpoint latest
    accelerate launch recipes/train.py --inject_fault nan_batch@20:1  # drill: watch vidstab skip and capture it
    accelerate launch --multi_gpu --rdzv_backend c10d --max_restarts 3 recipes/train.py --resume_from_checkpoint latest
                                       # with docs/faults.md's exports: survives hung and dead ranks

Data flow of one optimizer step (``train_step`` below): for each of ``gradient_accumulation_steps``
micro-batches: latents -> timesteps + noise (drawn on the device, seeded per step, micro-step and rank) -> DiT -> fp32 per-sample
loss -> ``guard.backward``; then ``guard.step`` clips, makes one lockstep decision on every rank, and
steps or skips the optimizer. Everything else here is building those pieces and bookkeeping.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration, broadcast, set_seed
from diffusers.optimization import get_scheduler
from tqdm.auto import tqdm


def _exit_unless_this_vidstab() -> None:
    """Stop with one clear line when ``import vidstab`` would give PyPI's unrelated ``vidstab`` package (the
    check is vidstab/install_check.py of this clone, loaded by path: the ``vidstab`` on the path may not be ours)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vidstab_install_check",
                                                  Path(__file__).resolve().parents[1] / "vidstab" / "install_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    problem = check.wrong_vidstab()
    if problem:
        sys.exit(f"recipes/train.py: {problem}")


_exit_unless_this_vidstab()

import vidstab  # noqa: E402
import vidstab.recovery.oom  # noqa: E402
import vidstab.run.run_dir  # noqa: E402
from args import (RUN_CONTROL_FLAGS, watchdog_config, apply_backend_flags, check_trackers, lr_scheduler_kwargs, parse_args, resolve_max_train_steps,
                  scaled_learning_rate)
import sharding  # recipes/sharding.py: --fsdp
import oom_retry  # recipes/oom_retry.py: a step that ran out of memory, again in smaller pieces
import preflight  # recipes/preflight.py: --audit's memory per bucket
from export import export_pipeline
from validation import run_validation
from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from vidstab.engines.deepspeed_support import accelerator_kwargs_handlers
from vidstab.run.checkpoint_interval import auto_interval
from vidstab.run.goodput import GoodputLog
from vidstab.run.host_memory import ChildrenMemory, DataLoaderWorkerKilled, record_worker_killed
from vidstab.run.elastic import LaunchInfo, previous_attempt, shared_store_warning
from vidstab.faults import FaultInjector
from vidstab.run.preemption import PreemptionHandler
from vidstab.recovery.policy import Recovery, RecoveryConfig, RunAborted, rollback_cause
from vidstab.run.run_record import run_environment
from vidstab.reference.data import BadSampleError, moving_shapes_dataset, video_folder_dataset
from vidstab.reference.model import VideoDiT
from vidstab.reference.objective import DiffusionObjective, ObjectiveConfig, step_generator
from vidstab.reference.vae import LatentCache, LatentCacheError, build_vae, collate_latents, encode_to_cache, latent_shape
from vidstab.run.watchdog import Watchdog

logger = get_logger("vidstab.train")


# --------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------
def build_latents(args: argparse.Namespace, accelerator: Accelerator):
    """Videos -> VAE latents, encoded once by the main process and cached as safetensors shards; returns (cache, vae).

    Only the main process builds the VAE (validation and export are its): the other ranks open the cache it checked,
    matched by its fingerprint, and encode their own (vae returned) only where they cannot see it (another node's
    disk). ``vae`` is None on the ranks that opened the main process's cache."""
    cache_dir = Path(args.output_dir) / "latent_cache"
    cache = vae = failed = None
    if accelerator.is_main_process:
        try:
            cache, vae = encode_latents(args, cache_dir, log=logger.info)
        except Exception as exc:  # said by the main process; the others stop with it, not at a lost peer
            failed = exc
    digest = torch.zeros(32, dtype=torch.uint8, device=accelerator.device)  # the SHA-256 as bytes (zeros: failed)
    if cache is not None:
        digest.copy_(torch.tensor(list(bytes.fromhex(cache.fingerprint)), dtype=torch.uint8))
    fingerprint = bytes(broadcast(digest).cpu().tolist()).hex()  # every rank: after the main process's cache
    if failed is not None:
        raise failed
    if not any(bytes.fromhex(fingerprint)):
        raise SystemExit(2)  # the main process could not build the cache and says why, in its own way
    if cache is None:
        with contextlib.suppress(LatentCacheError):
            cache = LatentCache.load(cache_dir)
        if cache is None or cache.fingerprint != fingerprint:
            logger.warning(f"process {accelerator.process_index}: the main process's latent cache is not in "
                           f"{cache_dir} here; encoding this process's own", main_process_only=False)
            try:
                cache, vae = encode_latents(args, cache_dir, log=lambda msg: None)
            except vidstab.ConfigError as exc:  # this rank's own finding (its node's files): said here, not by rank 0
                print(f"recipes/train.py: error: process {accelerator.process_index}: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(2) from exc
    return cache, vae


def encode_latents(args: argparse.Namespace, cache_dir: Path, log):
    """(cache, vae): the flags' videos through their VAE into ``cache_dir``, or the cache there when it matches. What the
    flags name wrongly (the VAE folder, the data folder, a clip shape the VAE cannot encode) is a ``ConfigError``
    naming the flag, checked before any video is read."""
    try:
        vae = build_vae(args.vae, seed=args.seed, latent_channels=args.latent_channels)
    except (FileNotFoundError, ValueError) as exc:  # the folder --vae names
        if args.vae is None:
            raise
        raise vidstab.ConfigError(f"--vae {args.vae}: {exc}") from exc
    try:
        latent_shape(vae, args.num_frames, args.height, args.width)
    except ValueError as exc:
        raise vidstab.ConfigError(f"--num_frames {args.num_frames} --height {args.height} --width {args.width}: {exc}") from exc
    if args.data_dir:
        try:
            videos, skipped = video_folder_dataset(
                args.data_dir, args.num_frames, (args.height, args.width), frame_stride=args.frame_stride, skip_bad_samples=args.skip_bad_samples
            )
        except FileNotFoundError as exc:  # no such folder, or no video in it
            raise vidstab.ConfigError(f"--data_dir: {exc}") from exc
        for record in skipped:
            logger.warning(f"skipped bad sample {record['sample_id']}: {record['reason']}", main_process_only=True)
    else:
        videos = moving_shapes_dataset(args.num_videos, args.num_frames, (args.height, args.width), seed=args.seed)
    return encode_to_cache(videos, vae, cache_dir, clamp=args.latent_clamp, log=log), vae


def objective_config(args: argparse.Namespace) -> ObjectiveConfig:
    """The diffusion objective the flags describe (the flow-matching fields only matter for flow matching)."""
    return ObjectiveConfig(
        prediction_type=args.prediction_type, num_train_timesteps=args.num_train_timesteps, flow_shift=args.flow_shift,
        weighting_scheme=args.weighting_scheme, logit_mean=args.logit_mean, logit_std=args.logit_std, mode_scale=args.mode_scale,
    )


def build_accelerator(args: argparse.Namespace) -> Accelerator:
    """The run's Accelerator: precision from --mixed_precision or else Accelerate's own config, trackers checked."""
    out = Path(args.output_dir)
    return Accelerator(
        mixed_precision=args.mixed_precision,  # None: whatever `accelerate config` / `accelerate launch` say
        log_with=check_trackers(args.report_to),
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / args.logging_dir)),
        # One optimizer step is exactly `gradient_accumulation_steps` micro-batches, across epoch ends too.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        # accelerate launch --use_deepspeed on CPU: the gloo process group, without DeepSpeed's C++ shm op build.
        kwargs_handlers=accelerator_kwargs_handlers(),
    )


def build_model(args: argparse.Namespace, latent_channels: int) -> VideoDiT:
    model = VideoDiT(
        in_channels=latent_channels, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
        attention_type=args.attention_type, pos_embed=args.pos_embed, num_train_timesteps=args.num_train_timesteps,
    )
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model


def batch_stream(accelerator: Accelerator, dataloader, start: int, workers: ChildrenMemory):
    """Endless micro-batches from position ``start`` (micro-batches consumed so far), epoch-seeded order.

    The order depends only on (seed, epoch), so a resumed run sees the same batches as an uninterrupted one.
    ``workers`` reads the loader workers' memory (for the record of one killed).
    """
    epoch, index = divmod(start, len(dataloader))
    while True:
        dataloader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(dataloader, index) if index else dataloader
        workers.new_epoch()
        for batch in loader:
            workers.sample()
            yield batch
        epoch, index = epoch + 1, 0


# --------------------------------------------------------------------------------------------------------
# The training step (the only place backward, clip and the optimizer meet is guard.step)
# --------------------------------------------------------------------------------------------------------
def train_step(ctx: "Run", step: int) -> vidstab.StepResult:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
    acc, model, guard, faults = ctx.accelerator, ctx.model, ctx.guard, ctx.faults
    kept: list[oom_retry.Kept] = []  # the step's micro-batches (references), for a re-run in pieces after an OOM
    for micro_step in range(acc.gradient_accumulation_steps):
        ctx.beat(step, "data")
        faults.reached(step)
        faults.maybe_hang(step)
        waited = time.perf_counter()
        batch = next(ctx.data)
        guard.data_wait(time.perf_counter() - waited)
        ctx.batches_consumed += 1
        ctx.beat(step, "forward_backward")
        compute_started = time.perf_counter()
        with acc.accumulate(model):
            latents, _ = faults.corrupt_batch(step, batch["latents"])
            draws = ctx.objective.sample(latents, step_generator(ctx.args.seed, step, micro_step, acc.process_index, latents.device))
            captured = {"latents": latents, **draws}  # what an incident bundle stores to replay this micro-batch
            kept.append(oom_retry.Kept(latents, draws, batch["sample_ids"]))
            if oom_retry.remembered_size(guard, latents):  # this bucket is known not to fit whole: pieces below
                continue
            error, per_sample = None, None
            with faults.module_fault(step, acc.unwrap_model(model)):
                try:
                    faults.maybe_raise(step)
                    faults.maybe_oom(step, latents.shape[0])
                    with acc.autocast():
                        per_sample = ctx.objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"])
                    loss = per_sample.mean() * faults.loss_factor(step)  # the grad_spike drill
                except RuntimeError as exc:  # e.g. a CUDA error, an OOM or an injected fault: recover instead of dying
                    error = exc
                    # Every rank must still run the same collectives: a zero loss through the wrapped model keeps
                    # DDP's gradient all-reduce in step (one sample after an OOM, its memory released first), and
                    # the guard decides in lockstep: an OOM skips the step, another error rolls back.
                    keep = latents.shape[0]
                    if vidstab.recovery.oom.is_oom(exc):
                        vidstab.recovery.oom.release(exc, latents.device)
                        keep = 1
                    loss = model(torch.zeros_like(latents[:keep]), draws["timesteps"][:keep]).float().sum() * 0.0
                guard.backward(loss, batch=captured, sample_ids=batch["sample_ids"], per_sample_loss=per_sample,
                               timesteps=draws["timesteps"], error=error)
                faults.slow_down(step, time.perf_counter() - compute_started)
                faults.maybe_kill(step)
                ctx.beat(step, "guard")
                result = guard.step(ctx.args.max_grad_norm)
    size = oom_retry.remembered_size(guard, kept[0].latents)
    if size:
        result = oom_retry.run_in_pieces(ctx, step, kept, size)
    if oom_retry.failed_size(result):  # every rank alike: the same batch again, in smaller pieces
        result = oom_retry.retry_in_pieces(ctx, step, kept, result)
    if result.applied and ctx.ema is not None:
        ctx.ema.step(acc.unwrap_model(model).parameters())
    return result


class Run:
    """Everything one training run holds, so the loop below reads as the data flow it is."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        out = Path(args.output_dir)
        self.accelerator = build_accelerator(args)
        acc = self.accelerator
        # One run per folder: another live trainer, or the same command again without resuming, is refused.
        self.launch = LaunchInfo.from_env()
        if self.launch.is_restart and args.resume_from_checkpoint is None and not args.no_auto_resume:
            args.resume_from_checkpoint = "latest"  # a torch-elastic restart resumes (--no_auto_resume: not)
        self.run_lock = vidstab.claim_run_dir(acc, out, resume=args.resume_from_checkpoint,
                                              overwrite=args.overwrite_output_dir)
        set_seed(args.seed, device_specific=False)
        apply_backend_flags(args)
        self.faults = FaultInjector(args.inject_fault, acc.process_index, restart_count=self.launch.restart_count)
        self.watchdog: Watchdog | None = None

        cache, self.vae = build_latents(args, acc)
        self.cache = cache
        self.vae_on_device = None  # moved to the training device at the first validation
        self.reference_latents = None  # data clips the validation samples are compared with, read at the first validation
        latent_channels = cache[0]["latents"].shape[0]
        self.model = sharding.shard_model(acc, build_model(args, latent_channels), args.fsdp)
        self.objective = DiffusionObjective(objective_config(args))
        # Samples quarantined in this run folder (named bad by an incident) are kept out of later epochs and resumes.
        dataloader = torch.utils.data.DataLoader(
            vidstab.QuarantinedDataset(self.faults.worker_drill(cache), out), batch_size=args.train_batch_size, shuffle=True, drop_last=True, collate_fn=collate_latents,
            num_workers=args.dataloader_num_workers, generator=torch.Generator().manual_seed(args.seed),
        )
        if len(dataloader) == 0:
            raise SystemExit(f"data set of {len(cache)} clips is smaller than one batch of {args.train_batch_size}")
        # Per-process batches: the prepared dataloader is sharded over the processes.
        args.max_train_steps = resolve_max_train_steps(args, math.ceil(len(dataloader) / acc.num_processes))
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=scaled_learning_rate(args, acc.num_processes), betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
        )
        lr_scheduler = get_scheduler(args.lr_scheduler, optimizer, **lr_scheduler_kwargs(args, acc.num_processes))
        self.model, self.optimizer, self.dataloader, self.lr_scheduler = sharding.prepare(
            acc, args.fsdp, self.model, optimizer, dataloader, lr_scheduler)
        ds_clip = getattr(self.model, "gradient_clipping", None)  # DeepSpeed clips inside its own step
        refused = []  # every flag DeepSpeed cannot take, said at once
        if ds_clip is not None and float(ds_clip() or 0.0) != float(args.max_grad_norm or 0.0):
            refused.append(f"--max_grad_norm {args.max_grad_norm} differs from DeepSpeed's gradient_clipping "
                           f"{ds_clip()}, which is what clips under DeepSpeed: pass the same value to accelerate "
                           f"launch --gradient_clipping (or in the DeepSpeed config)")
        if args.use_ema and getattr(self.model, "zero_optimization_partition_weights", lambda: False)():
            refused.append("--use_ema is not supported under DeepSpeed ZeRO-3 (each rank holds a partition of the "
                           "weights): use --zero_stage 1 or 2 with --use_ema")
        if refused:
            raise SystemExit("\n".join(refused))
        self.ema = None
        if args.use_ema:
            from diffusers.training_utils import EMAModel  # it imports every diffusers model class: only runs with an EMA

            self.ema = EMAModel(acc.unwrap_model(self.model).parameters(), decay=args.ema_decay)

        unwrapped = acc.unwrap_model(self.model)
        guard_config = vidstab.GuardConfig.from_yaml(args.vidstab_config) if args.vidstab_config else vidstab.GuardConfig()
        if args.no_vidstab:
            guard_config.enabled = False
        guard_config.num_train_timesteps = args.num_train_timesteps
        guard_config.log_every = args.logging_steps  # --logging_steps: tracker interval (events JSONL gets every step)
        self.checkpoints = CheckpointManager(
            acc, out, config=CheckpointConfig(keep=args.checkpoints_total_limit, async_save=not args.no_async_save, sharded=args.fsdp or None,
                                          allow_world_size_change=args.fsdp,  # --fsdp: restore() re-derives it
                                          allow_other_run=args.allow_other_run_checkpoint),
            config_hash=vidstab.config_hash({k: v for k, v in vars(args).items() if k not in RUN_CONTROL_FLAGS}),
        )
        self.guard = vidstab.attach(
            acc, self.model, self.optimizer, self.lr_scheduler, config=guard_config, run_dir=out, seed=args.seed,
            model_spec=self.faults.model_spec({
                "class": "vidstab.reference.model:VideoDiT", "config": dict(unwrapped.config),
                "loss_fn": "vidstab.reference.objective:replay_loss", "loss_fn_kwargs": self.objective.to_dict(),
            }),
            checkpoint_fn=self.checkpoints.latest_path_str,
        )
        self.guard.set_replay_fn(lambda b: self.objective.per_sample_loss(unwrapped, b["latents"], b["noise"], b["timesteps"]))
        self.checkpoints.after_files_written = self.faults.maybe_kill_in_save  # the kill_in_save drill
        self.faults.arm_optimizer_step(self.optimizer, lambda: self.guard.global_step)  # the oom_in_step drill
        self.checkpoints.register("model", self.model)
        self.checkpoints.register("optimizer", self.optimizer)
        self.checkpoints.register("lr_scheduler", self.lr_scheduler)
        self.checkpoints.register("vidstab", self.guard)
        if self.ema is not None:
            self.checkpoints.register("ema", self.ema)
        self.recovery = Recovery(acc, self.checkpoints, self.guard, RecoveryConfig(max_retries=args.max_retries, skip_data=not args.replay_data_after_rollback), run_dir=out,
                                 reset=args.reset_recovery, form="trainer")
        self.goodput = GoodputLog(acc, out, args.goodput_steps)
        self.auto_interval = None if args.checkpointing_steps != "auto" else auto_interval(
            acc, out, expected_mtbf_hours=args.expected_mtbf_hours, guard_config=guard_config)
        self.batches_consumed = 0
        self.checkpoint_failures = 0
        self.data = None
        self.workers = ChildrenMemory()  # the loader workers' memory, for the record of one killed by a signal

    def save_due(self, step: int) -> bool:
        """Whether ``step`` is a --checkpointing_steps save (a fixed interval, or ``auto``'s current one)."""
        if self.auto_interval is not None:
            return self.auto_interval.due(step)
        return step % self.args.checkpointing_steps == 0

    def beat(self, step: int, phase: str) -> None:
        """Progress for the hang watchdog (a clock read; nothing crosses processes)."""
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def trainer_state(self, step: int) -> dict:
        epoch, index = divmod(self.batches_consumed, len(self.dataloader))
        return {"step": step, "batches_consumed": self.batches_consumed, "epoch": epoch, "batch_in_epoch": index,
                "seed": self.args.seed, "world_size": self.accelerator.num_processes}

    def restore(self, state: dict) -> int:
        self.batches_consumed = int(state["batches_consumed"])
        saved_world, world = int(state.get("world_size", self.accelerator.num_processes)), self.accelerator.num_processes
        if saved_world != world:  # only under --fsdp: CheckpointManager refuses it otherwise
            self._rederive_for_world_size(int(state["step"]), saved_world, world)
        self.data = batch_stream(self.accelerator, self.dataloader, self.batches_consumed, self.workers)
        return int(state["step"])

    def _rederive_for_world_size(self, step: int, saved_world: int, world: int) -> None:
        """A sharded checkpoint of ``saved_world`` processes resumed on ``world``: the model and optimizer were
        resharded by DCP; here the data position and the LR schedule are made right for the new world size.

        Data: the same number of samples consumed (each rank's micro-batches x world size), so the epoch and
        the position in it carry over; which sample lands on which rank changes (the sampler shards by rank).
        LR: Accelerate steps the wrapped scheduler once per process per optimizer step (diffusers' convention,
        ``num_training_steps * num_processes``), so its count is re-set to ``step * world`` and the LR recomputed.
        """
        self.batches_consumed = self.batches_consumed * saved_world // world
        inner = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        inner.last_epoch = step * world - 1
        inner.step()  # recomputes the LR for the re-set count
        logger.warning(f"resumed a checkpoint of {saved_world} process(es) on {world}: data position re-derived "
                       f"({self.batches_consumed} micro-batches per rank), LR schedule at step {step} of {world} "
                       f"process(es) (lr {inner.get_last_lr()[0]:.3g})", main_process_only=True)
        self.guard.events.log("warn", step, detector="world_size", message=f"resumed on {world} process(es) from {saved_world}",
                              figures={"saved_world_size": saved_world, "world_size": world}, bad_ranks=[])


def _checkpoint_failed(run: Run, step: int, error: CheckpointError) -> None:
    """A failed save never ends the run: earlier checkpoints are untouched (the writer only publishes a
    complete folder), so training goes on and the next interval tries again. Logged as a ``warn`` event
    (detector ``checkpoint``), which the report lists."""
    run.checkpoint_failures += 1
    intact = run.checkpoints.latest_path_str() or "none yet"
    message = f"checkpoint save failed ({error}); training continues, the next interval retries; newest intact checkpoint: {intact}"
    logger.warning(message, main_process_only=True)
    run.guard.events.log("warn", step, detector="checkpoint", message=message, figures={"failures": run.checkpoint_failures},
                         bad_ranks=[])


def save_checkpoint(run: Run, step: int) -> None:
    """Save ``step``; a failure of the previous (async) save or of this one is logged, not raised."""
    try:
        run.checkpoints.wait()  # surfaces the previous async save's failure before this one starts
    except CheckpointError as exc:
        _checkpoint_failed(run, step, exc)
    try:
        run.checkpoints.save(step, healthy=run.guard.healthy, trainer_state=run.trainer_state(step))
    except CheckpointError as exc:
        _checkpoint_failed(run, step, exc)


def finish_checkpoints(run: Run, step: int, retry: bool) -> bool:
    """Wait for the last save; True when it was written. A failed final save is retried once (``retry``:
    the model in memory is the one to keep; never after an abort)."""
    try:
        run.checkpoints.wait()
        return True
    except CheckpointError as exc:
        _checkpoint_failed(run, step, exc)
    if not retry:
        return False
    try:
        run.checkpoints.save(step, healthy=run.guard.healthy, trainer_state=run.trainer_state(step))
        run.checkpoints.wait()
        return True
    except CheckpointError as exc:
        _checkpoint_failed(run, step, exc)
        return False


def export_run(run: Run, model: VideoDiT, ema=None) -> dict:
    """``output_dir/transformer/`` (+ ``transformer_ema/``, ``vae/``, ``scheduler/``) of ``model``, the plain
    model (``sharding.full_model``), and ``ema`` (``sharding.full_ema``; default ``run.ema``): see
    recipes/export.py. Main process only."""
    args = run.args
    written = export_pipeline(
        args.output_dir, model, ema=run.ema if ema is None else ema, vae=run.vae, vae_path=args.vae,
        objective=run.objective.to_dict(), normalization=run.cache.normalization, latent_shape=run.cache.latent_shape,
    )
    run.guard.events.log("export", run.guard.global_step, folders={k: str(Path(v).relative_to(args.output_dir)) for k, v in written.items()})
    return written


def validate(run: Run, step: int) -> None:
    """Validation sampling during training (every rank calls it; the main process samples)."""
    if run.args.num_validation_videos < 1:
        return
    plain = sharding.full_model(run.accelerator, run.model, VideoDiT)
    ema = sharding.full_ema(run.accelerator, run.ema)  # every rank: a collective under --fsdp --use_ema
    if plain is not None:
        run_validation(run, step, plain, ema)


# --------------------------------------------------------------------------------------------------------
# Resilience: in-job restart (torch elastic) and last words for the next attempt (vidstab.run.elastic)
# --------------------------------------------------------------------------------------------------------
def incident_note(args: argparse.Namespace, rank: int, step: int, bundle: Path) -> str:
    """One line for an incident bundle just written: where it is, the command that replays it, and whether the
    replay will have trained weights (the bundle names a checkpoint) or only a fresh initialisation."""
    from vidstab.files.limits import read_json_file

    try:
        checkpoint = read_json_file(Path(bundle) / "incident.json").get("checkpoint")
    except (OSError, ValueError, AttributeError):
        checkpoint = None
    line = f"step {step}, rank {rank}: incident bundle {bundle}; replay it with: vidstab replay {bundle}"
    if not checkpoint:
        line += (f" (no checkpoint was saved before step {step}, --checkpointing_steps {args.checkpointing_steps}: the "
                 f"replay runs on a fresh initialisation, so only data problems reproduce; a smaller "
                 f"--checkpointing_steps keeps trained weights to replay on)")
    return line


def incidents_summary(output_dir: str) -> str:
    """``incidents N (newest ...; replay: vidstab replay ...), `` for the end-of-run line, or nothing."""
    bundles = vidstab.list_incidents(output_dir)
    if not bundles:
        return ""
    return f"incidents {len(bundles)} (newest {bundles[-1]}; replay: vidstab replay {bundles[-1]}), "


def finished_before(args: argparse.Namespace, step: int) -> bool:
    """Whether a resume at ``step`` finds a run that already ended cleanly there (its last ``stop`` event: exit 0
    after the export, at the last step): then there is nothing to train, export or report again. A run killed
    between its last checkpoint and its export has no such event and finishes its end-of-run work."""
    stops = vidstab.read_events(args.output_dir, "stop")
    last = stops[-1] if stops else None
    return (step >= args.max_train_steps and last is not None and last.get("exit_code") == 0
            and isinstance(last.get("step"), int) and last["step"] >= args.max_train_steps)


def restart_record(run: Run) -> dict | None:
    """Why a torch-elastic restart happened (None on a first attempt). Resuming from the latest valid checkpoint
    is decided in ``Run.__init__``, before the run folder is claimed."""
    store_warning = shared_store_warning()
    if store_warning and run.accelerator.is_main_process:
        logger.warning(store_warning)
    if not run.launch.is_restart:
        return None
    return {"restart_count": run.launch.restart_count, "max_restarts": run.launch.max_restarts,
            **previous_attempt(run.args.output_dir)}


@contextlib.contextmanager
def watching(run: Run):
    """The hang watchdog over the training loop (``--watchdog_timeout 0``: none); stopped however the loop ends."""
    if not run.args.watchdog_timeout:
        yield None
        return
    with Watchdog(run.args.output_dir, run.accelerator.process_index, watchdog_config(run.args)) as run.watchdog:
        yield run.watchdog
    run.watchdog = None


@contextlib.contextmanager
def logged_crash(run: "Run"):
    """An exception that ends the run leaves a ``crash`` event: the next attempt's restart event names it. A
    data-loader worker killed by a signal is also recorded with the memory history, and said in one message."""
    guard = run.guard
    try:
        yield
    except Exception as exc:
        killed = record_worker_killed(exc, guard.events, guard.global_step, guard.rank, guard.reporter.host_memory,
                                      run.workers.history)
        guard.events.log("crash", guard.global_step, error=f"{type(exc).__name__}: {exc}"[:1000])
        if killed is not None:
            raise killed from exc
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    with run.run_lock:  # released at the end: the next launch must not take a finished run for a killed one
        return train(run)


def train(run: Run) -> int:
    """Resume or start, train to --max_train_steps, save, export, validate, report; returns the exit code."""
    args, acc, guard = run.args, run.accelerator, run.guard
    if acc.is_main_process:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        # The flags as given, then what the run actually ran with (precision from `accelerate launch`, versions).
        record = {**vars(args), "run": run_environment(acc)}
        (Path(args.output_dir) / "train_config.yaml").write_text(yaml.safe_dump(record, sort_keys=True))
    acc.init_trackers(args.tracker_name, config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    if args.audit:
        from vidstab.tools.audit import audit_before_training

        sample = next(iter(run.dataloader))
        report = audit_before_training(acc.unwrap_model(run.model), sample["latents"], sample["sample_ids"], vars(args), None)
        report.extend(preflight.bucket_memory(run, sample))  # the bucket's peak memory and headroom
        acc.print(report.format_table())
        if report.blocking:
            acc.print("audit found blocking problems; not training (see the table above)")
            return 1

    step = 0
    restart = restart_record(run)
    if args.resume_from_checkpoint:
        try:
            state = run.checkpoints.load(args.resume_from_checkpoint)
        except CheckpointError as exc:  # no such checkpoint, every one damaged, another world size: say which
            acc.print(f"--resume_from_checkpoint {args.resume_from_checkpoint}: {exc}")
            return 2
        if state is None:
            acc.print(f"no checkpoint found for --resume_from_checkpoint {args.resume_from_checkpoint}; starting from scratch")
        else:
            step = run.restore(state)
            guard.reapply_lr_multiplier()
            if finished_before(args, step):
                acc.print(f"the run in {args.output_dir} already finished: step {step} of --max_train_steps "
                          f"{args.max_train_steps}, exported and reported; nothing to do. Raise --max_train_steps to "
                          f"train on from step {step}.")
                acc.end_training()
                return 0
            run.recovery.check_resume(step)  # the first replayed steps against what the original run logged
    if restart is not None:
        guard.events.log("restart", step, **restart, resumed_from=run.checkpoints.latest_path_str() if step else None)
        acc.print(f"restart {restart['restart_count']}/{restart['max_restarts']} after {restart['cause']} "
                  f"(ranks {restart['culprit_ranks']}): resuming at step {step}")
    if run.data is None:
        run.data = batch_stream(acc, run.dataloader, 0, run.workers)
    guard.global_step = step

    progress = tqdm(total=args.max_train_steps, initial=step, desc="steps", disable=not acc.is_local_main_process)
    first_loss, last_loss, started = None, None, time.time()
    exit_code = 0
    with watching(run), logged_crash(run), PreemptionHandler(on_signal=guard.request_stop, watch_parent=True):
        while step < args.max_train_steps:
            run.faults.adjust_lr(step, run.optimizer, run.lr_scheduler)
            result = train_step(run, step)
            for bundle in result.incidents:  # written by this rank: said by this rank, where and how to replay it
                print(incident_note(args, acc.process_index, step, bundle), flush=True)
            step += 1
            if result.applied and math.isfinite(result.loss):
                first_loss = result.loss if first_loss is None else first_loss
                last_loss = result.loss
            progress.update(1)
            progress.set_postfix(loss=f"{result.loss:.4f}", gnorm=f"{result.grad_norm:.3g}", lr=f"{run.lr_scheduler.get_last_lr()[0]:.2e}", skipped=guard.skipped_total)

            if result.rollback is not None:
                run.beat(step, "checkpoint")
                try:
                    state = run.recovery.rollback(result.rollback, step, incident=result.incident,
                                                  cause=rollback_cause(result.rollback, result.findings, result.rerun))
                except RunAborted as exc:
                    acc.print(str(exc))
                    exit_code = 3
                    break
                acc.log({"vidstab/rollbacks": run.recovery.retries, "vidstab/lr_multiplier": guard.lr_multiplier}, step=step)
                run.faults.on_rollback()
                step = int(state["step"])
                progress.n = step
                if not state.get("skip_data", True):
                    run.restore(state)  # replay the same data (rewind to the checkpoint's position)
                continue
            run.recovery.on_step(step, skipped=result.skipped)  # incident over, gradual return of a backed-off LR
            if run.save_due(step) or step == args.max_train_steps or result.stop:
                run.beat(step, "checkpoint")
                save_checkpoint(run, step)
                if run.auto_interval is not None:
                    run.auto_interval.saved(guard.events, step)
            if args.validation_steps and step % args.validation_steps == 0 and step < args.max_train_steps:
                validate(run, step)
            run.goodput.maybe_log(guard.events, step)
            if result.stop:
                acc.print(f"stop requested (signal): saved step {step}; resume with --resume_from_checkpoint latest")
                break
        # Still under the handler: a SIGTERM now must not kill the final (async) checkpoint write.
        run.beat(step, "checkpoint")
        if not finish_checkpoints(run, step, retry=exit_code == 0) and exit_code == 0:
            exit_code = 4  # trained to the end, but the final state is not on disk
    progress.close()
    acc.wait_for_everyone()
    exported = None
    # The final checkpoint is on disk; a SIGTERM now lets the export finish and the run end normally (exit 0).
    with PreemptionHandler():
        if exit_code == 0 and step >= args.max_train_steps:
            plain = sharding.full_model(acc, run.model, VideoDiT)  # every rank: a collective under --fsdp
            ema = sharding.full_ema(acc, run.ema)
            if acc.is_main_process:
                exported = export_run(run, plain, ema)
                run_validation(run, step, plain, ema)
        acc.wait_for_everyone()
    guard.events.log("stop", step, exit_code=exit_code, seconds=round(time.time() - started, 2))
    run.goodput.log(guard.events, step)
    acc.end_training()
    if acc.is_main_process:
        report_path = "(not written: --no_html_report)"
        try:
            if not args.no_html_report:
                from vidstab.tools.report import write_report

                report_path = write_report(args.output_dir)
        except Exception as exc:  # the dashboard must never turn a finished run into a failed one
            report_path = f"(report failed: {exc})"
        acc.print(
            f"done: {step}/{args.max_train_steps} steps, loss {first_loss if first_loss is None else round(first_loss, 4)} -> "
            f"{last_loss if last_loss is None else round(last_loss, 4)}, skipped {guard.skipped_total}, "
            + incidents_summary(args.output_dir)
            + (f"checkpoint saves failed {run.checkpoint_failures} (newest intact: {run.checkpoints.latest_path_str()}), "
               if run.checkpoint_failures else "") +
            f"outputs in {args.output_dir} (vidstab/checkpoints/, logs/, vidstab/events-rank*.jsonl{', transformer/, validation/' if exported else ''}, "
            f"report: {report_path})"
        )
    return exit_code


def run_main(argv: list[str] | None = None) -> int:
    """:func:`main`; a launch that cannot start (the output folder, the launch, the config, the checkpoint) ends with
    one line naming the problem and exit code 2, not a traceback; the main process says it, the others only exit."""
    user_errors = (vidstab.run.run_dir.RunDirError, vidstab.run.elastic.LaunchMismatch, vidstab.ConfigError, CheckpointError)
    try:
        return main(argv)
    except DataLoaderWorkerKilled:  # said in one message by the rank it happened on, and in its event log
        return 1
    except user_errors as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"recipes/train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except BadSampleError as exc:  # a video of --data_dir, said by the rank that read it (the main process first)
        advice = " (--skip_bad_samples skips the videos that cannot be used, each one said)" if exc.file else ""
        print(f"recipes/train.py: error: {exc}{advice}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(run_main())
