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


class _ListTracker:
    """A tracker of our own (Accelerate's ``log_with`` takes instances): keeps what it is sent."""

    def __new__(cls):
        from accelerate.tracking import GeneralTracker

        class ListTracker(GeneralTracker):
            name = "list"
            requires_logging_directory = False

            def __init__(self):
                super().__init__()
                self.logged: list[tuple[int, dict]] = []

            @property
            def tracker(self):
                return self

            def store_init_configuration(self, values):
                pass

            def log(self, values, step=None, **kwargs):
                self.logged.append((step, dict(values)))

        return ListTracker()


def _thresholds_of_a_run(run_dir, tracker) -> tuple[dict[int, dict], dict]:
    """Train a small model under ``vidstab.attach`` for 160 steps (a checkpoint's ``state_dict`` at step 90);
    returns each metrics line's published thresholds by step, and the guard's final state."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import vidstab

    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, log_with=[tracker] if tracker is not None else None)
    if tracker is not None:
        accelerator.init_trackers("thresholds")
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = vidstab.attach(accelerator, model, optimizer, run_dir=run_dir)
    gen = torch.Generator().manual_seed(1)
    for step in range(160):
        x = torch.randn(4, 8, generator=gen) * (3.0 if step % 23 == 0 else 1.0)
        accelerator.backward(model(x).square().mean())
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step == 90:
            guard.state_dict()  # what accelerator.save_state's hook reads mid-run
    state = guard.state_dict()
    guard.close()
    keys = ("grad_norm_ema", "grad_spike_threshold")
    lines = {e["step"]: {k: e[k] for k in keys if k in e} for e in read_events(run_dir) if e["kind"] == "metrics"}
    return lines, state


def test_thresholds_of_updates_made_later_reach_every_metrics_line(tmp_path):
    """Every step's detector thresholds reach its metrics line whether or not a tracker is attached. Against the
    same run with a tracker: the same thresholds on every line, the same final state, and the tracker received
    them too."""
    later, later_state = _thresholds_of_a_run(tmp_path / "later", None)
    tracker = _ListTracker()
    now, now_state = _thresholds_of_a_run(tmp_path / "now", tracker)
    assert sorted(later) == list(range(160))
    assert later == now
    assert sum("grad_spike_threshold" in v for v in later.values()) > 100  # after grad_spike's warm-up
    assert later_state["detectors"] == now_state["detectors"]
    sent = {step: v for step, v in tracker.logged}
    assert all(sent[s]["vidstab/grad_spike_threshold"] == v["grad_spike_threshold"] for s, v in now.items() if v)
