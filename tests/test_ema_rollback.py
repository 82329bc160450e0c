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
    # The console: the main process names rank 1's bundle of the NaN sample, once, with the replay command; sums up.
    assert proc.stderr.count("vidstab: step 3: rank 1 wrote incident bundle ") == 1
    assert "replay it with: vidstab replay " in proc.stderr
    assert proc.stderr.count(f"vidstab: {STEPS} optimizer steps guarded, ") == 1
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


def _ema_loop(out, bad_lr_steps, steps=24, hooks=("save", "load"), register=False):
    """A plain Accelerate loop with a diffusers EMAModel that the script saves/loads in its own hooks (``hooks``) or
    registers for checkpointing; a bug writes the LR x10^4 before each step in ``bad_lr_steps``. Returns the EMA's
    step count after each step, and the guard."""
    from accelerate import Accelerator
    from diffusers.training_utils import EMAModel

    import vidstab

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    ema = EMAModel(model.parameters())
    if "save" in hooks:
        acc.register_save_state_pre_hook(lambda models, weights, folder: torch.save(ema.state_dict(), f"{folder}/ema.pt"))
    if "load" in hooks:
        acc.register_load_state_pre_hook(lambda models, folder: ema.load_state_dict(torch.load(f"{folder}/ema.pt")))
    if register:
        acc.register_for_checkpointing(ema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=out, rollback_every=4)
    counts = []
    for step in range(steps):
        if step in bad_lr_steps:
            for group in opt.param_groups:
                group["lr"] = sched.get_last_lr()[0] * 1e4
        loss = model(torch.randn(2, 4)).pow(2).mean()
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        ema.step(model.parameters())
        counts.append(ema.optimization_step)
    guard.close()
    return counts, guard


def test_an_ema_registered_for_checkpointing_rolls_back_with_the_weights_and_takes_no_skipped_step(tmp_path):
    # Steps 10-13 refused (the EMA holds), 14 rolled back to the checkpoint of step 8, saved before the EMA's step 7
    # (its 7th): the EMA goes back to 7 steps and takes the restored weights once; 15 refused; 16-23 taken.
    # (An EMA in the script's own save/load-state hooks: the conformance matrix's EMA drill, every engine.)
    counts, _ = _ema_loop(tmp_path, bad_lr_steps=set(range(10, 16)), hooks=(), register=True)
    assert counts[9:17] == [10, 10, 10, 10, 10, 8, 8, 9]
    assert counts[-1] == 16


def test_a_save_hook_without_a_load_hook_is_said_at_attach(tmp_path, capsys):
    from vidstab.events import iter_event_file

    _ema_loop(tmp_path, bad_lr_steps=set(), steps=1, hooks=("save",))
    assert "cannot be restored by a rollback" in capsys.readouterr().err
    warns = [e for e in iter_event_file(tmp_path / "vidstab" / "events-rank0.jsonl") if e["kind"] == "warn"]
    assert warns and warns[0]["detector"] == "rollback_every"
