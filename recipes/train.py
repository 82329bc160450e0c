#!/usr/bin/env python
"""Reference latent video DiT trainer on Hugging Face Accelerate, with vidstab on by default.

    accelerate launch recipes/train.py                        # tiny built-in run, a few minutes on 2 CPU cores
    accelerate launch recipes/train.py --config recipes/configs/small.yaml --output_dir runs/small
    accelerate launch recipes/train.py --resume_from_checkpoint latest
    accelerate launch recipes/train.py --inject_fault nan_batch@20:1  # drill: watch vidstab skip and capture it
    accelerate launch --multi_gpu --rdzv_backend c10d --max_restarts 3 recipes/train.py --resume_from_checkpoint latest
                                       # survives hung and dead ranks: README, "Launching a run that survives faults"

Data flow of one optimizer step (``train_step`` below): for each of ``gradient_accumulation_steps``
micro-batches: latents -> timesteps + noise (seeded per step, micro-step and rank) -> DiT -> fp32 per-sample
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
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from tqdm.auto import tqdm

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointManager
from vidstab.elastic import LaunchInfo, previous_attempt, shared_store_warning
from vidstab.faults import FaultInjector, validate_faults
from vidstab.preemption import PreemptionHandler
from vidstab.recovery import Recovery, RecoveryConfig, RunAborted
from vidstab.reference.data import moving_shapes_dataset, video_folder_dataset
from vidstab.reference.model import VideoDiT
from vidstab.reference.objective import DiffusionObjective, ObjectiveConfig, step_generator
from vidstab.reference.vae import build_vae, collate_latents, encode_to_cache
from vidstab.watchdog import Watchdog, WatchdogConfig

logger = get_logger("vidstab.train")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"
# Flags that steer a run but not its numbers: a resume may change them without a "config changed" warning.
RUN_CONTROL_FLAGS = {
    "config", "output_dir", "max_train_steps", "resume_from_checkpoint", "checkpointing_steps", "checkpoints_total_limit",
    "no_async_save", "report_to", "logging_steps", "dataloader_num_workers", "inject_fault", "audit", "max_retries",
    "watchdog_timeout", "watchdog_multiple", "watchdog_first_step", "no_auto_resume",
}


# --------------------------------------------------------------------------------------------------------
# Arguments: diffusers-style flags; a YAML --config supplies defaults and the command line overrides it.
# --------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", type=str, default=str(DEFAULT_CONFIG), help="YAML file of defaults for any flag below.")
    run = p.add_argument_group("run")
    run.add_argument("--output_dir", type=str, default="output/vidstab-tiny")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--max_train_steps", type=int, default=300)
    run.add_argument("--train_batch_size", type=int, default=8, help="Per-device micro-batch size.")
    run.add_argument("--gradient_accumulation_steps", type=int, default=1)
    run.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    run.add_argument("--report_to", type=str, default="tensorboard", help='Tracker(s) for `log_with`: "tensorboard", "wandb", "all" or "none".')
    run.add_argument("--logging_steps", type=int, default=1, help="Tracker logging interval in optimizer steps.")
    run.add_argument("--dataloader_num_workers", type=int, default=0)
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--learning_rate", type=float, default=3e-4)
    opt.add_argument("--lr_scheduler", type=str, default="constant_with_warmup", help="diffusers.optimization.get_scheduler name.")
    opt.add_argument("--lr_warmup_steps", type=int, default=20, help="Linear warm-up (the seed: never a fixed LR at start).")
    opt.add_argument("--adam_beta1", type=float, default=0.9)
    opt.add_argument("--adam_beta2", type=float, default=0.999)
    opt.add_argument("--adam_weight_decay", type=float, default=0.0)
    opt.add_argument("--adam_epsilon", type=float, default=1e-8)
    opt.add_argument("--max_grad_norm", type=float, default=1.0)
    opt.add_argument("--use_ema", action="store_true")
    opt.add_argument("--ema_decay", type=float, default=0.999)
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpointing_steps", type=int, default=100)
    ckpt.add_argument("--checkpoints_total_limit", type=int, default=3, help="Newest K kept (plus the last good one).")
    ckpt.add_argument("--resume_from_checkpoint", type=str, default=None, help='A checkpoint folder, "latest" or "last_good".')
    ckpt.add_argument("--no_async_save", action="store_true", help="Write checkpoints in the foreground.")
    model = p.add_argument_group("model and objective")
    model.add_argument("--prediction_type", type=str, default="epsilon", choices=["epsilon", "v_prediction", "flow_matching"])
    model.add_argument("--num_train_timesteps", type=int, default=1000)
    model.add_argument("--hidden_size", type=int, default=64)
    model.add_argument("--num_layers", type=int, default=2)
    model.add_argument("--num_heads", type=int, default=4)
    model.add_argument("--attention_type", type=str, default="factorized", choices=["full", "factorized"])
    model.add_argument("--pos_embed", type=str, default="rope", choices=["rope", "sincos"])
    model.add_argument("--gradient_checkpointing", action="store_true")
    data = p.add_argument_group("data and VAE")
    data.add_argument("--data_dir", type=str, default=None, help="Folder of video files (decoded with PyAV); default: built-in moving shapes.")
    data.add_argument("--num_videos", type=int, default=64, help="Size of the built-in moving-shapes data set.")
    data.add_argument("--num_frames", type=int, default=9, help="Frames per clip (Wan VAE: 1 + 4k).")
    data.add_argument("--resolution", type=int, default=32)
    data.add_argument("--frame_stride", type=int, default=1)
    data.add_argument("--skip_bad_samples", action="store_true", help="Skip and record undecodable/empty/short/non-finite videos.")
    data.add_argument("--vae", type=str, default=None, help="Local diffusers VAE folder; default: tiny seeded random AutoencoderKLWan.")
    data.add_argument("--latent_channels", type=int, default=4)
    data.add_argument("--latent_clamp", type=float, default=None, help="Clamp normalised latents to [-x, x] at encode time.")
    stab = p.add_argument_group("vidstab")
    stab.add_argument("--no_vidstab", action="store_true", help="Plain Accelerate step (for comparison).")
    stab.add_argument("--vidstab_config", type=str, default=None, help="YAML of vidstab.GuardConfig fields.")
    stab.add_argument("--max_retries", type=int, default=3, help="Rollbacks before the run stops.")
    stab.add_argument("--replay_data_after_rollback", action="store_true", help="Rewind data to the checkpoint instead of skipping it (PaLM).")
    stab.add_argument("--inject_fault", action="append", default=[], metavar="KIND@STEP[:RANK][=ARG]",
                      help="nan_batch, inf_latent, lr_spike, exception, inf_module, hang, kill, slow (vidstab.faults).")
    stab.add_argument("--audit", action="store_true", help="Run the preflight audit before training; stop on blocking findings.")
    add_resilience_flags(p)
    return p


def add_resilience_flags(p: argparse.ArgumentParser) -> None:
    """Hang watchdog and in-job restart (vidstab.watchdog, vidstab.elastic); see README "Launching a run that survives faults"."""
    res = p.add_argument_group("resilience")
    res.add_argument("--watchdog_timeout", type=float, default=300.0, metavar="SECONDS",
                     help="A rank that makes no progress for max(SECONDS, multiple x its slowest step) dumps its stacks and "
                          "exits 75 so the launcher restarts the job; 0 turns the watchdog off.")
    res.add_argument("--watchdog_multiple", type=float, default=10.0, help="Multiple of the slowest step/checkpoint seen.")
    res.add_argument("--watchdog_first_step", type=float, default=900.0, metavar="SECONDS",
                     help="Allowance until the first step and the first checkpoint have completed.")
    res.add_argument("--no_auto_resume", action="store_true",
                     help="After a torch-elastic restart, start over instead of resuming from the latest checkpoint.")


def check_resilience_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Faults that can never fire and impossible watchdog settings are flag errors, not silent no-ops."""
    try:
        validate_faults(args.inject_fault, world_size=int(os.environ.get("WORLD_SIZE", "1")), max_steps=args.max_train_steps)
        if args.watchdog_timeout:
            watchdog_config(args)
    except ValueError as exc:
        parser.error(str(exc).replace("WatchdogConfig.timeout_s", "--watchdog_timeout")
                     .replace("WatchdogConfig.multiple", "--watchdog_multiple").replace("WatchdogConfig.first_step_s", "--watchdog_first_step"))


def watchdog_config(args: argparse.Namespace) -> WatchdogConfig:
    return WatchdogConfig(timeout_s=args.watchdog_timeout, multiple=args.watchdog_multiple, first_step_s=args.watchdog_first_step)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        path = Path(pre.config)
        if not path.is_file():
            parser.error(f"--config {path}: no such file")
        values = yaml.safe_load(path.read_text()) or {}
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"--config {path}: unknown key(s) {unknown}; every key must be a flag name")
        parser.set_defaults(**values)
    args = parser.parse_args(argv)
    for name in ("max_train_steps", "train_batch_size", "gradient_accumulation_steps", "checkpointing_steps", "num_frames", "resolution"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    check_resilience_flags(parser, args)
    return args


# --------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------
def build_latents(args: argparse.Namespace, accelerator: Accelerator):
    """Videos -> VAE latents, encoded once by the main process and cached as safetensors shards."""
    with accelerator.main_process_first():
        if args.data_dir:
            videos, skipped = video_folder_dataset(
                args.data_dir, args.num_frames, args.resolution, frame_stride=args.frame_stride, skip_bad_samples=args.skip_bad_samples
            )
            for record in skipped:
                logger.warning(f"skipped bad sample {record['sample_id']}: {record['reason']}", main_process_only=True)
        else:
            videos = moving_shapes_dataset(args.num_videos, args.num_frames, args.resolution, seed=args.seed)
        vae = build_vae(args.vae, seed=args.seed, latent_channels=args.latent_channels)
        log = (lambda msg: logger.info(msg)) if accelerator.is_main_process else (lambda msg: None)
        cache = encode_to_cache(videos, vae, Path(args.output_dir) / "latent_cache", clamp=args.latent_clamp, log=log)
    return cache


def build_model(args: argparse.Namespace, latent_channels: int) -> VideoDiT:
    model = VideoDiT(
        in_channels=latent_channels, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
        attention_type=args.attention_type, pos_embed=args.pos_embed, num_train_timesteps=args.num_train_timesteps,
    )
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model


def batch_stream(accelerator: Accelerator, dataloader, start: int):
    """Endless micro-batches from position ``start`` (micro-batches consumed so far), epoch-seeded order.

    The order depends only on (seed, epoch), so a resumed run sees the same batches as an uninterrupted one.
    """
    epoch, index = divmod(start, len(dataloader))
    while True:
        dataloader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(dataloader, index) if index else dataloader
        yield from loader
        epoch, index = epoch + 1, 0


# --------------------------------------------------------------------------------------------------------
# The training step (the only place backward, clip and the optimizer meet is guard.step)
# --------------------------------------------------------------------------------------------------------
def train_step(ctx: "Run", step: int) -> vidstab.StepResult:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches."""
    acc, model, guard, faults = ctx.accelerator, ctx.model, ctx.guard, ctx.faults
    for micro_step in range(acc.gradient_accumulation_steps):
        ctx.beat(step, "data")
        faults.maybe_hang(step)
        batch = next(ctx.data)
        ctx.batches_consumed += 1
        ctx.beat(step, "forward_backward")
        compute_started = time.perf_counter()
        with acc.accumulate(model):
            latents, _ = faults.corrupt_batch(step, batch["latents"])
            draws = ctx.objective.sample(latents, step_generator(ctx.args.seed, step, micro_step, acc.process_index))
            captured = {"latents": latents, **draws}  # what an incident bundle stores to replay this micro-batch
            error, per_sample = None, None
            with faults.module_fault(step, acc.unwrap_model(model)):
                try:
                    faults.maybe_raise(step)
                    with acc.autocast():
                        per_sample = ctx.objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"])
                    loss = per_sample.mean()
                except RuntimeError as exc:  # e.g. a CUDA error or an injected fault: recover instead of dying
                    error = exc
                    # Every rank must still run the same collectives: a zero loss through the wrapped model keeps
                    # DDP's gradient all-reduce in step, and the guard turns the error into a lockstep rollback.
                    loss = model(torch.zeros_like(latents), draws["timesteps"]).float().sum() * 0.0
                guard.backward(loss, batch=captured, sample_ids=batch["sample_ids"], per_sample_loss=per_sample,
                               timesteps=draws["timesteps"], error=error)
                faults.slow_down(step, time.perf_counter() - compute_started)
                faults.maybe_kill(step)
                ctx.beat(step, "guard")
                result = guard.step(ctx.args.max_grad_norm)
    if result.applied and ctx.ema is not None:
        ctx.ema.step(acc.unwrap_model(model).parameters())
    return result


class Run:
    """Everything one training run holds, so the loop below reads as the data flow it is."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        out = Path(args.output_dir)
        trackers = None if args.report_to == "none" else args.report_to
        self.accelerator = Accelerator(
            mixed_precision=args.mixed_precision,
            log_with=trackers,
            project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
            # One optimizer step is exactly `gradient_accumulation_steps` micro-batches, across epoch ends too.
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        )
        acc = self.accelerator
        set_seed(args.seed, device_specific=False)
        self.launch = LaunchInfo.from_env()
        self.faults = FaultInjector(args.inject_fault, acc.process_index, restart_count=self.launch.restart_count)
        self.watchdog: Watchdog | None = None

        cache = build_latents(args, acc)
        latent_channels = cache[0]["latents"].shape[0]
        self.model = build_model(args, latent_channels)
        self.objective = DiffusionObjective(ObjectiveConfig(prediction_type=args.prediction_type, num_train_timesteps=args.num_train_timesteps))
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
        )
        # diffusers convention: the prepared scheduler steps once per process per optimizer step.
        lr_scheduler = get_scheduler(
            args.lr_scheduler, optimizer, num_warmup_steps=args.lr_warmup_steps * acc.num_processes,
            num_training_steps=args.max_train_steps * acc.num_processes,
        )
        dataloader = torch.utils.data.DataLoader(
            cache, batch_size=args.train_batch_size, shuffle=True, drop_last=True, collate_fn=collate_latents,
            num_workers=args.dataloader_num_workers, generator=torch.Generator().manual_seed(args.seed),
        )
        if len(dataloader) == 0:
            raise SystemExit(f"data set of {len(cache)} clips is smaller than one batch of {args.train_batch_size}")
        self.model, self.optimizer, self.dataloader, self.lr_scheduler = acc.prepare(self.model, optimizer, dataloader, lr_scheduler)
        self.ema = EMAModel(acc.unwrap_model(self.model).parameters(), decay=args.ema_decay) if args.use_ema else None

        unwrapped = acc.unwrap_model(self.model)
        guard_config = vidstab.GuardConfig.from_yaml(args.vidstab_config) if args.vidstab_config else vidstab.GuardConfig()
        if args.no_vidstab:
            guard_config.enabled = False
        guard_config.num_train_timesteps = args.num_train_timesteps
        self.checkpoints = CheckpointManager(
            acc, out, config=CheckpointConfig(keep=args.checkpoints_total_limit, async_save=not args.no_async_save),
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
        self.checkpoints.register("model", self.model)
        self.checkpoints.register("optimizer", self.optimizer)
        self.checkpoints.register("lr_scheduler", self.lr_scheduler)
        self.checkpoints.register("vidstab", self.guard)
        if self.ema is not None:
            self.checkpoints.register("ema", self.ema)
        self.recovery = Recovery(acc, self.checkpoints, self.guard, RecoveryConfig(max_retries=args.max_retries, skip_data=not args.replay_data_after_rollback), run_dir=out)
        self.batches_consumed = 0
        self.data = None

    def beat(self, step: int, phase: str) -> None:
        """Progress for the hang watchdog (a clock read; nothing crosses processes)."""
        if self.watchdog is not None:
            self.watchdog.beat(step, phase)

    def trainer_state(self, step: int) -> dict:
        epoch, index = divmod(self.batches_consumed, len(self.dataloader))
        return {"step": step, "batches_consumed": self.batches_consumed, "epoch": epoch, "batch_in_epoch": index, "seed": self.args.seed}

    def restore(self, state: dict) -> int:
        self.batches_consumed = int(state["batches_consumed"])
        self.data = batch_stream(self.accelerator, self.dataloader, self.batches_consumed)
        return int(state["step"])


# --------------------------------------------------------------------------------------------------------
# Resilience: in-job restart (torch elastic) and last words for the next attempt (vidstab.elastic)
# --------------------------------------------------------------------------------------------------------
def auto_resume_after_restart(run: Run) -> dict | None:
    """On a torch-elastic restart, resume from the latest valid checkpoint unless told otherwise; why it restarted."""
    store_warning = shared_store_warning()
    if store_warning and run.accelerator.is_main_process:
        logger.warning(store_warning)
    if not run.launch.is_restart:
        return None
    if run.args.resume_from_checkpoint is None and not run.args.no_auto_resume:
        run.args.resume_from_checkpoint = "latest"
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
def logged_crash(guard: vidstab.Guard):
    """An exception that ends the run leaves a ``crash`` event: the next attempt's restart event names it."""
    try:
        yield
    except Exception as exc:
        guard.events.log("crash", guard.global_step, error=f"{type(exc).__name__}: {exc}"[:1000])
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    acc, guard = run.accelerator, run.guard
    if acc.is_main_process:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "train_config.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=True))
    acc.init_trackers("vidstab", config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    if args.audit:
        from vidstab.audit import audit_before_training

        sample = next(iter(run.dataloader))
        report = audit_before_training(acc.unwrap_model(run.model), sample["latents"], sample["sample_ids"], vars(args), None)
        acc.print(report.format_table())
        if report.blocking:
            acc.print("audit found blocking problems; not training (see the table above)")
            return 1

    step = 0
    restart = auto_resume_after_restart(run)
    if args.resume_from_checkpoint:
        state = run.checkpoints.load(args.resume_from_checkpoint)
        if state is None:
            acc.print(f"no checkpoint found for --resume_from_checkpoint {args.resume_from_checkpoint}; starting from scratch")
        else:
            step = run.restore(state)
            guard.reapply_lr_multiplier()
            guard.events.log("resume", step, checkpoint=str(run.checkpoints.last_loaded))
    if restart is not None:
        guard.events.log("restart", step, **restart, resumed_from=run.checkpoints.latest_path_str() if step else None)
        acc.print(f"restart {restart['restart_count']}/{restart['max_restarts']} after {restart['cause']} "
                  f"(ranks {restart['culprit_ranks']}): resuming at step {step}")
    if run.data is None:
        run.data = batch_stream(acc, run.dataloader, 0)
    guard.global_step = step

    progress = tqdm(total=args.max_train_steps, initial=step, desc="steps", disable=not acc.is_local_main_process)
    first_loss, last_loss, started = None, None, time.time()
    exit_code = 0
    with watching(run), logged_crash(guard), PreemptionHandler(on_signal=guard.request_stop, watch_parent=True):
        while step < args.max_train_steps:
            run.faults.adjust_lr(step, run.optimizer, run.lr_scheduler)
            result = train_step(run, step)
            step += 1
            if result.applied and math.isfinite(result.loss):
                first_loss = result.loss if first_loss is None else first_loss
                last_loss = result.loss
            progress.update(1)
            progress.set_postfix(loss=f"{result.loss:.4f}", gnorm=f"{result.grad_norm:.3g}", lr=f"{run.lr_scheduler.get_last_lr()[0]:.2e}", skipped=guard.skipped_total)

            if result.rollback is not None:
                run.beat(step, "checkpoint")
                try:
                    state = run.recovery.rollback(result.rollback, step, incident=str(result.incident) if result.incident else None)
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
            if step % args.checkpointing_steps == 0 or step == args.max_train_steps or result.stop:
                run.beat(step, "checkpoint")
                run.checkpoints.save(step, healthy=guard.healthy, trainer_state=run.trainer_state(step))
            if result.stop:
                acc.print(f"stop requested (signal): saved step {step}; resume with --resume_from_checkpoint latest")
                break
        # Still under the handler: a SIGTERM now must not kill the final (async) checkpoint write.
        run.beat(step, "checkpoint")
        run.checkpoints.wait()
    progress.close()
    acc.wait_for_everyone()
    guard.events.log("stop", step, exit_code=exit_code, seconds=round(time.time() - started, 2))
    acc.end_training()
    if acc.is_main_process:
        try:
            from vidstab.report import write_report

            report_path = write_report(args.output_dir)
        except Exception as exc:  # the dashboard must never turn a finished run into a failed one
            report_path = f"(report failed: {exc})"
        acc.print(
            f"done: {step}/{args.max_train_steps} steps, loss {first_loss if first_loss is None else round(first_loss, 4)} -> "
            f"{last_loss if last_loss is None else round(last_loss, 4)}, skipped {guard.skipped_total}, "
            f"outputs in {args.output_dir} (checkpoints/, logs/, vidstab/events-rank*.jsonl, report: {report_path})"
        )
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
