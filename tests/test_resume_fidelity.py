"""Resume fidelity: every metrics line carries a fingerprint of its batch's sample ids, and
after a resume the first replayed steps are compared with what the original run logged: a loader reshuffled
on resume is caught and named, as are an RNG, scheduler or optimizer state that was not restored; an exact
resume is quiet. Real Accelerate, real checkpoints, the user's loop; the reference trainer's on 2 processes (a
resume after a SIGKILL) on the conformance matrix's DDP row (tests/test_conformance.py)."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointManager
from vidstab.recovery.policy import Recovery
from vidstab.run.resume_check import batch_fingerprint

from trainer_utils import events


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.randn(8, generator=torch.Generator().manual_seed(i))}


def _phase(run_dir, variant: str, resume: bool, until: int = 10) -> Recovery:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=run_dir)
    ckpt = CheckpointManager(acc, str(run_dir), CheckpointConfig(async_save=False))
    ckpt.register("model", model)
    ckpt.register("vidstab", guard)
    if not (resume and variant == "optimizer"):  # the bug: the optimizer is not saved/restored
        ckpt.register("optimizer", opt)
    if not (resume and variant == "scheduler"):
        ckpt.register("lr_scheduler", sched)
    recovery = Recovery(acc, ckpt, guard, run_dir=str(run_dir))
    seed = 1 if resume and variant == "reshuffle" else 0  # the bug: a loader seeded anew on resume
    batches = list(torch.utils.data.DataLoader(vidstab.WithSampleIds(Points()), batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(seed)))
    step = 0
    if resume:
        step = int(recovery.resume("latest")["step"])
        guard.global_step = step
        if variant == "rng":
            torch.manual_seed(123)  # the bug: the restored RNG state overwritten
    while step < until:
        batch = batches[step]
        x = batch["x"]
        loss = (model(x + 0.1 * torch.randn_like(x)) - x).pow(2).mean()  # a random draw, as diffusion's noise
        guard.backward(loss, batch={"x": x}, sample_ids=batch["sample_ids"])
        result = guard.step(1.0)
        assert recovery.after_step(result) is None
        step += 1
        if step == 5:
            ckpt.save(step, healthy=True, trainer_state={"step": step})
    guard.close()
    return recovery


def _fidelity_warnings(run_dir):
    return [e for e in events(run_dir, kind="warn") if e.get("detector") == "resume_fidelity"]


@pytest.mark.parametrize("variant, changed", [("exact", None), ("reshuffle", "data order"), ("rng", "RNG"),
                                              ("scheduler", "optimizer/scheduler state"),
                                              ("optimizer", "optimizer/scheduler state")])
def test_a_resume_is_compared_with_what_the_original_run_logged(tmp_path, variant, changed):
    _phase(tmp_path, variant, resume=False)  # steps 0..9, a checkpoint at 5; the run then "dies"
    recovery = _phase(tmp_path, variant, resume=True)  # resumes at 5: steps 5, 6, 7 are compared
    warnings = _fidelity_warnings(tmp_path)
    if changed is None:
        assert warnings == [] and recovery.resume_check.last == []  # compared, and quiet
        return
    assert len(warnings) == 1 and warnings[0]["changed"] == [changed], warnings
    assert warnings[0]["step"] == 5 and f"{changed} changed" in warnings[0]["message"]


def test_every_metrics_line_carries_the_fingerprint_of_its_sample_ids(tmp_path):
    _phase(tmp_path, "exact", resume=False, until=4)
    batches = list(torch.utils.data.DataLoader(vidstab.WithSampleIds(Points()), batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(0)))
    lines = {e["step"]: e for e in events(tmp_path, kind="metrics")}
    assert [lines[s]["batch_fp"] for s in range(4)] == [batch_fingerprint([batches[s]["sample_ids"]]) for s in range(4)]
    assert len({lines[s]["batch_fp"] for s in range(4)}) == 4


def test_a_rollback_that_rewinds_the_data_replays_the_steps_before_the_failure_quietly(tmp_path):
    from vidstab.recovery.policy import RecoveryConfig

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(async_save=False))
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched), ("vidstab", guard)):
        ckpt.register(name, obj)
    recovery = Recovery(acc, ckpt, guard, RecoveryConfig(skip_data=False), run_dir=str(tmp_path))
    batches = list(torch.utils.data.DataLoader(vidstab.WithSampleIds(Points()), batch_size=4, shuffle=True,
                                               generator=torch.Generator().manual_seed(0)))
    step, failed = 0, False
    while step < 12:
        x = batches[step]["x"]
        loss = (model(x + 0.1 * torch.randn_like(x)) - x).pow(2).mean()
        guard.backward(loss, batch={"x": x}, sample_ids=batches[step]["sample_ids"])
        result = guard.step(1.0)
        step += 1
        if step == 9 and not failed:  # a divergence detected at step 8: roll back, replaying the data
            failed = True
            step = int(recovery.rollback("grad_spike: injected", step)["step"])
            continue
        recovery.after_step(result, step)
        if step == 5:
            ckpt.save(step, healthy=True, trainer_state={"step": step})
    guard.close()
    # Steps 5-7 (before the failure at 8) replayed: the same batches, the LR x0.5 of the back-off, the same
    # first loss; nothing to warn about.
    assert recovery.resume_check.last == [] and _fidelity_warnings(tmp_path) == []
