"""The dashboard renders from real per-rank event logs and incident bundles, with every section present."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import torch

from vidstab.evidence.capture import write_incident
from vidstab.events import EventLog
from vidstab.files.strict_json import json_float
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


def test_run_without_stop_event_is_said_so_neutrally(tmp_path):
    # Killed, or a user loop that never logs a stop: the log cannot tell which, so neither is claimed.
    run = make_run(tmp_path / "run", steps=40, finish=False)
    page = write_report(run, tmp_path / "elsewhere" / "dash.html").read_text(encoding="utf-8")
    assert "Did not finish" not in page and "No stop event; last step 40" in page
    for title in SECTIONS:
        assert f"<h2>{title}</h2>" in page


def test_sections_without_data_say_no_data(tmp_path):
    run = tmp_path / "bare"
    log = EventLog(run, rank=0)
    for step in range(1, 11):
        log.log("metrics", step, loss=1.0 / step)  # nothing but the loss
    log.close()
    page = write_report(run).read_text(encoding="utf-8")
    for title in SECTIONS:  # all but the per-sample loss panel, left out without per-sample losses
        assert (f"<h2>{title}</h2>" in page) == (title != "Loss by timestep"), title
    for title in ("Gradient norm", "Learning rate", "Loss scale", "Clip rate",
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


def _user_loop(run_dir: Path, steps: int = 8, accum: int = 2, nan_micro: int = 5, close: bool = True,
               per_sample: bool = False) -> Path:
    """A user's own Accelerate loop as README shows it: gradient accumulation, no per-sample loss, one NaN
    micro-batch (its step's logged loss is the mean of the finite micro-batch losses), guard.close() at the end."""
    import vidstab
    from accelerate import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(gradient_accumulation_steps=accum, cpu=True)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = vidstab.attach(acc, model, opt, sched, run_dir=run_dir)
    g = torch.Generator().manual_seed(1)
    for i in range(steps * accum):
        x = torch.randn(4, 8, generator=g)
        if i == nan_micro:
            x[0, 0] = float("nan")
        with acc.accumulate(model):
            losses = (model(x) - x).pow(2).mean(1)
            extra = {"per_sample_loss": losses, "timesteps": torch.randint(0, 1000, (4,), generator=g)} if per_sample else {}
            guard.backward(losses.mean(), batch={"x": x}, sample_ids=[f"s{i}-{j}" for j in range(4)], **extra)
            guard.step(max_grad_norm=1.0)
    if close:
        guard.close()
    return run_dir


def test_user_loop_report_reads_its_own_events(tmp_path):
    run = _user_loop(tmp_path / "run")
    page = write_report(run).read_text(encoding="utf-8")
    summary = _section(page, "Summary")
    # guard.close() logged `stop`: the run finished (with the NaN micro-batch's step handled).
    assert "Did not finish" not in summary and "Finished with trouble handled: guard closed" in summary
    # The NaN micro-batch's step counts although its logged loss (mean of the finite micro-batches) is finite.
    assert "non-finite losses</th><td>1 (steps 2)" in summary
    # No per-sample loss was given: no empty "Loss by timestep" panel.
    assert "<h2>Loss by timestep</h2>" not in page and 'href="#loss-by-timestep"' not in page

    # Without guard.close() nothing says how the loop ended: neutral, not a red "did not finish".
    bare = write_report(_user_loop(tmp_path / "unclosed", close=False)).read_text(encoding="utf-8")
    summary = _section(bare, "Summary")
    assert 'class="verdict neutral"' in summary and "No stop event; last step 7" in summary

    # With per-sample losses (README: guard.backward(..., per_sample_loss=, timesteps=)) the panel is drawn.
    page = write_report(_user_loop(tmp_path / "per_sample", per_sample=True)).read_text(encoding="utf-8")
    assert "no data" not in _section(page, "Loss by timestep")


def test_skips_after_a_rollback_count_in_total_and_resumes_are_shown(tmp_path):
    logs = [EventLog(tmp_path, rank=r) for r in range(2)]
    for attempt_steps in (range(1, 7), range(4, 9)):  # steps 4..6 run twice: a rollback to step 3
        for step in attempt_steps:
            for log in logs:
                log.log("metrics", step, loss=1.0, grad_norm=1.0, applied=step != 5)
            if step == 5:
                for log in logs:
                    log.log("skip", 5, detector="grad_spike", message="norm 20x EMA", figures={}, bad_ranks=[])
        if attempt_steps.start == 1:
            for log in logs:
                log.log("resume", 6, checkpoint="checkpoints/step_000003")
    for log in logs:
        log.close()
    summary = _section(write_report(tmp_path).read_text(encoding="utf-8"), "Summary")
    assert "skipped steps</th><td>2 (steps 5); 1 of them a step skipped again" in summary
    assert "resumes</th><td>1 (at steps 6)" in summary


def _strict(text: str):
    """json.loads that refuses NaN/Infinity tokens: what any standard JSON reader accepts."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_nan_loss_is_strict_json_in_every_file_and_the_report_reads_it_and_old_null_logs(tmp_path):
    """vidstab.files.strict_json's one convention: a NaN loss is logged as "nan" (not a NaN token, not null), the
    report shows it as non-finite, and an event log from before the convention (null) still reads the same."""
    run = _user_loop(tmp_path / "run", accum=1, nan_micro=3)  # no accumulation: step 3's logged loss is NaN
    files = sorted(p for p in run.rglob("*") if p.suffix in (".json", ".jsonl"))
    assert any(p.name == "incident.json" for p in files)
    for path in files:  # every JSON file of the run folder: events, incident bundle
        for line in (path.read_text(encoding="utf-8").splitlines() if path.suffix == ".jsonl" else [path.read_text()]):
            _strict(line)
    log_path = run / "vidstab" / "events-rank0.jsonl"
    records = [_strict(line) for line in log_path.read_text().splitlines()]
    step3 = next(r for r in records if r["kind"] == "metrics" and r["step"] == 3)
    assert step3["loss"] == "nan" and step3["loss_rank"] == "nan"
    assert json_float(step3["loss"]) != json_float(step3["loss"])  # reads back as NaN

    def report(run_dir: Path) -> tuple:
        m = load_run(run_dir).metrics[0]
        page = write_report(run_dir).read_text(encoding="utf-8")
        rank_row = re.search(r"<tr[^>]*><td>0</td>(.*?)</tr>", _section(page, "Input statistics per rank")).group(1)
        return (m.steps[m.nonfinite["loss"]].tolist(), m.steps[m.nonfinite["loss_rank"]].tolist(),
                bool(np.isnan(m.columns["loss"][m.steps == 3]).all()), rank_row.split("</td><td>")[3],
                "non-finite losses</th><td>1 (steps 3)" in _section(page, "Summary"))

    assert report(run) == ([3], [3], True, "1", True)

    # The same run as the writer before the convention logged it: every non-finite number as null.
    def old_style(v):
        if isinstance(v, dict):
            return {k: old_style(x) for k, x in v.items()}
        if isinstance(v, list):
            return [old_style(x) for x in v]
        return None if isinstance(v, str) and v in ("nan", "inf", "-inf") else v

    old = tmp_path / "old"
    (old / "vidstab").mkdir(parents=True)
    (old / "vidstab" / "events-rank0.jsonl").write_text(
        "".join(json.dumps(old_style(r), allow_nan=False) + "\n" for r in records))
    assert '"loss":null' in (old / "vidstab" / "events-rank0.jsonl").read_text().replace(" ", "")
    assert report(old) == ([3], [3], True, "1", True)
