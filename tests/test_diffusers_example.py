"""diffusers' own examples/unconditional_image_generation/train_unconditional.py, with vidstab added in at
most six lines, none removed (examples/diffusers_unconditional/vidstab.patch), on a local image folder and a
tiny UNet2DModel, no hub, 2 processes. Faults come from outside the script (tests/scripts/drill.py).

It still does what it did -- its own checkpoint-N saving, --checkpoints_total_limit, --resume_from_checkpoint
latest, the final pipeline -- and vidstab skips a NaN sample on one rank and names it, refuses an LR x10^4
for as long as it lasts, rolls back in place when it does not stop and aborts with the replay command once
the retry budget is spent; after a SIGKILL the script's own resume goes on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from diffusers_drills import (KILL, LR_FOR_GOOD, SKIP_FAULTS, changed_lines, check_replay_names_the_sample,
                             check_rollbacks_then_abort, check_skips, events, launch, own_checkpoints)

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "examples" / "diffusers_unconditional"
UPSTREAM, GUARDED = FOLDER / "train_unconditional.py", FOLDER / "train_unconditional_vidstab.py"
# The explicit form: vidstab's own exact-resume checkpoints and Recovery in the loop (+drill flags of its own).
EXPLICIT = FOLDER / "train_unconditional_vidstab_explicit.py"
TINY_UNET = {"_class_name": "UNet2DModel", "sample_size": 16, "in_channels": 3, "out_channels": 3, "layers_per_block": 1,
             "block_out_channels": [8, 16], "norm_num_groups": 4, "attention_head_dim": 4,
             "down_block_types": ["DownBlock2D", "AttnDownBlock2D"], "up_block_types": ["AttnUpBlock2D", "UpBlock2D"]}


def _data(tmp_path: Path, n: int = 16) -> tuple[Path, Path]:
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(images / f"img{i}.png")
    config = tmp_path / "unet"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(TINY_UNET))
    return images, config


def _run(script: Path, out: Path, images: Path, config: Path, *extra: str, faults: tuple[str, ...] = (),
         nproc: int = 2, max_restarts: int = 0) -> subprocess.CompletedProcess:
    return launch(script, out, ["--train_data_dir", str(images), "--model_config_name_or_path", str(config),
                                "--output_dir", str(out), "--resolution", "16", "--center_crop", "--train_batch_size", "2",
                                "--eval_batch_size", "1", "--lr_warmup_steps", "2", "--learning_rate", "1e-3",
                                "--checkpointing_steps", "2", "--checkpoints_total_limit", "2",
                                "--ddpm_num_inference_steps", "2", "--save_images_epochs", "100", "--save_model_epochs", "100",
                                "--dataloader_num_workers", "0", "--cache_dir", str(out.parent / "hf_cache"), *extra],
                  faults, nproc, max_restarts)


def test_the_patches_are_the_diffs_between_upstream_and_the_guarded_copies():
    for copy, patch in ((GUARDED, "vidstab.patch"), (EXPLICIT, "vidstab_explicit.patch")):
        diff = subprocess.run(["diff", "-u", str(UPSTREAM), str(copy)], capture_output=True, text=True).stdout
        assert changed_lines(diff) == changed_lines((FOLDER / patch).read_text()), patch


def test_the_integration_adds_at_most_six_lines_and_removes_none():
    body = changed_lines((FOLDER / "vidstab.patch").read_text())
    added, removed = sum(x.startswith("+") for x in body), sum(x.startswith("-") for x in body)
    assert added <= 6 and removed == 0, (added, removed)


def _final_unet(out: Path) -> dict:
    return load_file(str(out / "unet" / "diffusion_pytorch_model.safetensors"))


def test_healthy_run_is_bitwise_the_upstream_scripts(tmp_path):
    images, config = _data(tmp_path, n=8)  # one process, 4 steps per epoch: the numerics, not the lockstep
    upstream = _run(UPSTREAM, tmp_path / "upstream", images, config, "--num_epochs", "2", nproc=1)
    guarded = _run(GUARDED, tmp_path / "guarded", images, config, "--num_epochs", "2", nproc=1)
    assert upstream.returncode == 0 and guarded.returncode == 0, upstream.stderr[-3000:] + guarded.stderr[-3000:]
    a, b = _final_unet(tmp_path / "upstream"), _final_unet(tmp_path / "guarded")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert own_checkpoints(tmp_path / "guarded") == own_checkpoints(tmp_path / "upstream") == [6, 8]


def test_nan_on_rank1_and_an_lr_spike_for_three_steps_are_skipped(tmp_path):
    images, config = _data(tmp_path)
    out = tmp_path / "run"
    # 16 images / (2 processes x batch 2) = 4 steps per epoch, 3 epochs = 12 steps.
    bundle, _ = check_skips(_run(GUARDED, out, images, config, "--num_epochs", "3", faults=SKIP_FAULTS), out)
    assert all(torch.isfinite(t).all() for t in _final_unet(out).values())
    # The replay rebuilds the diffusers model from the bundle alone (no code of the user's) and names the sample.
    check_replay_names_the_sample(bundle)


def test_an_lr_spike_for_good_rolls_back_in_place_then_aborts_with_the_replay_command(tmp_path):
    images, config = _data(tmp_path)
    out = tmp_path / "run"
    check_rollbacks_then_abort(_run(GUARDED, out, images, config, "--num_epochs", "10", faults=LR_FOR_GOOD), out)


def test_under_max_restarts_a_killed_rank_is_restarted_and_the_scripts_own_resume_goes_on(tmp_path):
    """The launch line of docs/faults.md for a user's script: ``--max_restarts`` with ``--resume_from_checkpoint
    latest`` (a first launch has no checkpoint and starts from scratch; each restart resumes). Rank 1 SIGKILLs
    itself at step 7; torch elastic restarts both ranks, which resume from the script's own checkpoint-6 with the
    guard's state, and finish with finite weights (the video example relaunches by hand instead)."""
    images, config = _data(tmp_path)
    out = tmp_path / "run"
    run = _run(GUARDED, out, images, config, "--num_epochs", "3", "--resume_from_checkpoint", "latest", faults=KILL,
               max_restarts=1)
    assert run.returncode == 0, run.stderr[-4000:]
    said = run.stdout + run.stderr
    assert "Checkpoint 'latest' does not exist. Starting a new training run." in said  # the first launch
    assert "Resuming from checkpoint checkpoint-6" in said  # the restart
    assert events(out, "resume")[-1]["step"] == 6
    metrics = events(out, "metrics")
    assert metrics[-1]["step"] == 11 and all(np.isfinite(m["loss"]) for m in metrics[-3:])
    assert own_checkpoints(out) == [10, 12]
    assert all(torch.isfinite(t).all() for t in _final_unet(out).values())


def test_explicit_form_rollback_removes_its_own_abandoned_checkpoints_then_its_own_resume_latest(tmp_path):
    """The explicit form (vidstab's own checkpoints, Recovery in the loop, which sets global_step back): after a
    rollback the two checkpoint systems agree, the script's own `latest` never picks a checkpoint-N of the
    abandoned trajectory (``RecoveryConfig(own_checkpoints=...)``)."""
    images, config = _data(tmp_path, n=8)
    out = tmp_path / "run"
    # 8 images / batch 2 = 4 steps per epoch, 3 epochs = 12 steps. From step 4 on the scheduler's own base LRs are
    # x10^4, written again after every rollback (``lr_base``: a bug in the schedule's code): refused steps leave the
    # checkpoints saved among them unhealthy (a NaN batch would not: skipped bad data says nothing of the weights),
    # the skips escalate to a rollback, the fault recurs after every one, the retry budget runs out and the run aborts.
    first = _run(EXPLICIT, out, images, config, "--num_epochs", "3", "--inject_fault", "lr_base@4=1e4", nproc=1)
    assert first.returncode != 0 and "vidstab: run aborted" in first.stderr, first.stderr[-3000:]
    rollbacks = events(out, "rollback")
    assert len(rollbacks) == 3 and all(r["to_step"] <= 4 for r in rollbacks), rollbacks
    for r in rollbacks:  # every rollback removed the script's own checkpoint-N of the abandoned trajectory
        assert all(int(n.split("-")[1]) > r["to_step"] for n in r["discarded_own_checkpoints"])
    abort = [e for e in events(out, "recovery") if e["action"] == "abort"][-1]
    discarded = [n for e in rollbacks + [abort] for n in e["discarded_own_checkpoints"]]
    assert discarded, "the abandoned trajectory left no checkpoint-N: the drill did not test the agreement"
    # One source of truth: what the script's own `latest` finds is not newer than vidstab's last good checkpoint.
    own = own_checkpoints(out)
    assert own and max(own) <= abort["last_good_step"] and len(own) <= 2  # --checkpoints_total_limit still holds

    # The fixed script (no fault) resumes with its own --resume_from_checkpoint latest and finishes; the changed
    # configuration gets a fresh retry budget, and that is said.
    second = _run(EXPLICIT, out, images, config, "--num_epochs", "3", "--resume_from_checkpoint", "latest", nproc=1)
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"Resuming from checkpoint checkpoint-{max(own)}" in second.stdout + second.stderr
    assert "started afresh because the run's configuration changed" in second.stderr
    assert (out / "model_index.json").is_file() and (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert own_checkpoints(out) == [10, 12]  # its own saving and total limit, after the resume
    metrics = events(out, "metrics")
    assert metrics[-1]["step"] == 11 and all(np.isfinite(m["loss"]) for m in metrics[-3:])
