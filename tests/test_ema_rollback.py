"""The EMA a diffusers script keeps through its own save/load-state hooks rolls back with the weights, and takes no
skipped step: diffusers' own train_unconditional.py with ``--use_ema``, vidstab attached with ``rollback_every``
(examples/diffusers_unconditional/vidstab.patch), 2 processes, faults from outside the script (tests/scripts/drill.py):
a NaN sample on rank 1 at step 3 (skipped) and an update at step 8 that leaves a weight NaN, which the script's
``ema_model.step(...)`` right after it takes in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusers_drills import events, own_checkpoints
from test_diffusers_example import GUARDED, _data, _run

STEPS = 20  # 5 epochs of 4 optimizer steps


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema_rollback")
    images, config = _data(tmp)
    out = tmp / "run"
    proc = _run(GUARDED, out, images, config, "--num_epochs", "5", "--use_ema", faults=("nan@3:1", "nanweight@8"))
    return proc, out


def _finite(path: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values())


@pytest.mark.slow
def test_a_nan_weight_rolls_back_the_scripts_ema_too_and_the_exported_ema_is_finite(ema_run):
    proc, out = ema_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        (rollback,) = events(out, "rollback", rank)
        assert rollback["to_step"] <= 8 and rollback["reason"].startswith("nonfinite_params")
    # The script's load hook read the EMA vidstab had its save hook write beside that rollback checkpoint.
    assert "rollback-script-state/step_000008/unet_ema" in proc.stderr
    assert _finite(out / "unet" / "diffusion_pytorch_model.safetensors")  # the exported model: the EMA's weights
    for step in own_checkpoints(out):  # and what the script itself checkpointed after the rollback
        assert _finite(out / f"checkpoint-{step}" / "unet_ema" / "diffusion_pytorch_model.safetensors")


@pytest.mark.slow
def test_a_skipped_step_does_not_advance_the_ema(ema_run):
    proc, out = ema_run
    skipped = {e["step"] for e in events(out, "skip")}
    assert 3 in skipped
    # 20 steps: step 3 skipped (held), the rollback at step 11 to the checkpoint of step 8 brings the EMA back to
    # its 6 steps of then (steps 0-6 but 3) and it absorbs the restored weights once; steps 12-19 add 8.
    config = json.loads((out / f"checkpoint-{STEPS}" / "unet_ema" / "config.json").read_text())
    assert config["optimization_step"] == 15
