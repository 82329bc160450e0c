"""The event log's guarantee with buffered healthy lines: a crash loses at most healthy metrics lines,
never a finding or an incident, and never tears a line (a real SIGKILL of a real training process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from vidstab import read_events
from vidstab.events import EventLog, events_dir, log_event

KILLED_LOOP = textwrap.dedent("""
    import os, signal, sys
    import torch
    from accelerate import Accelerator
    import vidstab

    out, nan_steps, kill_after = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = vidstab.attach(accelerator, model, optimizer, run_dir=out)
    for step in range(1000):
        x = torch.randn(4, 8)
        if step in nan_steps:
            x[0, 0] = float("nan")
        loss = model(x).square().mean()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no flush, no close: a crash
""")


def run_killed(tmp_path, nan_steps: str, kill_after: int) -> list[str]:
    script = tmp_path / "loop.py"
    script.write_text(KILLED_LOOP)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(out), nan_steps, str(kill_after)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return (events_dir(out) / "events-rank0.jsonl").read_text().splitlines()


def test_findings_survive_a_kill_right_after_them(tmp_path):
    lines = run_killed(tmp_path, nan_steps="3,30", kill_after=30)
    events = [json.loads(line) for line in lines]  # every line whole: nothing torn
    kinds = [(e["kind"], e["step"]) for e in events if e["kind"] != "start"]
    assert {("skip", 3), ("incident", 3), ("skip", 30), ("incident", 30)} <= set(kinds)
    # the healthy lines buffered before each finding went out with it, in order
    assert [s for k, s in kinds if k == "metrics"] == list(range(31))


def test_healthy_lines_are_buffered_and_every_other_event_flushes(tmp_path):
    log = EventLog(tmp_path, rank=0, flush_lines=100, flush_seconds=3600)
    path = log.path
    log.log("start", 0)
    for step in range(5):
        log.log("metrics", step, loss=1.0)
    assert len(path.read_text().splitlines()) == 1  # only 'start' is on disk: metrics are buffered
    log_event(tmp_path, 0, "checkpoint", 5, path="checkpoints/step_000005")  # e.g. the CheckpointManager
    on_disk = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert on_disk == ["start"] + ["metrics"] * 5 + ["checkpoint"]  # one file order, flushed at once
    for step in range(6, 9):
        log.log("metrics", step, loss=float("nan"))  # non-finite values take the slow path, still buffered
    assert [e["step"] for e in read_events(tmp_path, "metrics")] == list(range(5)) + [6, 7, 8]  # readers flush
    for step in range(9, 200):
        log.log("metrics", step, loss=1.0)
    assert len(path.read_text().splitlines()) >= 7 + 100  # the buffer never holds more than flush_lines
    log.close()
    assert len(path.read_text().splitlines()) == 7 + 194
