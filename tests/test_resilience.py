"""A run that survives a dead rank, a hung rank and a scheduler's SIGTERM, with real launchers and real kills.

Each run is the reference trainer under the launch form docs/faults.md
documents (``accelerate launch --rdzv_backend c10d --max_restarts N`` with a fresh store per rendezvous round),
2 CPU processes, and must end with final weights bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from doc_snippets import doc_snippet
from trainer_utils import REPO, TRAIN, events, fast_flags, free_port, shared_run

pytestmark = pytest.mark.slow

STEPS = 10
RUN = ["--max_train_steps", str(STEPS), "--checkpointing_steps", "2"]
SEED = int(os.environ.get("VIDSTAB_TEST_SEED", "0"))
"""Seed of the tests' fault draws: fixed, so every CI run tries the same cases; set it to try others."""


def draw_step(test: str, low: int = 1) -> tuple[int, str]:
    """A step in ``low .. STEPS - 2`` drawn from SEED and the test's name, and how to draw it again."""
    step = random.Random(f"{SEED}:{test}").randrange(low, STEPS - 1)
    return step, f"step {step} drawn with VIDSTAB_TEST_SEED={SEED}"


def launch_cmd(out, *args, nproc: int = 2, max_restarts: int = 2, resume: bool = True, html_report: bool = False) -> list[str]:
    """The documented launch form (docs/faults.md), with a free port.

    ``--resume_from_checkpoint latest`` as documented (a first launch has no checkpoint and starts from scratch);
    ``resume=False`` shows that a restart resumes without it."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if nproc > 1:
        cmd += ["--multi_gpu", "--rdzv_backend", "c10d", "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(free_port()), "--max_restarts", str(max_restarts)]
    cmd += ["--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            str(TRAIN), "--output_dir", str(out), *(["--resume_from_checkpoint", "latest"] if resume else []),
            *fast_flags(html_report), *RUN, *args]
    return cmd


def launch_env() -> dict:
    """The documented environment (docs/faults.md): a fresh store per round, and a rendezvous of this job's own
    (``PET_STANDALONE``), so launches running at once on this machine (two xdist workers, two engineers) never meet."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_STANDALONE": "1"}


def launch(out, *args, timeout: float = 300, case: str = "", **kw) -> subprocess.CompletedProcess:
    """Run to the end; a run that hangs fails the test instead of blocking CI (the bound on the time it may take).
    ``case``: how to rerun it (the drawn step and seed), said in the failure message."""
    proc = subprocess.run(launch_cmd(out, *args, **kw), cwd=REPO, env=launch_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{case}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def final_weights(out):
    return load_file(str(out / "vidstab" / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))


def assert_same_weights(a, b, case: str = ""):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), f"{case}: final weights differ"


def test_the_launch_these_tests_use_is_the_one_the_docs_give():
    block = doc_snippet("survive-faults")
    export, command = [line.strip() for line in block.strip().splitlines()]
    for pair in export.removeprefix("export ").split():
        name, value = pair.split("=")
        assert launch_env()[name] == value, name
    tested = launch_cmd("OUT")
    words = command.split()
    assert words[:2] == ["accelerate", "launch"] and tested[1:3] == ["-m", "accelerate.commands.launch"]
    for flag, val in zip(words, words[1:] + [""]):
        if flag.startswith("--"):
            assert flag in tested, flag
            if flag in ("--rdzv_backend", "--resume_from_checkpoint"):
                assert tested[tested.index(flag) + 1] == val


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted, with rank 1 five times slower from step 2 and a tight watchdog: healthy, so never killed."""
    def build(folder):
        out = folder / "run"
        launch(out, "--inject_fault", "slow@2:1=5", "--watchdog_timeout", "3")
        for rank in (0, 1):
            kinds = {e["kind"] for e in events(out, rank)}
            assert "hang" not in kinds and "restart" not in kinds and "crash" not in kinds
        assert not list((out / "vidstab").glob("hang-*"))

    return shared_run(tmp_path_factory, "resilience-reference", build) / "run"


def test_a_slow_but_healthy_rank_is_never_killed_by_the_watchdog(reference):
    assert [e["step"] for e in events(reference, 0, "metrics")] == list(range(STEPS))  # every step taken
    assert any(e.get("exit_code") == 0 for e in events(reference, 1, "stop"))  # and the slow rank ran to the end


def test_a_rank_sigkilled_at_a_random_step_restarts_resumes_and_ends_bitwise_equal(tmp_path, reference):
    step, case = draw_step("kill")
    out = tmp_path / "run"
    proc = launch(out, "--inject_fault", f"kill@{step}:1", "--watchdog_timeout", "3", resume=False, case=case)
    restarts = events(out, 0, "restart")
    assert len(restarts) == 1, f"{case}: {restarts}\n{proc.stderr[-3000:]}"
    r = restarts[0]
    assert r["restart_count"] == 1 and r["cause"] == "killed" and r["culprit_ranks"] == [1], (case, r)
    assert r["step"] == step - step % 2, case  # resumed from the latest checkpoint without --resume_from_checkpoint
    assert_same_weights(out, reference, case)
    # The goodput ledger of a kill: bucket by bucket as read off the raw event lines (tests/test_goodput.py), the
    # launcher's log saw the kill within the restart downtime, and the buckets tile the wall time.
    from test_goodput import assert_the_launcher_restarted_in_the_downtime, expected_buckets

    from vidstab.run.goodput import ledger

    led, resumed = ledger(out), step - step % 2
    want, wall = expected_buckets(out, ([(s, "rework" if s >= resumed else "productive") for s in range(step)],
                                        [(s, "productive") for s in range(resumed, STEPS)]))
    assert led["restarts"] == 1, case
    assert_the_launcher_restarted_in_the_downtime(out, proc.stdout + proc.stderr, -9)
    assert led["wall_seconds"] == pytest.approx(wall, abs=1e-6), case
    for bucket, seconds in want.items():
        assert led["buckets"][bucket] == pytest.approx(seconds, abs=1e-6), (case, bucket)
    assert led["buckets"]["restart"] > 0 and abs(sum(led["buckets"].values()) - wall) <= 0.01 * wall, case


def assert_hang_restarted(out, step: int, rank: int, case: str, stderr: str) -> None:
    """The watchdog ended ``rank`` hung in step ``step``'s data, the job restarted once and says why."""
    from test_goodput import launcher_saw_the_failure

    launcher_saw_the_failure(stderr, 75)  # the launcher saw the watchdog's exit status
    stacks = (out / "vidstab" / f"hang-rank{rank}-step{step:06d}.txt").read_text()
    assert "in maybe_hang" in stacks and "in train_step" in stacks, case  # where the hung rank was stuck
    restarts = events(out, 0, "restart")
    assert len(restarts) == 1, (case, restarts)
    r = restarts[0]
    assert r["cause"] == "hang" and r["culprit_ranks"] == [rank] and r["ranks"][str(rank)]["phase"] == "data", (case, r)
    assert r["step"] == step - step % 2, (case, r)  # the latest checkpoint, or none: step 0 from scratch
    assert "hang" in {e["kind"] for e in events(out, rank)}, case


def test_a_hung_rank_is_ended_by_the_watchdog_then_the_job_restarts_and_ends_bitwise_equal(tmp_path, reference):
    step, case = draw_step("hang", low=2)  # step 1 has its own test below
    out = tmp_path / "run"
    proc = launch(out, "--inject_fault", f"hang@{step}:1", "--watchdog_timeout", "3", resume=False, html_report=True,
                  case=case)
    assert_hang_restarted(out, step, 1, case, proc.stderr)
    assert "job restarts</th><td>1: hang (ranks" in (out / "report.html").read_text(), case  # the dashboard says it too
    assert_same_weights(out, reference, case)


def test_two_jobs_at_once_each_hung_at_step_1_before_a_checkpoint_restart_from_scratch_and_end_bitwise_equal(
        tmp_path, reference):
    """The early hang (step 1: no checkpoint yet, the restart starts over), in two jobs launched at once the
    documented way: each restarts in its own rendezvous. Under torch's shared default rendezvous one of them
    could lose its restart round to the other and end in torch's launcher with ``'NoneType' object has no
    attribute 'is_failed'``."""
    jobs = {rank: tmp_path / f"run-hung-rank{rank}" for rank in (1, 0)}
    procs = {rank: subprocess.Popen(launch_cmd(out, "--inject_fault", f"hang@1:{rank}", "--watchdog_timeout", "3",
                                               resume=False), cwd=REPO, env=launch_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, out in jobs.items()}
    try:
        ended = {rank: proc.communicate(timeout=400) for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for rank, out in jobs.items():
        case = f"hang@1:{rank}"
        assert procs[rank].returncode == 0, f"{case}: exit {procs[rank].returncode}\n{ended[rank][1][-6000:]}"
        assert_hang_restarted(out, 1, rank, case, ended[rank][1])
        assert_same_weights(out, reference, case)


def _wait_for_metrics(out, count: int, proc: subprocess.Popen, deadline_s: float = 180) -> None:
    path = out / "vidstab" / "events-rank0.jsonl"
    deadline = time.time() + deadline_s
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count('"metrics"') >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {count} steps within {deadline_s} s (launcher exit {proc.poll()})")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _wait_gone(pid: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
        status = open(f"/proc/{pid}/status").read() if os.path.exists(f"/proc/{pid}") else ""
        if "State:\tZ" in status:
            return
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}"), f"process {pid} still running {timeout} s after its launcher was signalled"


def test_sigterm_to_a_one_process_accelerate_launch_still_saves_and_stops_the_trainer(tmp_path):
    # Measured, two launchers: up to accelerate 1.15 the 1-process launcher dies at once (killed by the signal)
    # and never signals its child; the trainer notices that its parent is gone and stops as if it had received
    # SIGTERM itself. From 1.16 it catches SIGTERM, sends it on to the trainer, SIGKILLs whatever is still
    # running 5 s later and exits 143 (accelerate/commands/launch.py, _terminate_process_tree). Either way the
    # trainer finishes the step, saves and exits 0.
    out = tmp_path / "run"
    cmd = launch_cmd(out, "--max_train_steps", "100000", "--checkpointing_steps", "100000", nproc=1)
    # DEVNULL: the orphaned trainer must never block on a full pipe that no one reads.
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_metrics(out, 3, proc)
        (trainer,) = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)  # what Kubernetes and most schedulers do: signal the launcher
        assert proc.wait(timeout=60) in (-signal.SIGTERM, 128 + signal.SIGTERM)
        _wait_gone(trainer)
    finally:
        proc.kill()
    stop = events(out, 0, "stop")
    assert stop and stop[-1]["exit_code"] == 0
    stopped_at = int((out / "vidstab" / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert stopped_at >= 3 and stop[-1]["step"] == stopped_at


def test_sigterm_to_a_two_process_launch_saves_and_the_requeued_job_ends_bitwise_equal(tmp_path, reference):
    out = tmp_path / "run"
    # Every step 50x slower (time only, the numbers are the same), so the signal lands mid-run.
    requeue = ["--checkpointing_steps", "100", "--inject_fault", "slow@0=50"]
    cmd = launch_cmd(out, *requeue)
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_metrics(out, 3, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # torch elastic forwards SIGTERM to the workers, which save and exit 0; the launcher itself exits 1
    # (accelerate <= 1.15) or 143, 128 + the signal (1.16: accelerate/commands/launch.py, _run_torchrun).
    assert proc.returncode in (1, 128 + signal.SIGTERM), stderr[-3000:]
    assert all(events(out, rank, "stop")[-1]["exit_code"] == 0 for rank in (0, 1))
    stopped_at = int((out / "vidstab" / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert stopped_at < STEPS, "the run finished before the signal: nothing was tested"
    # The scheduler requeues the same command; --resume_from_checkpoint latest picks up where it stopped.
    launch(out, *requeue)
    assert [e["step"] for e in events(out, 0, "resume")] == [stopped_at]
    assert_same_weights(out, reference)
