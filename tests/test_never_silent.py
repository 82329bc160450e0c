"""Never silent: what vidstab did to an unmodified loop is said once, on the main process, in the script's step
numbering; a rollback it cannot carry out and an abort stop the run with one message and exit code 3; the abort
names the failure it is about; advice names the form the user is in. Real Accelerate, real checkpoints on disk,
2 real processes where the path needs them (tests/scripts/never_silent.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import vidstab
from vidstab.events import iter_event_file
from vidstab.form_advice import recovery_setting

import test_auto_rollback

REPO = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def two_process_abort(tmp_path_factory):
    """2 processes: a NaN on rank 1 at step 3, an LR bug from step 12 (4 refused updates, an in-place rollback at
    16 to step_000012), every rollback checkpoint corrupted before step 18: the next rollback (step 21) is
    impossible."""
    out = tmp_path_factory.mktemp("never_silent")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(REPO / "tests" / "scripts" / "never_silent.py"), "--out", str(out), "--nan_step", "3",
           "--bad_lr_from", "12", "--corrupt_at", "18", "--steps", "40"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return out, proc


@pytest.mark.slow
def test_two_processes_say_each_skip_bundle_and_rollback_once_on_the_main_process(two_process_abort):
    out, proc = two_process_abort
    lines = [x for x in proc.stderr.splitlines() if x.startswith("vidstab: step")]
    skips = [x.split(": update refused")[0] for x in lines if ": update refused, step skipped (" in x]
    # Once each (not once per rank); after the in-place rollback the trajectory step is named beside the script's.
    assert skips == ["vidstab: step 3", *(f"vidstab: step {s}" for s in range(12, 16)),
                     *(f"vidstab: step {s} (trajectory step {s - 5})" for s in range(17, 21))], proc.stderr[-3000:]
    bundle = str(out / "vidstab" / "incidents" / "step000003-rank1")
    # Rank 1 wrote it; the main process says it, with the exact replay command.
    assert [x for x in lines if "incident bundle" in x] == [
        f"vidstab: step 3: rank 1 wrote incident bundle {bundle}; replay it with: vidstab replay {bundle}"]
    (rollback,) = [x for x in lines if "rolled back in place" in x]
    assert rollback.startswith("vidstab: step 16: rolled back in place to step 12 from vidstab/rollback/step_000012, "
                               "rollback 1/3 of this incident, cause divergence")
    # The rollback event: the script's numbering, with the checkpoint's (trajectory) step as to_step.
    events = [e for e in iter_event_file(out / "vidstab" / "events-rank0.jsonl") if e["kind"] == "rollback"]
    assert [(e["step"], e["failed_step"], e["to_step"], e.get("trajectory_step")) for e in events] == [(17, 16, 12, None)]


@pytest.mark.slow
def test_an_impossible_rollback_stops_every_rank_with_exit_3_and_one_message(two_process_abort):
    out, proc = two_process_abort
    assert proc.returncode != 0
    # Every rank stopped with the documented code; the launcher names the first to exit as the root cause (and may
    # stop the other itself before it is out) ...
    for rank in (0, 1):
        (stop,) = [e for e in iter_event_file(out / "vidstab" / f"events-rank{rank}.jsonl") if e["kind"] == "stop"]
        assert stop["exit_code"] == 3 and stop["step"] == 22
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "exitcode  : 3" in root_cause, proc.stderr[-3000:]
    # ... and no rank printed a traceback: the one traceback is the launcher's own ChildFailedError.
    assert proc.stderr.count("Traceback (most recent call last)") <= 1 and "RunAborted" not in proc.stderr
    aborts = [x for x in proc.stderr.splitlines() if x.startswith("vidstab: run aborted:")]
    assert len(aborts) == 1, proc.stderr[-3000:]
    assert aborts[0].startswith("vidstab: run aborted: rollback after the failure at step 21 (trajectory step 16) "
                                "impossible: nothing to load for 'last_good'")
    assert "crc32 mismatch" in aborts[0] and "--overwrite_output_dir" not in aborts[0]  # a launch's remedy, not a loop's


def _loop(out, **kwargs):
    """test_auto_rollback's plain Accelerate loop (``rollback_every=4``), in a fresh Accelerate state."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return test_auto_rollback._loop(out, **kwargs)


def test_an_abort_names_the_failure_it_is_about_not_earlier_trouble(tmp_path):
    # A NaN batch at step 5 (skipped, its bundle written), then an LR bug from step 12 on: the rollbacks and the
    # abort are about the LR, with its own step; neither the diagnosis nor the replay command points at step 5.
    with pytest.raises(vidstab.RunAborted) as aborted:
        _loop(tmp_path, bad_lr_steps=set(range(12, 100)), nan_steps={5})
    message = str(aborted.value)
    assert "first change: learning rate / precision (lr_bound at step 27)" in message, message
    assert "nonfinite" not in message and "data" not in message.split("No incident bundle")[0], message
    assert "vidstab replay" not in message  # the LR failure wrote no bundle: step 5's is not its evidence
    assert "No incident bundle was written for steps 27-31" in message
    assert "last failure at step 31 (trajectory step 5), cause divergence" in message
    rollbacks = [e for e in iter_event_file(tmp_path / "vidstab" / "events-rank0.jsonl") if e["kind"] == "rollback"]
    assert all("data" not in r["reason"] for r in rollbacks), [r["reason"] for r in rollbacks]


def test_a_rollback_with_no_healthy_checkpoint_stops_with_exit_code_3(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:  # an LR bug from the first step: no checkpoint is healthy
        _loop(tmp_path, bad_lr_steps=set(range(100)), steps=10)
    assert stopped.value.code == 3 and isinstance(stopped.value, vidstab.RunAborted)
    err = capsys.readouterr().err
    assert err.count("vidstab: run aborted: rollback after the failure at step 4 impossible: no healthy checkpoint "
                     "yet") == 1


def test_a_rollback_checkpoint_that_cannot_be_written_is_said_and_the_run_goes_on(tmp_path, capsys):
    rollback_dir = tmp_path / "vidstab" / "rollback"

    def break_the_folder(step, guard):  # from step 6 on the rollback folder is a file: no save can succeed
        if step == 6:
            guard.auto_rollback.ckpt.wait()
            shutil.rmtree(rollback_dir)
            rollback_dir.write_text("not a folder")

    guard = _loop(tmp_path, bad_lr_steps=set(), steps=10, before_step=break_the_folder)[4]
    guard.close()
    err = capsys.readouterr().err
    assert err.count("the rollback checkpoint of step 8 was not written (") == 1, err[-2000:]
    assert "Traceback" not in err and err.splitlines()[-1].startswith("vidstab: 10 optimizer steps guarded, 0 skipped")
    warns = [e for e in iter_event_file(tmp_path / "vidstab" / "events-rank0.jsonl")
             if e["kind"] == "warn" and e["detector"] == "rollback_every"]
    assert [e["step"] for e in warns] == [7]


def test_advice_names_the_form_the_user_is_in(tmp_path):
    assert recovery_setting("attached", reset=True) == "attach(..., recovery=RecoveryConfig(reset=True))"
    assert recovery_setting("explicit", reset=True) == "Recovery(..., reset=True)"
    assert recovery_setting("explicit", max_retries=4) == "Recovery(..., config=RecoveryConfig(max_retries=4))"
    assert recovery_setting("trainer", reset=True) == "--reset_recovery"
    assert recovery_setting("trainer", max_retries=4) == "--max_retries 4"
    # A relaunch carrying a backed-off LR over: each form is told its own way to start fresh, and only that.
    (tmp_path / "vidstab").mkdir()
    (tmp_path / "vidstab" / "recovery.json").write_text(json.dumps({"schema": 2, "lr_multiplier": 0.25}))
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    ckpt = vidstab.CheckpointManager(acc, str(tmp_path))
    ways = {"explicit": "Recovery(..., reset=True)", "trainer": "--reset_recovery",
            "attached": "attach(..., recovery=RecoveryConfig(reset=True))"}
    for form, way in ways.items():
        told = vidstab.Recovery(acc, ckpt, form=form).carried_over
        assert told.endswith(f"To start fresh: {way}"), told
        assert all(other not in told for f, other in ways.items() if f != form)
