"""Replay names the most common fault: an LR far beyond the schedule's, applied for one step by a user bug.

A real guarded Accelerate loop with vidstab's checkpoints: at step 8 the user's code multiplies
``param_groups[0]["lr"]`` by 10^4; ``LambdaLR`` writes the right LR back at its next step, so the grad-spike
bundle of step 9 records a normal LR and its checkpoint (step 5) holds healthy weights. The replay must still
say the LR did it: the LR logged at step 8 against the checkpoint's schedule, and one update at each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).parent))

from replay_user_model import make_batch, make_model, video_mse  # noqa: E402

import vidstab  # noqa: E402
from vidstab.evidence.capture import write_incident  # noqa: E402
from vidstab.tools.replay import replay  # noqa: E402

SPEC = {"factory": "replay_user_model:make_model", "kwargs": {"channels": 4, "hidden": 16},
        "loss_fn": "replay_user_model:video_mse"}


def lr_bug_run(run_dir: Path, bug_step: int = 8, steps: int = 10) -> Path:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = make_model(**SPEC["kwargs"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    ckpt = vidstab.CheckpointManager(acc, str(run_dir))
    # lr_bound (on by default) refuses this update before it is applied (tests/test_detectors.py); here it is
    # off, as for a bug below its threshold, so the blow-up happens and the replay must name the LR.
    guard = vidstab.attach(acc, model, opt, sched, config=vidstab.GuardConfig.from_dict({"lr_bound": {"enabled": False}}),
                           run_dir=run_dir, model_spec=SPEC, seed=0, checkpoint_fn=lambda: ckpt.last_saved)
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched), ("vidstab", guard)):
        ckpt.register(name, obj)
    for step in range(steps):
        batch = make_batch(seed=step)
        if step == bug_step:
            opt.param_groups[0]["lr"] *= 1e4  # the user's bug
        guard.backward(video_mse(model, batch).mean(), batch=batch, sample_ids=[f"s{step}-{j}" for j in range(3)])
        guard.step(1.0)
        if step == 5:
            ckpt.save(step)
            ckpt.wait()
    guard.close()
    return run_dir


def test_lr_blow_up_is_diagnosed_from_the_log_and_the_checkpoint(tmp_path):
    run = lr_bug_run(tmp_path / "run")
    bundle = sorted((run / "vidstab" / "incidents").iterdir())[0]
    report = replay(bundle, trust=["replay_user_model"])
    assert report.step == 9 and report.recorded["lr"] == 1e-3  # the bundle itself looks innocent
    lr = report.lr
    assert lr["implicated"] and lr["outlier"] and lr["evidence"]["suspect_step"] == 8
    assert abs(lr["tested_lr"] - 10.0) < 1e-9 and abs(lr["sane_lr"] - 1e-3) < 1e-12
    assert lr["jump_at_lr"] and not lr["jump_at_sane_lr"]
    assert report.reproduced is True and "one update at lr 10 reproduces the blow-up" in report.reproduction
    assert report.verdict.startswith("Reproduces") and "LR:" in report.verdict and "schedule never gives it" in report.verdict
    assert not report.data["implicated"]

    # A bundle of the bad step itself (recording the outlier LR) is diagnosed the same way.
    step8 = write_incident(run, step=8, micro_step=0, rank=0, world_size=1, batch=make_batch(seed=8),
                           sample_ids=["s8-0", "s8-1", "s8-2"], lr=10.0, precision="no", seed=0,
                           finding={"detector": "lr_jump", "verdict": "WARN", "message": "lr x1e4", "figures": {}},
                           checkpoint="vidstab/checkpoints/step_000005", model_spec=SPEC)
    report = replay(step8, trust=["replay_user_model"])
    assert report.lr["implicated"] and report.lr["evidence"]["suspect_step"] == 8
    assert "LR:" in report.verdict and "not implicated" not in report.lr["summary"]
