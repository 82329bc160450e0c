"""Checkpoints that come from shared storage, other people and a stepped clock and
a trainer that survives failed saves: every drill of ``tests/checkpoint_drills.py`` as a test,
plus the trainer-level ones (real processes, real files)."""

from __future__ import annotations

import concurrent.futures
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from checkpoint_drills import DRILLS, DrillSkipped, checkpoint_root
from vidstab.checkpoint import verify_checkpoint_files
from trainer_utils import FAST, REPO, TRAIN, events, run_trainer


@pytest.mark.parametrize("name", sorted(DRILLS))
def test_checkpoint_drill(name, tmp_path):
    try:
        checked = DRILLS[name](tmp_path)
    except DrillSkipped as e:
        pytest.skip(str(e))
    # Each drill asserts inside and returns the one line it verified; no line means it checked nothing.
    assert isinstance(checked, str) and checked, f"drill {name} returned no verdict"


def _fsize_limit(limit: int):
    """preexec_fn: every file this process writes is capped at ``limit`` bytes (a full quota for files
    as big as a checkpoint's, while the small event log still grows); SIGXFSZ ignored, so an oversized
    write fails with EFBIG instead of killing the trainer."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_trainer_keeps_training_when_checkpoint_saves_fail(tmp_path):
    """A failed save never ends a run while earlier checkpoints are intact: logged, a warn event
    per failed interval, training goes on to the end, the report says so; exit code 4 because the final
    state could not be written; the earlier checkpoint still loads."""
    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "4", "--checkpointing_steps", "2")
    latest = checkpoint_root(out) / "latest"
    assert latest.read_text().strip() == "step_000004"
    # In a copy of the run and alongside the failing run below (independent: started together).
    typo = tmp_path / "typo"
    shutil.copytree(out, typo)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    mistyped = pool.submit(run_trainer, typo, "--max_train_steps", "6", "--resume_from_checkpoint", "checkpoint-4",
                           check=False)
    flags = [f for f in FAST if f != "--no_async_save"]  # async: a failure surfaces at the next interval
    cmd = [sys.executable, str(TRAIN), "--output_dir", str(out), *flags, "--max_train_steps", "10",
           "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
                          preexec_fn=_fsize_limit(100_000))  # model.safetensors is ~265 kB
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 10/10 steps" in proc.stdout
    assert "checkpoint saves failed" in proc.stdout and "newest intact: " in proc.stdout
    warns = [e for e in events(out, kind="warn") if e.get("detector") == "checkpoint"]
    # steps 6 and 8 surface at the next interval, 10 at the end, and the foreground retry of 10 fails too
    assert [e["step"] for e in warns] == [8, 10, 10, 10], [(e["step"], e["message"][:80]) for e in warns]
    assert all("File too large" in e["message"] and "training continues" in e["message"] for e in warns)
    assert [m["step"] for m in events(out, kind="metrics")][-1] == 9  # trained to the end
    assert latest.read_text().strip() == "step_000004"
    stop = events(out, kind="stop")[-1]
    assert stop["exit_code"] == 4
    verify_checkpoint_files(checkpoint_root(out) / "step_000004")  # the earlier checkpoint is intact
    # A mistyped --resume_from_checkpoint says what exists instead of "incomplete save"
    proc = mistyped.result()
    pool.shutdown()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no such checkpoint 'checkpoint-4'" in proc.stdout and "step_000004" in proc.stdout
    assert "incomplete save" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_trainer_refuses_a_resume_on_another_world_size(tmp_path):
    """A checkpoint of a 1-process run resumed by 2 processes is refused with a message
    that says why and what to do (exit 2), instead of silently changing the data order and LR schedule."""
    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "2", "--checkpointing_steps", "2")
    proc = run_trainer(out, "--max_train_steps", "4", "--resume_from_checkpoint", "latest", nproc=2, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "written by 1 process" in text and "this run has 2" in text, text[-3000:]
    assert "Traceback" not in proc.stdout
    assert not (checkpoint_root(out) / "step_000004").exists()
