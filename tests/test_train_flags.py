"""Every flag of the reference trainer does what its name says: each test checks an effect, not the parsing."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from trainer_utils import REPO, events, run_trainer, shared_run

sys.path.insert(0, str(REPO / "recipes"))
import args as train_args  # noqa: E402  (recipes/args.py: the trainer's flags)
import train  # noqa: E402  (recipes/train.py)


def _parse_error(capsys, argv):
    with pytest.raises(SystemExit):
        train_args.parse_args(argv)
    return capsys.readouterr().err


def test_a_kill_worker_drill_without_loader_workers_is_a_flag_error(capsys):
    err = _parse_error(capsys, ["--inject_fault", "kill_worker@2"])
    assert "--inject_fault 'kill_worker@2': kill_worker ends a data-loader worker" in err and "--dataloader_num_workers 1" in err


def test_config_values_get_the_flags_type_checks(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learning_rate: true\n")
    assert "learning_rate (--learning_rate) must be a number, got True" in _parse_error(capsys, ["--config", str(cfg)])
    cfg.write_text("train_batch_size: '8'\n")
    assert "train_batch_size (--train_batch_size) must be an integer" in _parse_error(capsys, ["--config", str(cfg)])
    cfg.write_text("use_ema: 1\n")
    assert "use_ema (--use_ema) must be true or false" in _parse_error(capsys, ["--config", str(cfg)])
    cfg.write_text("prediction_type: eps\n")
    assert "must be one of ['epsilon'" in _parse_error(capsys, ["--config", str(cfg)])
    cfg.write_text("max_train_steps: 0\n")
    assert "--max_train_steps must be >= 1, got 0" in _parse_error(capsys, ["--config", str(cfg)])
    cfg.write_text("- a list\n")
    assert "expected a mapping" in _parse_error(capsys, ["--config", str(cfg)])
    # YAML 1.1 reads an unquoted `no` as false: for --mixed_precision that means "no", as the user wrote.
    cfg.write_text("mixed_precision: no\nlearning_rate: 1\n")
    parsed = train_args.parse_args(["--config", str(cfg)])
    assert parsed.mixed_precision == "no" and parsed.learning_rate == 1.0 and isinstance(parsed.learning_rate, float)
    assert "--learning_rate must be > 0" in _parse_error(capsys, ["--learning_rate", "-1"])


def test_mixed_precision_defers_to_accelerate_unless_given(tmp_path, monkeypatch):
    # `accelerate launch --mixed_precision bf16` passes its choice in this variable.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    acc = train.build_accelerator(train_args.parse_args(["--output_dir", str(tmp_path), "--report_to", "none"]))
    assert acc.mixed_precision == "bf16"
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    acc = train.build_accelerator(train_args.parse_args(["--output_dir", str(tmp_path), "--report_to", "none", "--mixed_precision", "no"]))
    assert acc.mixed_precision == "no"


def test_report_to_a_missing_tracker_raises_like_diffusers():
    from diffusers.utils import is_wandb_available

    if is_wandb_available():
        pytest.skip("wandb is installed here")
    with pytest.raises(ImportError, match="install wandb"):
        train_args.check_trackers("wandb")


def test_allow_tf32_switches_tf32_on():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        train_args.apply_backend_flags(train_args.parse_args([]))
        assert not torch.backends.cuda.matmul.allow_tf32
        train_args.apply_backend_flags(train_args.parse_args(["--allow_tf32"]))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_lr_power_shapes_the_polynomial_decay():
    def lrs(power):
        args = train_args.parse_args(["--lr_scheduler", "polynomial", "--lr_power", str(power), "--lr_warmup_steps", "0", "--max_train_steps", "10"])
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = train.get_scheduler(args.lr_scheduler, opt, **train_args.lr_scheduler_kwargs(args, 1))
        out = []
        for _ in range(5):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    linear, squared = lrs(1.0), lrs(2.0)
    assert linear[4] == pytest.approx(1.0 - 4 / 10, abs=1e-6)
    assert squared[4] == pytest.approx((1.0 - 4 / 10) ** 2, abs=1e-6)


@pytest.fixture(scope="module")
def flags_run(tmp_path_factory):
    """One 8-step run that sets the flags of the two tests below (none of them touches what another checks)."""
    def build(folder):
        proc = run_trainer(folder / "run", "--num_train_epochs", "2", "--scale_lr", "--learning_rate", "1e-5", "--lr_scheduler", "cosine_with_restarts",
                           "--lr_num_cycles", "2", "--lr_warmup_steps", "0", "--height", "32", "--width", "48", "--num_validation_videos", "0",
                           "--report_to", "tensorboard", "--logging_steps", "3", "--logging_dir", "tb", "--tracker_name", "my-project")
        (folder / "stdout.txt").write_text(proc.stdout)

    folder = shared_run(tmp_path_factory, "train-flags", build)
    return folder / "run", subprocess.CompletedProcess([], 0, (folder / "stdout.txt").read_text(), "")


def test_epochs_scale_lr_and_restarts_reach_the_run(flags_run):
    """--num_train_epochs sets the step count, --scale_lr the peak LR, --lr_num_cycles the restarts,
    --height/--width the clip size, --num_validation_videos 0 turns sampling off."""
    out, proc = flags_run
    # 16 clips / batch 4 = 4 steps per epoch
    assert "done: 8/8 steps" in proc.stdout
    lr = [m["lr"] for m in events(out, kind="metrics")]
    assert lr[0] == pytest.approx(1e-5 * 4)  # x batch 4 x accumulation 1 x 1 process
    assert lr[4] == pytest.approx(lr[0]) and lr[3] < 0.5 * lr[0], f"no restart at the half: {lr}"
    import json

    cache = json.loads((out / "latent_cache" / "manifest.json").read_text())
    assert cache["latent_shape"][-2:] == [4, 6]  # 32x48 frames through the 8x VAE
    # --num_validation_videos 0: the model is exported, nothing is sampled
    assert (out / "transformer" / "config.json").is_file() and not (out / "validation").exists()
    assert not events(out, kind="validation")


def test_logging_steps_tracker_name_and_logging_dir(flags_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = flags_run  # 8 steps, --report_to tensorboard --logging_steps 3 --logging_dir tb --tracker_name my-project
    runs = list((out / "tb" / "my-project").rglob("events.out.tfevents*"))
    assert runs, f"no TensorBoard file under tb/my-project: {list(out.rglob('*tfevents*'))}"
    acc = EventAccumulator(str(runs[0].parent))
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.endswith("loss"))
    assert [e.step for e in acc.Scalars(tag)] == [0, 3, 6]
    assert math.isfinite(acc.Scalars(tag)[0].value)


def test_every_flag_in_train_help_says_what_it_does_and_its_default():
    """`python recipes/train.py --help`, as a newcomer runs it: every flag has a help text, every default shows,
    and --inject_fault lists every fault kind the trainer accepts."""
    import subprocess

    from vidstab.faults import FAULT_KINDS

    done = subprocess.run([sys.executable, str(REPO / "recipes" / "train.py"), "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    parser = train_args.build_parser()
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not silent, f"flags without help: {silent}"
    # The options part: one entry per flag, from its "  --flag" line to the next.
    entries = {m.group(1): " ".join(m.group(2).split())
               for m in re.finditer(r"^  (--\w+)(.*?)(?=^  -|^\S|\Z)", done.stdout, re.S | re.M)}
    for flag, default in (("--learning_rate", "0.0003"), ("--max_grad_norm", "1.0"), ("--checkpointing_steps", "100"),
                          ("--hidden_size", "64"), ("--seed", "0")):
        assert f"(default: {default})" in entries[flag], (flag, entries.get(flag))
    inject = entries["--inject_fault"]
    assert all(kind in inject for kind in FAULT_KINDS), inject


@pytest.mark.parametrize("flags, said", [
    (["--vae", "{tmp}/vae"], "--vae {tmp}/vae: '{tmp}/vae/config.json' describes a 'AutoencoderKL', not an AutoencoderKLWan"),
    (["--data_dir", "{tmp}/missing"], "--data_dir: video data folder '{tmp}/missing' does not exist"),
    (["--data_dir", "{tmp}/vae"], "--data_dir: no video files (.mp4"),
    (["--num_frames", "8"], "--num_frames 8 --height 32 --width 32: a Wan VAE needs T = 1 + 4k frames"),
    (["--height", "30"], "--num_frames 9 --height 30 --width 32: a Wan VAE with this config needs height and width divisible by 8"),
], ids=["vae", "data_dir_missing", "data_dir_without_videos", "num_frames", "height"])
def test_a_vae_data_folder_or_clip_shape_the_trainer_cannot_use_is_one_line_naming_the_flag(tmp_path, capsys, flags, said):
    from accelerate.state import AcceleratorState

    from trainer_utils import FAST

    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text('{"_class_name": "AutoencoderKL"}')
    AcceleratorState._reset_state(True)
    try:
        code = train.run_main(["--output_dir", str(tmp_path / "out"), *FAST,
                               *[f.format(tmp=tmp_path) for f in flags]])
    finally:
        AcceleratorState._reset_state(True)
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("recipes/train.py: error:")]
    assert said.format(tmp=tmp_path) in line, line
    assert "Traceback" not in err
