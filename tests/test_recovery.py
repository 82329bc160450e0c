"""Recovery (rollback policy) and PreemptionHandler with real Accelerate, real checkpoints, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate import Accelerator

from vidstab.checkpoint import CheckpointConfig, CheckpointManager
from vidstab.run.preemption import PreemptionHandler
from vidstab.recovery.policy import Recovery, RecoveryConfig, RunAborted


class LRGuard:
    """Stand-in for the guard's LR contract (lr_multiplier / set_lr_multiplier) + JSON state."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.lr_multiplier = 1.0

    def set_lr_multiplier(self, multiplier):
        self.lr_multiplier = multiplier
        for g, b in zip(self.optimizer.param_groups, self.base):
            g["lr"] = b * self.lr_multiplier

    def state_dict(self):
        return {"lr_multiplier": self.lr_multiplier}

    def load_state_dict(self, d):
        self.lr_multiplier = d["lr_multiplier"]


def _run(tmp_path, config=None, register_guard=True):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(keep=3, async_save=False))
    guard = LRGuard(opt)
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    if register_guard:
        ckpt.register("vidstab", guard)
    rec = Recovery(acc, ckpt, guard, config or RecoveryConfig(max_retries=2), run_dir=str(tmp_path))
    return acc, model, opt, ckpt, guard, rec


def _events(tmp_path, kind):
    path = tmp_path / "vidstab" / "events-rank0.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind] if path.exists() else []


def test_a_target_that_fails_again_sends_the_next_rollback_further_back(tmp_path):
    acc, model, opt, ckpt, guard, rec = _run(tmp_path, RecoveryConfig(max_retries=3))
    ckpt.save(10, healthy=True, trainer_state={"step": 10, "batches_consumed": 10})
    ckpt.save(20, healthy=True, trainer_state={"step": 20, "batches_consumed": 20})  # looked healthy, was not
    assert rec.rollback("spikes", step=23)["step"] == 20
    # the replay from step 20 fails again at step 22, before passing the first failure (23): go further back
    assert rec.rollback("spikes again", step=22)["step"] == 10
    assert (tmp_path / "vidstab" / "checkpoints" / "last_good").read_text().strip() == "step_000010"
    # a failure after passing the previous one is a new problem: the newest good checkpoint again
    ckpt.save(30, healthy=True, trainer_state={"step": 30, "batches_consumed": 30})
    assert rec.rollback("later trouble", step=35)["step"] == 30


def test_a_guard_left_out_of_the_checkpoints_is_said_at_the_rollback(tmp_path, caplog):
    """The explicit form's numbering is one because the guard goes back with the weights; a guard the checkpoints do
    not hold would go on counting the abandoned trajectory's steps: said once, with the line that fixes it."""
    acc, model, opt, ckpt, guard, rec = _run(tmp_path, register_guard=False)
    ckpt.save(10, healthy=True, trainer_state={"step": 10})
    with caplog.at_level("WARNING", logger="vidstab.recovery.policy"):
        rec.rollback("spike", step=13)
        rec.rollback("spike", step=12)
    said = [r.getMessage() for r in caplog.records if "not registered with the CheckpointManager" in r.getMessage()]
    assert len(said) == 1 and 'ckpt.register("vidstab", guard)' in said[0] and "rollback to step 10" in said[0]


def test_rollback_loads_last_good_backs_off_lr_and_counts_retries(tmp_path):
    acc, model, opt, ckpt, guard, rec = _run(tmp_path)
    ckpt.save(10, healthy=True, trainer_state={"step": 10, "batches_consumed": 10})
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(5.0)
    ckpt.save(20, healthy=False, trainer_state={"step": 20, "batches_consumed": 20})  # not a rollback target

    state = rec.rollback("grad_norm 1e9 > 50 x median", step=23, incident="out/vidstab/incidents/step000023-rank0")
    assert state["step"] == 10 and state["batches_consumed"] == 10
    assert state["skip_data"] is True and state["rewind_data"] is False
    assert state["_checkpoint"]["path"] == "vidstab/checkpoints/step_000010"
    assert state["_checkpoint"]["trajectory_step"] == 10  # the explicit form's counter rewinds: one numbering
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())
    assert guard.lr_multiplier == 0.5 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    # A restart before the next save resumes on the rolled-back trajectory.
    assert (tmp_path / "vidstab" / "checkpoints" / "latest").read_text().strip() == "step_000010"
    ev = _events(tmp_path, "rollback")
    assert ev[-1]["step"] == 23 and ev[-1]["to_step"] == 10 and ev[-1]["retries"] == 1
    assert "to_trajectory_step" not in ev[-1] and "trajectory_step" not in ev[-1]
    assert ev[-1]["cause"] == "divergence" and ev[-1]["lr_multiplier"] == 0.5

    # Cumulative back-off, even though the checkpoint holds multiplier 1.0.
    assert rec.rollback("again", step=15)["step"] == 10
    assert guard.lr_multiplier == 0.25 and opt.param_groups[0]["lr"] == pytest.approx(0.025)

    # The count of this incident survives a restart (a new Recovery on the same run dir), and is said ...
    rec2 = Recovery(acc, ckpt, guard, RecoveryConfig(max_retries=2), run_dir=str(tmp_path))
    assert rec2.retries == 2
    assert "2 of 2 rollbacks used" in rec2.carried_over and "x0.25" in rec2.carried_over
    # ... and the next request aborts with the exact replay command of a bundle that exists (one that does not
    # is never named).
    bundle = tmp_path / "vidstab" / "incidents" / "step000011-rank1"
    bundle.mkdir(parents=True)
    (bundle / "incident.json").write_text("{}")
    with pytest.raises(RunAborted) as ei:
        rec2.rollback("third time", step=12, incident="/runs/a/vidstab/incidents/step000011-rank1")
    assert f"vidstab replay {bundle}" in str(ei.value) and "/runs/a" not in str(ei.value)
    assert "scripts/replay.py" not in str(ei.value)  # a pip user has no scripts/ folder
    assert "2 rollback(s)" in str(ei.value)


def test_replay_data_flag(tmp_path):
    acc, model, opt, ckpt, guard, rec = _run(tmp_path, RecoveryConfig(skip_data=False))
    ckpt.save(4, healthy=True, trainer_state={"step": 4, "batches_consumed": 8})
    state = rec.rollback("spike", step=6)
    assert state["rewind_data"] is True and state["skip_data"] is False and state["batches_consumed"] == 8


def test_rollback_without_a_good_checkpoint_aborts(tmp_path):
    acc, model, opt, ckpt, guard, rec = _run(tmp_path)
    ckpt.save(3, healthy=False, trainer_state={"step": 3})
    with pytest.raises(RunAborted, match="(?s)failure at step 3 impossible: no healthy checkpoint.*No incident bundle"):
        rec.rollback("nan loss", step=4)  # no bundle on disk: none is named
    bundle = tmp_path / "vidstab" / "incidents" / "step000003-rank0"
    bundle.mkdir(parents=True)
    (bundle / "incident.json").write_text("{}")
    with pytest.raises(RunAborted, match=f"(?s)no healthy checkpoint.*vidstab replay {bundle}"):
        rec.rollback("nan loss", step=4)


def test_preemption_handler_sets_flag_calls_back_and_restores_handlers():
    before_term, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    calls = []
    with PreemptionHandler(on_signal=lambda: calls.append(1)) as h:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM does not call back again
        assert h.stop_requested and h.received == signal.SIGTERM and calls == [1]
    assert signal.getsignal(signal.SIGTERM) is before_term and signal.getsignal(signal.SIGINT) is before_int


_CTRL_C = textwrap.dedent("""
    import os, signal, sys, time
    from vidstab.run.preemption import PreemptionHandler
    with PreemptionHandler() as h:
        os.kill(os.getpid(), signal.SIGINT)
        assert h.stop_requested
        print("first", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("survived", flush=True)
""")


def test_second_sigint_kills():
    r = subprocess.run([sys.executable, "-c", _CTRL_C], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGINT and "first" in r.stdout and "survived" not in r.stdout
