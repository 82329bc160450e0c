"""Recovery policy for a weeks-long run: a retry budget per incident, an LR
back-off that depends on the cause and returns to the schedule, state carried over on a restart said and
resettable. Real Accelerate, real guard, real checkpoints, real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointManager
from vidstab.recovery.policy import Recovery, RecoveryConfig, RunAborted, rollback_cause

BASE_LR = 0.01


def _setup(tmp_path, config: RecoveryConfig, **kwargs):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(keep=3, async_save=False))
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched), ("vidstab", guard)):
        ckpt.register(name, obj)
    rec = Recovery(acc, ckpt, guard, config, run_dir=str(tmp_path), **kwargs)
    return acc, model, opt, guard, ckpt, rec


def _train(acc, model, opt, guard, ckpt, rec, until: int, faults: dict[int, tuple[str, str]], persistent=False):
    """A user loop: guarded steps, a checkpoint every 5 steps, a rollback when a fault fires at its step
    (once for a transient fault, every time the step is reached for a persistent one)."""
    step, fired = guard.global_step, set()
    while step < until:
        x = torch.randn(8, 4)
        guard.backward(model(x).pow(2).mean(), batch={"x": x})
        result = guard.step(1.0)
        step += 1
        if step in faults and (persistent or step not in fired):
            fired.add(step)
            detector, cause = faults[step]
            state = rec.rollback(f"{detector}: injected", step, cause=cause)
            step = state["step"]
            continue
        rec.on_step(step, skipped=result.skipped)
        if step % 5 == 0:
            ckpt.save(step, healthy=guard.healthy, trainer_state={"step": step})
    return step


def _events(tmp_path, kind):
    lines = (Path(tmp_path) / "vidstab" / "events-rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_five_independent_incidents_finish_with_the_lr_back_on_schedule(tmp_path):
    cfg = RecoveryConfig(max_retries=3, incident_window=20, lr_restore_every=10)
    run = _setup(tmp_path, cfg)
    acc, model, opt, guard, ckpt, rec = run
    faults = {32: ("repeated_spikes", "divergence"), 72: ("exception", "exception"),
              112: ("grad_spike", "divergence"), 152: ("consecutive_skips", "data"),
              192: ("nonfinite_params", "divergence")}
    assert _train(*run, until=260, faults=faults) == 260  # the old run-wide budget aborted at the 4th
    rollbacks = _events(tmp_path, "rollback")
    assert [r["cause"] for r in rollbacks] == ["divergence", "exception", "divergence", "data", "divergence"]
    assert [r["retries"] for r in rollbacks] == [1, 1, 1, 1, 1]  # each incident had its own budget
    # Divergence halves the LR; an exception or bad data does not.
    assert [r["lr_multiplier"] for r in rollbacks] == [0.5, 1.0, 0.5, 1.0, 0.5]
    # ... and a backed-off LR came back gradually after a stable stretch, every change in the log.
    recov = _events(tmp_path, "recovery")
    restores = [e for e in recov if e["action"] == "lr_restore"]
    assert [(e["old_multiplier"], e["lr_multiplier"]) for e in restores] == [(0.5, 1.0)] * 3
    assert sum(e["action"] == "incident_over" for e in recov) == 5
    assert rec.lr_multiplier == 1.0 and guard.lr_multiplier == 1.0
    assert opt.param_groups[0]["lr"] == pytest.approx(BASE_LR)
    assert rec.rollbacks_total == 5 and rec.retries == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_persistent_fault_still_aborts_after_the_budget(tmp_path):
    run = _setup(tmp_path, RecoveryConfig(max_retries=3, incident_window=20, lr_restore_every=10))
    # The failure is at step 11 as the event log numbers it (the loop's count after it is 12); a divergence has
    # no bundle, so the message names none that does not exist and says where the evidence is.
    with pytest.raises(RunAborted, match="(?s)3 rollback\\(s\\) for the incident that began at step 11.*"
                                         "No incident bundle was written.*vidstab events") as aborted:
        _train(*run, until=40, faults={12: ("repeated_spikes", "divergence")}, persistent=True)
    assert "vidstab replay" not in str(aborted.value)
    rollbacks = _events(tmp_path, "rollback")
    assert [r["retries"] for r in rollbacks] == [1, 2, 3]
    assert [r["lr_multiplier"] for r in rollbacks] == [0.5, 0.25, 0.125]


def test_carried_over_state_is_said_resettable_and_a_changed_config_gets_a_fresh_budget(tmp_path):
    cfg = RecoveryConfig(max_retries=2, incident_window=50)
    acc, model, opt, guard, ckpt, rec = _setup(tmp_path, cfg, config_hash="run-a")
    with pytest.raises(RunAborted):
        _train(acc, model, opt, guard, ckpt, rec, until=30, faults={12: ("grad_spike", "divergence")}, persistent=True)
    # A relaunch with the same config inherits the exhausted incident, and says so.
    rec2 = Recovery(acc, ckpt, guard, cfg, run_dir=str(tmp_path), config_hash="run-a")
    assert "2 of 2 rollbacks used" in rec2.carried_over and "x0.25" in rec2.carried_over
    assert "reset=True" in rec2.carried_over
    with pytest.raises(RunAborted):
        rec2.rollback("grad_spike: again", 12)
    # A fixed script (changed config) does not inherit the exhausted budget silently: it starts afresh.
    rec3 = Recovery(acc, ckpt, guard, cfg, run_dir=str(tmp_path), config_hash="run-b")
    assert rec3.retries == 0 and "started afresh because the run's configuration changed" in rec3.carried_over
    assert rec3.lr_multiplier == 0.25  # the back-off is kept, and said
    # reset=True forgets it all, and the next resume brings the LR back to the schedule.
    rec4 = Recovery(acc, ckpt, guard, cfg, run_dir=str(tmp_path), config_hash="run-b", reset=True)
    assert rec4.lr_multiplier == 1.0 and rec4.retries == 0 and rec4.carried_over is None
    rec4.resume("latest")
    assert guard.lr_multiplier == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(BASE_LR)
    actions = [e["action"] for e in _events(tmp_path, "recovery")]
    assert actions == ["abort", "carried_over", "abort", "carried_over", "reset"]
    assert json.loads((tmp_path / "vidstab" / "recovery.json").read_text())["lr_multiplier"] == 1.0


def test_rollback_accepts_a_path_incident_and_names_the_cause(tmp_path):
    acc, model, opt, guard, ckpt, rec = _setup(tmp_path, RecoveryConfig())
    ckpt.save(5, healthy=True, trainer_state={"step": 5})
    bundle = tmp_path / "vidstab" / "incidents" / "step000007-rank0"  # StepResult.incident is a Path
    state = rec.rollback("exception: RuntimeError: CUDA error", 8, incident=bundle)
    assert state["_recovery"]["cause"] == "exception" and guard.lr_multiplier == 1.0
    saved = json.loads((tmp_path / "vidstab" / "recovery.json").read_text())
    assert saved["history"][-1]["incident"] == str(bundle)


def test_rollback_cause_reads_the_step_findings():
    from vidstab.detectors import Finding, Verdict

    bad_input = Finding("nonfinite", Verdict.SKIP, "non-finite inputs", {"input_nonfinite": 3.0}, [1])
    assert rollback_cause("consecutive_skips: 5 in a row", [bad_input]) == "data"
    assert rollback_cause("exception: boom") == "exception"
    assert rollback_cause("repeated_spikes: 3 spikes") == "divergence"


def test_the_guard_owns_the_multiplier_and_a_relaunch_carries_it_over_the_checkpoint_once(tmp_path):
    cfg = RecoveryConfig(max_retries=3, incident_window=50, lr_restore_every=0)
    acc, model, opt, guard, ckpt, rec = _setup(tmp_path, cfg)
    _train(acc, model, opt, guard, ckpt, rec, until=14, faults={12: ("grad_spike", "divergence")})
    # The rollback went to step 10, saved at multiplier 1; the back-off after it is the guard's, and recorded.
    assert guard.lr_multiplier == rec.lr_multiplier == 0.5
    assert json.loads((tmp_path / "vidstab" / "recovery.json").read_text())["lr_multiplier"] == 0.5
    # A relaunch before the next save: the loop loads step 10 itself (multiplier 1 in it) and says so.
    rec2 = Recovery(acc, ckpt, guard, cfg, run_dir=str(tmp_path))
    state = ckpt.load("latest")
    assert state["_checkpoint"]["step"] == 10 and guard.lr_multiplier == 1.0
    rec2.check_resume(10)
    assert guard.lr_multiplier == 0.5 and opt.param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.5)
    # Once: recovery keeps no copy of its own that would undo a later change of the owner's.
    guard.set_lr_multiplier(0.3)
    rec2.on_step(11)
    rec2.check_resume(11)
    assert guard.lr_multiplier == rec2.lr_multiplier == 0.3
    assert opt.param_groups[0]["lr"] == pytest.approx(BASE_LR * 0.3)


def test_a_malformed_recovery_state_starts_fresh_saying_which_field_and_keeps_a_copy(tmp_path, caplog):
    cfg = RecoveryConfig(max_retries=3, incident_window=50, lr_restore_every=0)
    acc, model, opt, guard, ckpt, rec = _setup(tmp_path, cfg)
    _train(acc, model, opt, guard, ckpt, rec, until=14, faults={12: ("grad_spike", "divergence")})
    path = tmp_path / "vidstab" / "recovery.json"
    good = json.loads(path.read_text())
    assert good["lr_multiplier"] == 0.5 and Recovery(acc, ckpt, guard, cfg, run_dir=str(tmp_path)).lr_multiplier == 0.5
    for field, value, said in [("lr_multiplier", "0.5", "'lr_multiplier' is '0.5'; expected a finite number > 0"),
                               ("rollbacks_total", -1, "'rollbacks_total' is '-1'; expected an integer >= 0"),
                               ("history", [{"step": "x"}], "'history.step' is 'x'; expected an integer >= 0"),
                               ("incident", {"first_step": 1, "last_failure": None, "retries": 0},
                                "'incident.last_failure' is 'None'; expected an integer >= 0")]:
        text = json.dumps(dict(good, **{field: value}))
        path.write_text(text)
        caplog.clear()
        fresh = Recovery(acc, ckpt, guard, cfg, run_dir=str(tmp_path))
        assert fresh.retries == 0 and fresh.carried_over is None, field
        assert said in caplog.text and f"recovery state starts fresh (kept as {path}.unreadable)" in caplog.text
        assert (tmp_path / "vidstab" / "recovery.json.unreadable").read_text() == text
