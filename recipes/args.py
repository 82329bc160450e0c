"""Command-line flags of the reference trainer, with diffusers' names and meanings.

A YAML ``--config`` supplies defaults for any flag and the command line overrides it. Config values go
through the same checks as typed flags (type, choices, ranges), so ``learning_rate: true`` is refused
with a message naming the key instead of training at LR 1.0. Flags follow the diffusers example scripts
(``examples/cogvideo/train_cogvideox_lora.py``, ``examples/text_to_image/train_text_to_image.py``):
``--mixed_precision`` defaults to None and defers to ``accelerate config`` / ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import yaml

from vidstab.faults import FAULT_KINDS

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"
#: Optimizer steps of a run when neither --max_train_steps nor --num_train_epochs is given.
DEFAULT_MAX_TRAIN_STEPS = 300
# Flags that steer a run but not its numbers: a resume may change them without a "config changed" warning.
RUN_CONTROL_FLAGS = {
    "config", "output_dir", "max_train_steps", "num_train_epochs", "resume_from_checkpoint", "checkpointing_steps",
    "checkpoints_total_limit", "no_async_save", "report_to", "logging_steps", "logging_dir", "tracker_name",
    "dataloader_num_workers", "inject_fault", "audit", "max_retries", "validation_steps", "num_validation_videos",
    "validation_num_inference_steps", "overwrite_output_dir", "reset_recovery",
    "watchdog_timeout", "watchdog_multiple", "watchdog_first_step", "no_auto_resume", "no_html_report",
    "allow_other_run_checkpoint",
    "goodput_steps", "expected_mtbf_hours",
}
MIXED_PRECISION = ["no", "fp16", "bf16"]
REPORT_TO = ["tensorboard", "wandb", "all", "none"]
LR_SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
WEIGHTING_SCHEMES = ["sigma_sqrt", "logit_normal", "mode", "cosmap", "none"]
# Integer flags that must be >= 1 (None stays allowed where the default is None).
POSITIVE_INTS = (
    "max_train_steps", "num_train_epochs", "train_batch_size", "gradient_accumulation_steps",
    "num_frames", "resolution", "height", "width", "logging_steps", "validation_steps", "validation_num_inference_steps",
    "num_train_timesteps", "hidden_size", "num_layers", "num_heads", "num_videos", "frame_stride", "lr_num_cycles",
    "latent_channels",
)
NON_NEGATIVE = ("lr_warmup_steps", "num_validation_videos", "dataloader_num_workers", "max_retries", "adam_weight_decay",
                "goodput_steps")
POSITIVE_FLOATS = ("learning_rate", "adam_epsilon", "max_grad_norm", "lr_power", "flow_shift", "logit_std", "mode_scale",
                   "expected_mtbf_hours")


def steps_or_auto(value: object) -> int | str:
    """``--checkpointing_steps``: an integer >= 1, or ``auto`` (chosen from the run's measurements)."""
    if value == "auto":
        return "auto"
    try:
        steps = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        steps = None
    if steps is None or steps < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or auto, got {value!r}")
    return steps


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``recipes/train.py``, grouped as the diffusers example scripts group them."""
    p = argparse.ArgumentParser(description="Reference latent video DiT trainer on Hugging Face Accelerate, with vidstab on by default.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", type=str, default=str(DEFAULT_CONFIG), help="YAML file of defaults for any flag below.")
    run = p.add_argument_group("run")
    run.add_argument("--output_dir", type=str, default="output/vidstab-tiny", help='Run folder: checkpoints, event logs, incidents, report, exported model.')
    run.add_argument("--seed", type=int, default=0, help='Seed of the model initialisation, data order and noise (every rank derives its own from it).')
    run.add_argument("--max_train_steps", type=int, default=None,
                     help=f"Optimizer steps; overrides --num_train_epochs. Neither given: {DEFAULT_MAX_TRAIN_STEPS}.")
    run.add_argument("--num_train_epochs", type=int, default=None, help="Passes over the data set (used when --max_train_steps is not given).")
    run.add_argument("--train_batch_size", type=int, default=8, help="Per-device micro-batch size.")
    run.add_argument("--gradient_accumulation_steps", type=int, default=1, help='Micro-batches per optimizer step.')
    run.add_argument("--mixed_precision", type=str, default=None, choices=MIXED_PRECISION,
                     help="Default: whatever `accelerate config` / `accelerate launch --mixed_precision` says.")
    run.add_argument("--allow_tf32", action="store_true", help="Allow TF32 matmuls and convolutions on Ampere+ GPUs.")
    run.add_argument("--report_to", type=str, default="tensorboard", choices=REPORT_TO, help="Tracker for `log_with`.")
    run.add_argument("--no_html_report", action="store_true",
                     help="Do not write OUTPUT_DIR/report.html at the end (`vidstab report OUTPUT_DIR` writes it any time).")
    run.add_argument("--logging_dir", type=str, default="logs", help="Tracker folder, relative to --output_dir.")
    run.add_argument("--tracker_name", type=str, default="vidstab-train", help="Project name given to `init_trackers`.")
    run.add_argument("--logging_steps", type=int, default=1, help="Tracker logging interval in optimizer steps (the JSONL event log gets every step).")
    run.add_argument("--goodput_steps", type=int, default=100, help="Log the goodput ledger (a goodput event, vidstab/ettr to the trackers) every this many steps and at the end (0: at the end only).")
    run.add_argument("--dataloader_num_workers", type=int, default=0, help='DataLoader worker processes (0: load in the training process).')
    run.add_argument("--fsdp", action="store_true", help="Shard the DiT per block with FSDP2; sharded (DCP) checkpoints (see recipes/sharding.py).")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--learning_rate", type=float, default=3e-4, help='Peak learning rate (after warm-up; see --scale_lr).')
    opt.add_argument("--scale_lr", action="store_true", help="Multiply the LR by batch size x accumulation x processes.")
    opt.add_argument("--lr_scheduler", type=str, default="constant_with_warmup", choices=LR_SCHEDULERS, help="diffusers.optimization.get_scheduler name.")
    opt.add_argument("--lr_warmup_steps", type=int, default=20, help="Linear warm-up in optimizer steps.")
    opt.add_argument("--lr_num_cycles", type=int, default=1, help="Hard restarts of cosine_with_restarts.")
    opt.add_argument("--lr_power", type=float, default=1.0, help="Power of the polynomial scheduler.")
    opt.add_argument("--adam_beta1", type=float, default=0.9, help='AdamW beta1.')
    opt.add_argument("--adam_beta2", type=float, default=0.999, help='AdamW beta2.')
    opt.add_argument("--adam_weight_decay", type=float, default=0.0, help='AdamW decoupled weight decay.')
    opt.add_argument("--adam_epsilon", type=float, default=1e-8, help='AdamW epsilon.')
    opt.add_argument("--max_grad_norm", type=float, default=1.0, help='Clip the global gradient norm to this (the guard reads the pre-clip norm).')
    opt.add_argument("--use_ema", action="store_true", help="Keep an EMA of the weights: used for validation, exported as transformer_ema/.")
    opt.add_argument("--ema_decay", type=float, default=0.999, help="Decay of the weights' EMA (--use_ema).")
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpointing_steps", type=steps_or_auto, default=100, help='Save a checkpoint every this many optimizer steps (and at the end); a rollback or an incident replay uses the newest. auto: the interval the run\'s goodput ledger calls for (Young/Daly from the measured save stall, failure cost and failure rate), the first save after 10 steps, then re-chosen after every save within [max(10, the detectors\' lead time: the guard\'s health_window), 10000] steps; each change is a checkpoint_interval event.')
    ckpt.add_argument("--expected_mtbf_hours", type=float, default=24.0, help="With --checkpointing_steps auto: the most mean time between failures assumed until the run has seen a failure (before one, also no more than the run has survived).")
    ckpt.add_argument("--checkpoints_total_limit", type=int, default=3, help="Newest K kept (plus the last good one).")
    ckpt.add_argument("--resume_from_checkpoint", type=str, default=None, help='A checkpoint folder, "latest" or "last_good".')
    ckpt.add_argument("--no_async_save", action="store_true", help="Write checkpoints in the foreground.")
    ckpt.add_argument("--overwrite_output_dir", action="store_true", help="Start over in an output_dir that holds a run (it is moved to previous-runs/).")
    ckpt.add_argument("--allow_other_run_checkpoint", action="store_true", help="Let --resume_from_checkpoint load another run's checkpoint (e.g. fine-tuning from its weights); refused by default.")
    val = p.add_argument_group("validation")
    val.add_argument("--validation_steps", type=int, default=None, help="Sample validation clips every this many steps (always at the end).")
    val.add_argument("--num_validation_videos", type=int, default=2, help="Clips per validation (0: no validation).")
    val.add_argument("--validation_num_inference_steps", type=int, default=25, help="Scheduler steps per validation sample.")
    model = p.add_argument_group("model and objective")
    model.add_argument("--prediction_type", type=str, default="epsilon", choices=["epsilon", "v_prediction", "flow_matching"], help='What the model predicts: the noise, v, or the flow-matching velocity.')
    model.add_argument("--num_train_timesteps", type=int, default=1000, help='Diffusion timesteps of the noise schedule.')
    model.add_argument("--flow_shift", type=float, default=1.0, help="Flow matching: sigma shift of FlowMatchEulerDiscreteScheduler (Wan: 3-5).")
    model.add_argument("--weighting_scheme", type=str, default="logit_normal", choices=WEIGHTING_SCHEMES,
                       help="Flow matching: timestep density / loss weighting (diffusers.training_utils, SD3).")
    model.add_argument("--logit_mean", type=float, default=0.0, help="Mean of the logit_normal weighting scheme.")
    model.add_argument("--logit_std", type=float, default=1.0, help="Std of the logit_normal weighting scheme.")
    model.add_argument("--mode_scale", type=float, default=1.29, help="Scale of the mode weighting scheme.")
    model.add_argument("--hidden_size", type=int, default=64, help='DiT width.')
    model.add_argument("--num_layers", type=int, default=2, help='DiT blocks.')
    model.add_argument("--num_heads", type=int, default=4, help='Attention heads per block.')
    model.add_argument("--attention_type", type=str, default="factorized", choices=["full", "factorized"], help='full: one attention over all frames and patches; factorized: spatial then temporal.')
    model.add_argument("--pos_embed", type=str, default="rope", choices=["rope", "sincos"], help='Position embedding: rotary (rope) or fixed sin-cos.')
    model.add_argument("--gradient_checkpointing", action="store_true", help='Recompute block activations in the backward (less memory, more compute).')
    data = p.add_argument_group("data and VAE")
    data.add_argument("--data_dir", type=str, default=None, help="Folder of video files (decoded with PyAV); default: built-in moving shapes.")
    data.add_argument("--num_videos", type=int, default=64, help="Size of the built-in moving-shapes data set.")
    data.add_argument("--num_frames", type=int, default=9, help="Frames per clip (Wan VAE: 1 + 4k).")
    data.add_argument("--resolution", type=int, default=32, help="Square clip side, unless --height/--width say otherwise.")
    data.add_argument("--height", type=int, default=None, help="Clip height (default: --resolution).")
    data.add_argument("--width", type=int, default=None, help="Clip width (default: --resolution).")
    data.add_argument("--frame_stride", type=int, default=1, help='Take every this many frames of a video.')
    data.add_argument("--skip_bad_samples", action="store_true", help="Skip and record undecodable/empty/short/non-finite videos.")
    data.add_argument("--vae", type=str, default=None, help="Local diffusers VAE folder; default: tiny seeded random AutoencoderKLWan.")
    data.add_argument("--latent_channels", type=int, default=4, help='Latent channels of the built-in random VAE (a --vae folder brings its own).')
    data.add_argument("--latent_clamp", type=float, default=None, help="Clamp normalised latents to [-x, x] at encode time.")
    stab = p.add_argument_group("vidstab")
    stab.add_argument("--no_vidstab", action="store_true", help="Plain Accelerate step (for comparison).")
    stab.add_argument("--vidstab_config", type=str, default=None, help="YAML of vidstab.GuardConfig fields.")
    stab.add_argument("--max_retries", type=int, default=3, help="Rollbacks before the run stops.")
    stab.add_argument("--replay_data_after_rollback", action="store_true", help="Rewind data to the checkpoint instead of skipping it (PaLM).")
    stab.add_argument("--reset_recovery", action="store_true", help="Forget the rollback state (LR back-off, open incident) carried over in vidstab/recovery.json.")
    stab.add_argument("--inject_fault", action="append", default=[], metavar="KIND@STEP[:RANK][=ARG]", help=f"Drill a fault; repeatable. KIND: {', '.join(FAULT_KINDS)} (vidstab.faults).")
    stab.add_argument("--audit", action="store_true", help="Run the preflight audit before training; stop on blocking findings.")
    add_resilience_flags(p)
    return p


def add_resilience_flags(p: argparse.ArgumentParser) -> None:
    """Hang watchdog and in-job restart (vidstab.run.watchdog, vidstab.run.elastic); see docs/faults.md."""
    res = p.add_argument_group("resilience")
    res.add_argument("--watchdog_timeout", type=float, default=300.0, metavar="SECONDS",
                     help="A rank that makes no progress for max(SECONDS, multiple x its slowest step) dumps its stacks and "
                          "exits 75 so the launcher restarts the job; 0 turns the watchdog off.")
    res.add_argument("--watchdog_multiple", type=float, default=10.0, help="Multiple of the slowest step/checkpoint seen.")
    res.add_argument("--watchdog_first_step", type=float, default=900.0, metavar="SECONDS",
                     help="Allowance until the first step and the first checkpoint have completed.")
    res.add_argument("--no_auto_resume", action="store_true",
                     help="After a torch-elastic restart, start over instead of resuming from the latest checkpoint.")


def watchdog_config(args: argparse.Namespace):
    """The ``vidstab.run.watchdog.WatchdogConfig`` of the resilience flags."""
    from vidstab.run.watchdog import WatchdogConfig

    return WatchdogConfig(timeout_s=args.watchdog_timeout, multiple=args.watchdog_multiple, first_step_s=args.watchdog_first_step)


def check_resilience_flags(args: argparse.Namespace) -> None:
    """Faults that can never fire and impossible watchdog settings are flag errors (ValueError naming the flag)."""
    from vidstab.faults import Fault, validate_faults

    # --num_train_epochs alone: the length is known only once the data set is; a step past it cannot be judged yet.
    max_steps = args.max_train_steps or (DEFAULT_MAX_TRAIN_STEPS if args.num_train_epochs is None else 2**62)
    validate_faults(args.inject_fault, world_size=int(os.environ.get("WORLD_SIZE", "1")), max_steps=max_steps)
    for spec in args.inject_fault or []:
        if Fault.parse(spec).kind == "kill_worker" and not args.dataloader_num_workers:
            raise ValueError(f"--inject_fault {spec!r}: kill_worker ends a data-loader worker and this run loads in the "
                             f"training process: add --dataloader_num_workers 1")
    if args.watchdog_timeout:
        try:
            watchdog_config(args)
        except ValueError as exc:
            raise ValueError(str(exc).replace("WatchdogConfig.timeout_s", "--watchdog_timeout")
                             .replace("WatchdogConfig.multiple", "--watchdog_multiple")
                             .replace("WatchdogConfig.first_step_s", "--watchdog_first_step")) from None


def _config_value(action: argparse.Action, value: object, where: str) -> object:
    """Check one YAML value the way argparse checks the flag; return it in the flag's type or raise ValueError."""
    flag = action.option_strings[0] if action.option_strings else action.dest
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {action.dest} ({flag}) must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_config_value(argparse.Action([flag], action.dest, type=action.type), v, where) for v in items]
    if value is None:
        return None
    if action.type is str and isinstance(value, bool) and action.choices and "no" in action.choices and value is False:
        return "no"  # YAML 1.1 reads an unquoted `no` as false; for a flag whose choices hold "no" that is what was meant
    expected = {int: (int,), float: (int, float), str: (str,)}.get(action.type)
    if expected is not None and (isinstance(value, bool) or not isinstance(value, expected)):
        kind = {int: "an integer", float: "a number", str: "a string"}[action.type]
        raise ValueError(f"{where}: {action.dest} ({flag}) must be {kind}, got {value!r} ({type(value).__name__})")
    if action.type is steps_or_auto:
        try:
            value = steps_or_auto(value)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{where}: {action.dest} ({flag}) {exc}") from None
    value = action.type(value) if action.type in (int, float) else value
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {action.dest} ({flag}) must be one of {list(action.choices)}, got {value!r}")
    return value


def load_config_defaults(parser: argparse.ArgumentParser, path: Path) -> dict:
    """Read a YAML ``--config`` file into checked flag defaults (raises ValueError naming the key)."""
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it as YAML: {exc}") from exc
    values = values or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    unknown = sorted(str(k) for k in values if k not in actions)
    if unknown:
        raise ValueError(f"--config {path}: unknown key(s) {unknown}; every key must be a flag name")
    return {k: _config_value(actions[k], v, f"--config {path}") for k, v in values.items()}


def check_ranges(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first flag whose value is out of range."""
    for name in POSITIVE_INTS + POSITIVE_FLOATS:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name} must be {'>= 1' if name in POSITIVE_INTS else '> 0'}, got {value}")
    for name in NON_NEGATIVE:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if not 0.0 <= args.ema_decay < 1.0:
        raise ValueError(f"--ema_decay must be in [0, 1), got {args.ema_decay}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags from ``argv`` over ``--config`` defaults; bad values exit with a message naming the flag or key."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        path = Path(pre.config)
        if not path.is_file():
            parser.error(f"--config {path}: no such file")
        try:
            parser.set_defaults(**load_config_defaults(parser, path))
        except ValueError as exc:
            parser.error(str(exc))
    args = parser.parse_args(argv)
    try:
        check_ranges(args)
        check_resilience_flags(args)
    except ValueError as exc:
        parser.error(str(exc))
    args.height = args.height or args.resolution
    args.width = args.width or args.resolution
    return args


# --------------------------------------------------------------------------------------------------------
# What the flags do, one small function each (train.py calls them; tests check their effect)
# --------------------------------------------------------------------------------------------------------
def check_trackers(report_to: str) -> str | None:
    """``log_with`` for the Accelerator; a named tracker that is not installed raises, like diffusers does."""
    from diffusers.utils import is_tensorboard_available, is_wandb_available

    if report_to == "none":
        return None
    if report_to == "wandb" and not is_wandb_available():
        raise ImportError("Make sure to install wandb if you want to use it for logging during training (--report_to wandb).")
    if report_to == "tensorboard" and not is_tensorboard_available():
        raise ImportError("Make sure to install tensorboard if you want to use it for logging during training (--report_to tensorboard).")
    return report_to


def apply_backend_flags(args: argparse.Namespace) -> None:
    """``--allow_tf32``: TF32 matmuls and cuDNN convolutions (faster on Ampere+, ~10 mantissa bits)."""
    if args.allow_tf32:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def resolve_max_train_steps(args: argparse.Namespace, batches_per_epoch: int) -> int:
    """Optimizer steps of the run: --max_train_steps, else --num_train_epochs passes over the data, else the default.

    Sets ``args.num_train_epochs`` to the passes the run makes (diffusers recomputes it the same way).
    """
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / args.gradient_accumulation_steps))
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch if args.num_train_epochs else DEFAULT_MAX_TRAIN_STEPS
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    return args.max_train_steps


def scaled_learning_rate(args: argparse.Namespace, num_processes: int) -> float:
    """``--scale_lr``: LR x accumulation steps x per-device batch x processes (diffusers' rule)."""
    if args.scale_lr:
        return args.learning_rate * args.gradient_accumulation_steps * args.train_batch_size * num_processes
    return args.learning_rate


def lr_scheduler_kwargs(args: argparse.Namespace, num_processes: int) -> dict:
    """Arguments of ``diffusers.optimization.get_scheduler`` besides the name and the optimizer.

    diffusers' convention: the prepared scheduler steps once per process per optimizer step, so step
    counts are multiplied by the number of processes.
    """
    return {
        "num_warmup_steps": args.lr_warmup_steps * num_processes,
        "num_training_steps": args.max_train_steps * num_processes,
        "num_cycles": args.lr_num_cycles,
        "power": args.lr_power,
    }
