"""The event log is as durable as the checkpoint: a SIGKILL right after a save moved ``latest`` loses no metrics
line of the steps that checkpoint covers nor its own ``checkpoint`` event (real processes, real kills); a line cut
by a kill never swallows the next launch's first line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from vidstab.events import EventLog, read_events

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "log_durability.py"
STEPS, EVERY = 12, 3


def _launch(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS),
                           "--save-every", str(EVERY), *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _start(done: subprocess.CompletedProcess) -> int:
    return int(next(li for li in done.stdout.splitlines() if li.startswith("start step")).split()[-1])


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """One run killed right after ``latest`` moved, once on a synchronous save and once on an async one, then
    finished: ``(run folder, the step each launch started from)``."""
    out = tmp_path_factory.mktemp("durable") / "run"
    starts = []
    for extra in (["--kill-after-latest", "2"], ["--async", "--kill-after-latest", "1"], []):
        done = _launch(out, *extra)
        expected = -signal.SIGKILL if extra else 0
        assert done.returncode == expected, (extra, done.returncode, done.stderr[-3000:])
        starts.append(_start(done))
    return out, starts


def test_a_kill_after_latest_moved_loses_no_line_of_the_steps_it_covers(killed_twice):
    out, starts = killed_twice
    assert starts == [0, 2 * EVERY, 3 * EVERY]  # each launch resumed from the checkpoint published as it died
    events = read_events(out)
    metrics = Counter(e["step"] for e in events if e["kind"] == "metrics")
    # Steps 0..8 were covered by a checkpoint when a kill came: logged once, never again (the resume starts after).
    assert all(metrics[s] == 1 for s in range(3 * EVERY)), metrics
    assert sorted(metrics) == list(range(STEPS))  # and the steps after: every one has its line
    saved = Counter(e["step"] for e in events if e["kind"] == "checkpoint")
    assert saved == {s: 1 for s in range(EVERY, STEPS + 1, EVERY)}, saved
    # The checkpoint's event comes after the lines of the steps it covers, in the file.
    lines = [json.loads(x) for x in (out / "vidstab" / "events-rank0.jsonl").read_text().splitlines()]
    kinds = [(e["kind"], e["step"]) for e in lines]
    for s in (EVERY, 2 * EVERY, 3 * EVERY):
        assert kinds.index(("metrics", s - 1)) < kinds.index(("checkpoint", s))


def test_a_torn_last_line_never_swallows_the_next_launchs_first_line(tmp_path):
    path = tmp_path / "vidstab" / "events-rank0.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"schema":1,"kind":"metrics","step":0,"rank":0}\n{"schema":1,"kind":"metr')  # cut by a kill
    log = EventLog(tmp_path, rank=0)
    log.log("start", 1, world_size=1)
    log.close()
    notes: list[str] = []
    kinds = [e["kind"] for e in read_events(tmp_path, notes=notes)]
    assert kinds == ["metrics", "start"]
    assert len(notes) == 1 and "line 2" in notes[0]
    # A file that ends cleanly gets no blank line.
    EventLog(tmp_path, rank=0).close()
    assert path.read_bytes().endswith(b'"world_size":1}\n')
