"""The dashboard renders from real per-rank event logs and incident bundles, with every section present."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import numpy as np
import torch

from vidstab.capture import write_incident
from vidstab.events import EventLog
from vidstab.tools.report import SECTIONS, load_run, write_report
from vidstab.tools.report.series import _bin

INCIDENT_IDS = ["shapes-s0-00017", "shapes-s0-00018"]


def make_run(run_dir: Path, steps: int = 200, world: int = 2, finish: bool = True, torn_line: bool = True) -> Path:
    """A realistic 2-rank run written with the real EventLog: a NaN on rank 1 at step 60 (skipped, with an
    incident bundle), checkpoints every 50 steps, a rollback at step 130 to step 100 (steps 101.. run again
    with half the LR), fp16 loss scale with one overflow, and a torn last line on rank 1 (a killed writer)."""
    logs = [EventLog(run_dir, rank=r) for r in range(world)]
    rng = random.Random(0)
    for log in logs:
        log.log("start", 0, world_size=world)
    step, rolled, skipped, lr_mult = 1, False, 0, 1.0
    while step <= steps:
        nan_step = step == 60
        skipped += nan_step
        for rank, log in enumerate(logs):
            loss = 1.0 / math.sqrt(step) + 0.05 * rng.random()
            grad = 2.0 * (1 + 0.2 * rng.random()) * (40 if nan_step else 1)
            log.log(
                "metrics", step, loss=loss, loss_rank=None if (nan_step and rank == 1) else loss,
                lr=1e-4 * min(1.0, step / 20) * lr_mult, grad_norm=grad, clipped=grad > 1.0, clip_rate=0.3,
                loss_scale=2.0**16 if step < 90 else 2.0**15, skipped_total=skipped,
                input_absmax=3.0 + rank + (1e4 if nan_step and rank == 1 else 0), input_mean=0.0, input_std=1.0,
                input_nonfinite=int(nan_step and rank == 1), applied=not nan_step,
                loss_by_t=[loss * (1 + k / 10) for k in range(10)],
            )
        if step == 90:
            for log in logs:
                log.log("overflow", 90, loss_scale=2.0**15, overflow_total=1)
        if nan_step:
            for log in logs:
                log.log("skip", 60, detector="nonfinite", message="non-finite loss on rank 1",
                        figures={"grad_norm": 80.0}, bad_ranks=[1])
            bundle = write_incident(
                run_dir, step=60, micro_step=0, rank=1, world_size=world,
                batch={"latents": torch.zeros(2, 4, 2, 4, 4), "timesteps": torch.tensor([10, 900])},
                sample_ids=INCIDENT_IDS, finding={"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN"},
                lr=1e-4, precision="no", seed=0, checkpoint=None, model_spec=None,
            )
            logs[1].log("incident", 60, path=bundle.relative_to(run_dir).as_posix(), sample_ids=INCIDENT_IDS,
                        detector="nonfinite")
        if step % 50 == 0:
            for log in logs:
                log.log("checkpoint", step, path=f"checkpoints/step_{step:06d}", healthy=True, seconds=0.1)
        if step == 130 and not rolled:
            rolled, lr_mult = True, 0.5
            for log in logs:
                log.log("rollback", 130, reason="grad_spike: 3 spikes in 20 steps", checkpoint="checkpoints/step_000100",
                        to_step=100, retries=1, lr_multiplier=0.5)
            step = 101
            continue
        step += 1
    if finish:
        for log in logs:
            log.log("stop", steps, exit_code=0, seconds=12.0)
    for log in logs:
        log.close()
    if torn_line:
        with open(run_dir / "vidstab" / "events-rank1.jsonl", "a", encoding="utf-8") as f:
            f.write('{"schema":1,"time":1.0,"step":201,"rank":1,"kind":"metr')
    return run_dir


def _section(page: str, title: str) -> str:
    """The HTML of one section (between its heading and the next section)."""
    start = page.index(f"<h2>{title}</h2>")
    end = page.find("<section", start)
    return page[start : end if end > 0 else len(page)]


def test_report_renders_every_section_from_two_ranks(tmp_path):
    run = make_run(tmp_path / "run")
    out = write_report(run)
    assert out == run / "report.html"
    page = out.read_text(encoding="utf-8")

    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page, title
    # Every plot section has data in this run: one embedded PNG each, no "no data".
    assert page.count("data:image/png;base64,") == 7
    for title in ("Loss", "Gradient norm", "Learning rate", "Loss scale", "Clip rate", "Loss by timestep",
                  "Input statistics per rank"):
        assert "no data" not in _section(page, title), title
    # Self-contained: nothing fetched from elsewhere.
    assert "http://" not in page and "https://" not in page
    assert not re.search(r'src="(?!data:)', page)

    summary = _section(page, "Summary")
    assert "Finished with trouble handled" in summary
    assert "skipped steps</th><td>1 (steps 60)" in summary
    assert "rollbacks</th><td>1 (at steps 130)" in summary
    assert "incidents</th><td>1" in summary

    incidents = _section(page, "Incidents")
    for sample_id in INCIDENT_IDS:
        assert sample_id in incidents
    assert 'href="vidstab/incidents/step000060-rank1/"' in incidents
    assert (run / "vidstab/incidents/step000060-rank1/incident.json").is_file()

    events = _section(page, "Events")
    assert "non-finite loss on rank 1" in events and "bad_ranks" in events
    assert "grad_spike: 3 spikes in 20 steps" in events  # a rollback's reason
    assert "checkpoints/step_000150" in events
    # The same verdict logged by both ranks is one row naming both.
    assert events.count("non-finite loss on rank 1") == 1

    # Rank 1 (NaN loss, non-finite inputs, named in bad_ranks, wrote the bundle) stands out; rank 0 does not.
    per_rank = _section(page, "Input statistics per rank")
    assert '<tr class="flag"><td>1</td>' in per_rank and '<tr><td>0</td>' in per_rank

    notes = _section(page, "Notes")
    assert "events-rank1.jsonl" in notes and "truncated last line" in notes


def test_rollback_keeps_final_trajectory_and_superseded_attempt(tmp_path):
    log = load_run(make_run(tmp_path / "run", torn_line=False))
    m = log.metrics[0]
    # Steps 101..130 ran twice: the second pass is attempt 1.
    assert (m.steps == 101).sum() == 2
    assert set(m.attempts[m.steps > 130].tolist()) == {1}
    assert log.notes == []


def test_killed_run_without_stop_event_is_not_finished(tmp_path):
    run = make_run(tmp_path / "run", steps=40, finish=False)
    page = write_report(run, tmp_path / "elsewhere" / "dash.html").read_text(encoding="utf-8")
    assert "Did not finish" in page and "no stop event" in page
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page


def test_sections_without_data_say_no_data(tmp_path):
    run = tmp_path / "bare"
    log = EventLog(run, rank=0)
    for step in range(1, 11):
        log.log("metrics", step, loss=1.0 / step)  # nothing but the loss
    log.close()
    page = write_report(run).read_text(encoding="utf-8")
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page, title
    for title in ("Gradient norm", "Learning rate", "Loss scale", "Clip rate", "Loss by timestep",
                  "Input statistics per rank", "Events", "Incidents"):
        assert "no data" in _section(page, title), title
    assert "no data" not in _section(page, "Loss")


def test_incident_link_is_relative_to_where_the_report_is_written(tmp_path):
    run = make_run(tmp_path / "run", steps=70, torn_line=False)
    page = write_report(run, tmp_path / "reports" / "r.html").read_text(encoding="utf-8")
    assert 'href="../run/vidstab/incidents/step000060-rank1/"' in page


def test_long_series_are_binned_without_losing_a_spike():
    steps = np.arange(100_000, dtype=float)
    values = np.ones_like(steps)
    values[77_777] = 500.0
    x, mean, low, high = _bin(steps, values)
    assert len(x) <= 2000
    assert high.max() == 500.0 and low.min() == 1.0
