"""One run per output folder: a second live trainer is refused with its holder, the lock of a killed run is
taken over, and the same command twice neither starts over silently nor mixes two runs. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import vidstab
from vidstab.run.run_dir import LOCK_FILE, PREVIOUS_RUNS, RunDirInUse, RunDirNotEmpty, claim_run_dir

_HOLDER = textwrap.dedent("""
    import sys, time
    import vidstab
    lock = vidstab.claim_run_dir(None, sys.argv[1])
    print("holding", flush=True)
    sys.stdin.readline()
""")


def _start_holder(out):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_second_live_trainer_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = _start_holder(out)
    try:
        with pytest.raises(RunDirInUse, match=f"in use by another trainer \\(host \\S+, pid {holder.pid}"):
            claim_run_dir(None, out)
    finally:
        holder.send_signal(signal.SIGKILL)  # a killed run never releases its lock by itself
        holder.wait(timeout=30)
    lock = claim_run_dir(None, out)  # the OS released the dead holder's flock: stale, taken over
    try:
        assert lock.took_over["pid"] == holder.pid
        assert str(os.getpid()) in (out / LOCK_FILE).read_text()
    finally:
        lock.release()
    again = claim_run_dir(None, out)  # a clean release is not a stale lock
    assert again.took_over is None
    again.release()


def test_the_same_command_twice_is_refused_unless_it_resumes_or_overwrites(tmp_path):
    out = tmp_path / "run"
    with claim_run_dir(None, out):
        (out / "vidstab").mkdir()
        (out / "vidstab" / "events-rank0.jsonl").write_text('{"kind": "start"}\n')
    with pytest.raises(RunDirNotEmpty, match="(?s)already holds a run \\(vidstab/\\).*--resume_from_checkpoint latest.*--overwrite_output_dir"):
        claim_run_dir(None, out)
    with claim_run_dir(None, out, resume="latest") as lock:
        assert lock.moved_to is None and (out / "vidstab" / "events-rank0.jsonl").exists()
    with claim_run_dir(None, out, overwrite=True) as lock:
        # moved, never deleted, and nothing of the earlier run is left where the new one writes
        assert lock.moved_to.startswith(str(out / PREVIOUS_RUNS))
        assert (out / PREVIOUS_RUNS).is_dir() and not (out / "vidstab").exists()
        assert os.path.isfile(os.path.join(lock.moved_to, "vidstab", "events-rank0.jsonl"))
    assert vidstab.claim_run_dir is claim_run_dir


def test_a_torch_elastic_restart_without_resume_is_refused_saying_what_the_launch_line_lacks(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with claim_run_dir(None, out):
        (out / "vidstab").mkdir()
        (out / "vidstab" / "events-rank0.jsonl").write_text('{"kind": "start"}\n')
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(RunDirNotEmpty, match="torch-elastic restart 1 of 3.*must pass --resume_from_checkpoint latest"):
        claim_run_dir(None, out)
    with claim_run_dir(None, out, resume="latest") as lock:  # the documented launch line: the restart resumes
        assert lock.moved_to is None


def test_a_launch_whose_processes_did_not_join_is_refused_naming_the_launch(tmp_path):
    """torchrun with 2 processes on a machine without a GPU and without ACCELERATE_USE_CPU=1: each process gets
    an Accelerator of one process (measured). Both are refused before anything is written, with a message
    naming the launch and the fix, not "in use by another trainer"."""
    from trainer_utils import REPO, torchrun_cmd

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    proc = subprocess.run(torchrun_cmd(2, REPO / "examples" / "vidstab_loop.py", "--output_dir", str(out),
                                       "--max_train_steps", "2"),
                          cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "WORLD_SIZE=2" in proc.stderr and "ACCELERATE_USE_CPU=1 torchrun" in proc.stderr, proc.stderr[-3000:]
    assert "in use by another trainer" not in proc.stderr
    assert not (out / "vidstab").exists()  # refused before anything was written
