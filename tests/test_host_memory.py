"""Host memory (vidstab/run/host_memory.py): a steady climb of a rank's resident memory warns once, with the slope and
the projected time to the limit; a data-loader worker killed by a signal is recorded as such.

Real components: a real Accelerator and attached guard whose loop keeps allocating host memory each step; a real
DataLoader with one worker that is sent SIGKILL (what the kernel's OOM killer sends) while loading a chosen sample.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import vidstab
from vidstab.run.host_memory import (ChildrenMemory, DataLoaderWorkerKilled, HostMemoryWatch, memory_limit_mib,
                                     resident_mib)


def _attached(tmp_path):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, vidstab.attach(acc, model, opt, run_dir=tmp_path)


def _step(acc, model, opt, x):
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def test_readings_that_do_not_climb_steadily_never_warn():
    noisy = HostMemoryWatch()
    for i in range(200):  # a run that breathes: up and down by hundreds of MiB, no trend
        assert noisy.observe(i, 2000 + (300 if i % 2 else 0), when=float(i)) is None
    assert len(noisy.history) <= noisy.keep
    small = HostMemoryWatch()
    for i in range(200):  # a climb smaller than the floor
        assert small.observe(i, 2000 + 0.1 * i, when=float(i)) is None


def test_a_steady_host_memory_climb_warns_once_with_the_slope_and_the_time_to_the_limit(tmp_path, capfd):
    acc, model, opt, guard = _attached(tmp_path)
    kept, x = [], torch.randn(2, 4)
    for _ in range(14):  # a loop that keeps 32 MiB more each step (a leak)
        kept.append(torch.ones(8 * 2**20))
        _step(acc, model, opt, x)
    guard.close()
    climbs = vidstab.read_events(tmp_path, "host_memory_climb")
    assert len(climbs) == 1, climbs
    c = climbs[0]
    assert c["growth_mib"] >= 64 and c["slope_mib_per_step"] > 8 and c["slope_mib_per_s"] > 0
    limit, source = memory_limit_mib()
    assert c["limit_mib"] == round(limit, 1) and c["limit_source"] == source
    assert c["projected_seconds_to_limit"] > 0 and len(c["history"]) >= 8
    rss = [e["rss_mib"] for e in vidstab.read_events(tmp_path, "metrics")]
    assert rss[-1] - rss[0] >= 64 * 3 and resident_mib() >= rss[-1] - 1
    err = capfd.readouterr().err
    assert err.count("host memory climbing steadily") == 1 and f"step {c['step']}, rank 0" in err


class KilledAt(torch.utils.data.Dataset):
    """Eight samples; loading ``index`` kills the worker that loads it with SIGKILL. (PyTorch's SIGCHLD handler
    raises in the main thread wherever it is: only an error raised in the loader's ``next()`` is recorded.)"""

    def __init__(self, index: int) -> None:
        self.index = index

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.index and torch.utils.data.get_worker_info() is not None:
            time.sleep(1.0)  # the loop is back in the loader's next() when the signal's SIGCHLD reaches it
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((4,), float(i))


def test_each_epochs_new_loader_worker_is_read_at_its_first_batch():
    """A new epoch's workers are new processes: read at its first batch, not only every ``every`` batches."""
    import psutil

    others = {p.pid for p in psutil.Process().children()}  # this test process's own (the tests' warm interpreters)
    memory = ChildrenMemory(every=16)
    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2, num_workers=1)
    for _ in range(2):
        memory.new_epoch()
        for _ in loader:
            memory.sample()
    workers = {pid: h for pid, h in memory.history.items() if pid not in others}
    assert len(workers) == 2 and all(len(h) == 1 for h in workers.values()), memory.history


def test_a_data_loader_worker_killed_by_a_signal_is_recorded_with_the_memory_history(tmp_path, capfd):
    acc, model, opt, guard = _attached(tmp_path)
    loader = torch.utils.data.DataLoader(KilledAt(5), batch_size=2, num_workers=1, prefetch_factor=1)
    steps = 0
    with pytest.raises(DataLoaderWorkerKilled) as caught:
        for x in guard.track_samples(loader):
            _step(acc, model, opt, x)
            steps += 1
    guard.close()
    assert steps == 2  # batches [0, 1] and [2, 3]; the worker died loading sample 5
    (event,) = vidstab.read_events(tmp_path, "dataloader_worker_killed")
    assert event["signal"] == "Killed" and len(event["worker_pids"]) == 1
    pid = event["worker_pids"][0]
    assert str(pid) in event["worker_rss_history"] and event["worker_rss_history"][str(pid)], event
    assert event["rss_mib"] > 0 and event["rss_history"] and event["limit_mib"] > 0
    message = str(caught.value)
    assert "SIGKILL" in message and "out-of-memory killer" in message and str(pid) in message
    assert message in capfd.readouterr().err


@pytest.mark.slow
def test_a_worker_killed_under_max_restarts_is_recorded_then_the_job_restarts_resumes_and_finishes(tmp_path):
    """``accelerate launch --max_restarts 1`` (docs/faults.md's launch) of tests/scripts/worker_killed_restart.py:
    rank 1's data-loader worker is SIGKILLed loading step 5's batch (Accelerate's loader reads one batch ahead: the
    error reaches the loop fetching step 4); the rank records it and exits, its peer ends in its collective, torch
    elastic restarts both, and the loop's own resume goes on from checkpoint-4 to the end."""
    from trainer_utils import REPO, free_port

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--rdzv_backend", "c10d", "--main_process_ip",
           "127.0.0.1", "--main_process_port", str(free_port()), "--max_restarts", "1",
           str(REPO / "tests" / "scripts" / "worker_killed_restart.py"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_STANDALONE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    (event,) = vidstab.read_events(out, "dataloader_worker_killed")
    assert event["rank"] == 1 and event["step"] == 4 and event["signal"] == "Killed" and event["rss_history"], event
    assert "\nvidstab: step 4, rank 1: data-loader worker pid" in log and "out-of-memory killer" in log
    for rank in (0, 1):
        lines = [json.loads(x) for x in (out / f"attempts-rank{rank}.jsonl").read_text().splitlines()]
        first, second = [[x for x in lines if x["attempt"] == a][-1] for a in (0, 1)]
        assert first["resumed"] == 0 and first["trained"] == [0, 1, 2, 3]
        assert second["resumed"] == 4 and second["trained"] == [4, 5, 6, 7] and second["finite"]
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == [2, 4, 6, 8]


@pytest.mark.slow
def test_the_trainer_records_a_worker_killed_on_one_rank_then_the_elastic_restart_resumes_and_finishes(tmp_path):
    """The reference trainer on 2 processes under the documented elastic launch (docs/faults.md, ``--max_restarts
    1``), its own loader (``--dataloader_num_workers 1``), ``--inject_fault kill_worker@3:1``: rank 1's worker
    SIGKILLs itself as the out-of-memory killer would; rank 1 logs ``dataloader_worker_killed`` with the memory
    history, says it in one message and exits with no traceback of its own (its peer's failed collective prints one:
    that rank cannot know why); torch elastic restarts both ranks, which resume from the last checkpoint (the drill
    is not repeated in a restart) and finish."""
    from test_resilience import launch

    out = tmp_path / "run"
    # Batches of 1 per rank: one epoch of 8 steps, served by one worker per rank, its memory read at the first batch
    # (a worker that dies before its first batch has no history to give).
    proc = launch(out, "--max_train_steps", "8", "--train_batch_size", "1", "--checkpointing_steps", "2",
                  "--dataloader_num_workers", "1", "--inject_fault", "kill_worker@3:1", max_restarts=1, timeout=400)
    log = proc.stdout + proc.stderr
    (event,) = vidstab.read_events(out, "dataloader_worker_killed")
    assert event["rank"] == 1 and event["signal"] == "Killed" and event["step"] >= 3 and event["rss_history"], event
    (pid,) = event["worker_pids"]
    assert event["worker_rss_history"][str(pid)], event
    assert f"rank 1: data-loader worker pid [{pid}] died of Killed" in log and "out-of-memory killer" in log
    assert "[rank1]: Traceback" not in log, log[-6000:]  # its peer's collective fails with one, as the peer's own
    assert "done: 8/8 steps" in proc.stdout, proc.stdout[-3000:]
    (crash,) = [e for e in vidstab.read_events(out, "crash") if e["rank"] == 1]
    assert "DataLoader worker" in crash["error"], crash
    (restart,) = [e for e in vidstab.read_events(out, "restart") if e["rank"] == 0]
    assert restart["step"] >= 2 and restart["resumed_from"], restart
