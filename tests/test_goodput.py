"""The goodput ledger on a real drill: 2 processes under the elastic launcher, NaN skips, a rollback, a hung rank
the watchdog ends and the restart after it. The ledger must agree, bucket by bucket, with the time the test
reads off the raw event lines itself (labelled from the drill's known schedule, not from the ledger's rules),
and the buckets must sum to the wall time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_resilience import launch
from trainer_utils import shared_run

pytestmark = pytest.mark.slow

# Steps 0-11; checkpoints every 3; NaN data at step 2 (skipped), an exception at step 5 (skipped, then rolled back
# to step 3), rank 1 hangs before step 8 (the watchdog ends it; the restart resumes from step 6).
DRILL = ["--max_train_steps", "12", "--checkpointing_steps", "3", "--watchdog_timeout", "3", "--goodput_steps", "4",
         "--report_to", "tensorboard", "--inject_fault", "nan_batch@2", "--inject_fault", "exception@5",
         "--inject_fault", "hang@8:1"]
# What each metrics line of the drill is, in rank 0's file order.
ATTEMPT0 = [(0, "productive"), (1, "productive"), (2, "skipped"), (3, "rework"), (4, "rework"), (5, "skipped"),
            (3, "productive"), (4, "productive"), (5, "productive"), (6, "rework"), (7, "rework")]
ATTEMPT1 = [(s, "productive") for s in range(6, 12)]


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    def build(folder):
        proc = launch(folder / "run", *DRILL, resume=False, html_report=True, timeout=600)
        (folder / "stderr.txt").write_text(proc.stderr)

    folder = shared_run(tmp_path_factory, "goodput-drill", build)
    return folder / "run", (folder / "stderr.txt").read_text()


def raw_lines(run, rank):
    out = []
    for line in (run / "vidstab" / f"events-rank{rank}.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def launcher_saw_the_failure(launcher_log: str, exitcode: int) -> str:
    """The launcher's one line naming the failed group: the failed rank's ``exitcode``, or 1 from a peer that the
    lost connection ended first (which of the two the agent's poll sees first is a race)."""
    (noticed,) = [x for x in launcher_log.splitlines() if "failed (exitcode: " in x]
    assert f"exitcode: {exitcode})" in noticed or "exitcode: 1)" in noticed, noticed
    return noticed


def assert_the_launcher_restarted_in_the_downtime(run, launcher_log: str, exitcode: int) -> None:
    """The launcher's log names one failure (:func:`launcher_saw_the_failure`), and the time on its line (its own
    clock) lies in the downtime the ledger counts: after the failed rank's last line, before the restarted attempt's
    processes began."""
    import datetime
    import re

    noticed = launcher_saw_the_failure(launcher_log, exitcode)
    when = re.search(r"[EWI](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ", noticed)
    assert when, noticed
    r1 = raw_lines(run, 1)  # rank 1 failed in both drills
    again = [e for e in r1 if e["kind"] == "start"][1]
    last_words = max(e["time"] for e in r1 if e["time"] < again["time"])
    seen = datetime.datetime(datetime.datetime.fromtimestamp(last_words).year, *map(int, when.groups())).timestamp()
    began = min(again["process_started"], [e for e in raw_lines(run, 0) if e["kind"] == "start"][1]["process_started"])
    assert last_words <= seen <= began, (noticed, last_words, began)


def expected_buckets(run, schedules=(ATTEMPT0, ATTEMPT1)):
    """The buckets from the raw lines: each interval between two timed marks goes to what the drill did then
    (``schedules``: what each metrics line of each of the two attempts is; the kill drill of
    tests/test_resilience.py passes its own)."""
    r0, r1 = raw_lines(run, 0), raw_lines(run, 1)
    starts = [e for e in r0 if e["kind"] == "start"]
    assert len(starts) == 2
    born = [e["process_started"] for e in starts]
    second = starts[1]["time"]
    label = {"start": "startup", "resume": "startup", "restart": "startup", "skip": "triage",
             "rollback_request": "triage", "incident": "triage", "rerun": "triage", "rollback": "rollback",
             "hang": "hang", "crash": "restart", "validation": "validation", "stop": "other", "export": "other",
             "goodput": "other"}
    totals = dict.fromkeys(["productive", "skipped", "rework", "triage", "checkpoint", "rollback", "restart", "hang",
                            "startup", "data", "validation", "other"], 0.0)
    ends = []
    for attempt, schedule in enumerate(schedules):
        mine = [e for e in r0 if (e["time"] < second) == (attempt == 0)]
        last_words = [e for e in r1 if e["kind"] in ("hang", "crash") and (e["time"] < second) == (attempt == 0)]
        marks = sorted([e for e in mine if e["kind"] in label or e["kind"] == "metrics"] + last_words,
                       key=lambda e: e["time"])
        if attempt:  # it begins when its process started, but not before the previous attempt's last event
            born[1] = max(born[1], ends[0])
        steps = [e for e in marks if e["kind"] == "metrics"]
        assert [e["step"] for e in steps] == [s for s, _ in schedule], f"attempt {attempt}: not the drill's steps"
        what = iter(b for _, b in schedule)
        times = np.array([born[attempt]] + [e["time"] for e in marks])
        lengths = np.diff(times)
        names = [next(what) if e["kind"] == "metrics" else label[e["kind"]] for e in marks]
        share = [{n: float(d)} for n, d in zip(names, lengths)]
        for s, e, n in zip(share, marks, names):
            data = min(float(e.get("data_seconds") or 0.0), s[n]) if e["kind"] == "metrics" else 0.0
            s[n] -= data
            s["data"] = s.get("data", 0.0) + data
        for c in (e for e in mine if e["kind"] == "checkpoint"):  # blocking, out of the interval it ended in
            i = int(np.searchsorted(times, c["blocking_ended"], side="left")) - 1
            assert 0 <= i < len(share) and share[i][names[i]] >= c["blocking_seconds"]
            share[i][names[i]] -= c["blocking_seconds"]
            share[i]["checkpoint"] = share[i].get("checkpoint", 0.0) + c["blocking_seconds"]
        tail_end = max(e["time"] for e in mine + last_words)
        share.append({"other": tail_end - times[-1]})
        for s in share:
            for n, v in s.items():
                totals[n] += v
        ends.append(tail_end)
    totals["restart"] += born[1] - ends[0]
    return totals, ends[1] - born[0]


def test_the_ledger_matches_the_event_log_bucket_by_bucket_and_sums_to_the_wall_time(drill):
    from vidstab.run.goodput import ledger

    run, stderr = drill
    # the launcher restarted the group after the watchdog ended the hung rank
    assert_the_launcher_restarted_in_the_downtime(run, stderr, 75)
    led = ledger(run)
    want, wall = expected_buckets(run)
    assert led["wall_seconds"] == pytest.approx(wall, abs=1e-6)
    for bucket, seconds in want.items():
        assert led["buckets"][bucket] == pytest.approx(seconds, abs=1e-6), bucket
    assert abs(sum(led["buckets"].values()) - led["wall_seconds"]) <= 0.01 * led["wall_seconds"]
    # Every kind of loss the drill caused is there, and the launcher's restart.
    for bucket in ("productive", "skipped", "rework", "triage", "checkpoint", "rollback", "hang", "startup", "data",
                   "validation"):
        assert led["buckets"][bucket] > 0, bucket
    assert led["restarts"] == 1 and len(led["attempts"]) == 2
    assert led["steps"] == {"productive": 11, "skipped": 2, "rework": 4}  # step 2 is never redone
    for a in led["attempts"]:
        assert a["ettr"] == pytest.approx(a["buckets"]["productive"] / a["wall_seconds"])
        assert sum(a["buckets"].values()) == pytest.approx(a["wall_seconds"], rel=1e-9)
    assert led["ettr"] == pytest.approx(led["buckets"]["productive"] / led["wall_seconds"])


def test_goodput_events_trackers_cli_and_report_show_the_ledger(drill, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vidstab.tools.cli import main

    run, _ = drill
    events = [e for e in raw_lines(run, 0) if e["kind"] == "goodput"]
    # Every 4 steps (the steps of both attempts) and at exit; each one adds up to its own wall time.
    assert [e["step"] for e in events] == [4, 4, 8, 8, 12, 12]
    for e in events:
        assert abs(sum(e["seconds"].values()) - e["wall_seconds"]) <= 0.01 * e["wall_seconds"]
        # the event's seconds are rounded to the millisecond: their ratio is as exact as that allows
        rounding = 5e-4 * (1 + e["ettr"]) / e["wall_seconds"] + 1e-5
        assert e["ettr"] == pytest.approx(e["seconds"]["productive"] / e["wall_seconds"], abs=rounding)
    assert events[-1]["attempts"] == 2 and events[-1]["restarts"] == 1
    assert not [e for e in raw_lines(run, 1) if e["kind"] == "goodput"]  # the main process writes it

    tb = EventAccumulator(str(next(run.rglob("events.out.tfevents*")).parent))
    tb.Reload()
    assert [x.step for x in tb.Scalars("vidstab/ettr")] == [4, 4, 8, 8, 12, 12]

    assert main(["goodput", str(run), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["buckets"].keys() == events[-1]["seconds"].keys() and as_json["restarts"] == 1
    assert as_json["interval"]["failures"] == 2
    assert main(["goodput", str(run)]) == 0
    table = capsys.readouterr().out
    assert "ETTR" in table and "attempt 1" in table and f"{as_json['wall_seconds']:.2f}" in table
    assert "checkpoint interval these measurements call for (Young/Daly): every" in table
    assert main(["goodput", str(run), "--expected-mtbf-hours", "0"]) == 2  # one line, no traceback
    assert "--expected-mtbf-hours 0.0: must be > 0" in capsys.readouterr().err

    page = (run / "report.html").read_text()
    section = page.split("<h2>Goodput</h2>", 1)[1].split("</section>", 1)[0]
    assert "ETTR (productive / wall time)" in section and "attempt 0: hang" in section


def test_the_in_run_ledger_reads_only_new_lines_and_agrees_with_the_ledger_of_the_files(drill, tmp_path):
    """The trainer's goodput events come from an incremental ledger: replayed into a fresh folder a piece of a
    line at a time, from the restarted attempt's start on (as a restarted process sees it), it must end equal
    to the ledger of the finished files."""
    from vidstab.run.goodput import GoodputLog, ledger

    run, _ = drill
    lines = (run / "vidstab" / "events-rank0.jsonl").read_bytes().splitlines(keepends=True)
    second = [i for i, line in enumerate(lines) if json.loads(line)["kind"] == "start"][1]
    copy = tmp_path / "run" / "vidstab"
    copy.mkdir(parents=True)
    (copy / "events-rank1.jsonl").write_bytes((run / "vidstab" / "events-rank1.jsonl").read_bytes())
    (copy / "events-rank0.jsonl").write_bytes(b"".join(lines[:second + 1]))
    live = GoodputLog(None, tmp_path / "run")
    live.ledger()
    with open(copy / "events-rank0.jsonl", "ab") as f:
        for line in lines[second + 1:]:
            f.write(line[:7])  # a torn line waits for its end
            f.flush()
            live.ledger()
            f.write(line[7:])
            f.flush()
    assert json.dumps(live.ledger()) == json.dumps(ledger(tmp_path / "run")) == json.dumps(ledger(run))


def test_the_interval_formula_is_the_minimum_of_the_time_lost_to_saves_and_failures():
    """C + sqrt(2 (M + R) C + C^2) against a grid search of the fraction of time lost, C/t + (t/2 + R)/M
    (a save every t seconds, half an interval of work lost per failure), for saves much shorter than the MTBF."""
    from vidstab.run.checkpoint_interval import optimal_interval_seconds

    for save, mtbf, restart in ((10.0, 3600.0 * 24, 0.0), (2.0, 3600.0, 60.0), (30.0, 3600.0 * 8, 600.0)):
        grid = np.linspace(save, 20 * np.sqrt(2 * save * mtbf), 200_000)
        lost = save / grid + (grid / 2 + restart) / mtbf
        best = grid[int(np.argmin(lost))]
        assert optimal_interval_seconds(save, mtbf, restart) == pytest.approx(best, rel=0.06)
    with pytest.raises(ValueError):
        optimal_interval_seconds(1.0, 0.0)


def test_the_interval_advice_comes_from_the_drills_measurements(drill):
    from vidstab.run.checkpoint_interval import optimal_interval_seconds, recommend
    from vidstab.run.goodput import ledger

    run, _ = drill
    led = ledger(run)
    advice = recommend(led, expected_mtbf_hours=24)
    saves = [e for e in raw_lines(run, 0) if e["kind"] == "checkpoint"]
    assert advice["failures"] == 2  # the rollback and the restart
    assert advice["save_seconds"] == pytest.approx(sum(e["blocking_seconds"] for e in saves) / len(saves))
    assert led["buckets"]["checkpoint"] == pytest.approx(sum(e["blocking_seconds"] for e in saves))
    # Failures seen: the prior is gone; the next failure counts as already due (no one-sample optimism).
    assert advice["mtbf_seconds"] == pytest.approx(led["wall_seconds"] / 3) and advice["mtbf_from"] == "failures"
    assert advice["interval_seconds"] == pytest.approx(
        optimal_interval_seconds(advice["save_seconds"], advice["mtbf_seconds"], advice["restart_seconds"]))
    assert advice["interval_steps"] == max(1, round(advice["interval_seconds"] / advice["step_seconds"]))
    last = [e for e in raw_lines(run, 0) if e["kind"] == "goodput"][-1]
    assert last["interval"]["failures"] == 2 and last["interval"]["interval_steps"] >= 1


def test_checkpointing_steps_auto_saves_at_the_interval_the_measurements_call_for(tmp_path):
    """One process, 20 steps: the first save after 10 steps measures the stall; the interval is then re-chosen
    from the ledger (logged with its inputs) and the next save comes at the end, not 10 steps later."""
    from trainer_utils import run_trainer

    from vidstab.run.checkpoint_interval import optimal_interval_seconds

    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "20", "--checkpointing_steps", "auto", "--num_validation_videos", "0")
    lines = raw_lines(out, 0)
    assert [e["step"] for e in lines if e["kind"] == "checkpoint"] == [10, 20]
    changes = [e for e in lines if e["kind"] == "checkpoint_interval"]
    assert [(e["step"], e["previous"]) for e in changes][:1] == [(10, 10)], changes
    first = changes[0]
    assert first["interval_seconds"] == pytest.approx(
        optimal_interval_seconds(first["save_seconds"], first["mtbf_seconds"], first["restart_seconds"]))
    # The floor: the detectors' lead time (the guard's health_window), a rollback target must be older than it.
    assert first["lead_steps"] == 50 and first["lead_from"] == "health_window" and first["floor_configured"] == 10
    assert first["floor"] == 50
    assert first["steps"] == min(max(round(first["interval_seconds"] / first["step_seconds"]), 50), 10_000) > 10
    assert first["failures"] == 0 and first["expected_mtbf_hours"] == 24.0
    # No failure yet: the interval bets on no more than the run has survived (seconds here, not the 24 h prior).
    assert first["mtbf_from"] == "survived" and first["mtbf_seconds"] == pytest.approx(first["wall_seconds"])


def test_rollback_every_auto_in_an_unmodified_loop_chooses_its_interval_from_the_ledger(tmp_path):
    """attach(..., rollback_every="auto"): rollback checkpoints on the first step and 10 steps of the trajectory
    later (the first one's asynchronous write, and so its stall, is known by then); the interval is then re-chosen
    from the ledger (logged) and no third checkpoint comes 10 steps after the second. An LR bug at steps 4-8 rolls
    back in place to step 1 (8 steps undone): the second save and the interval's change are at the loop's step 19,
    the trajectory's 11 beside it."""
    import vidstab
    from test_auto_rollback import _loop

    _loop(tmp_path, bad_lr_steps=set(range(4, 9)), steps=30, rollback_every="auto",
          config=vidstab.GuardConfig(health_window=12))[4].close()
    lines = raw_lines(tmp_path, 0)
    assert [(e["step"], e["to_step"]) for e in lines if e["kind"] == "rollback"] == [(9, 1)]
    assert [(e["step"], e.get("trajectory_step")) for e in lines if e["kind"] == "checkpoint"] == [(1, None), (19, 11)]
    (change,) = [e for e in lines if e["kind"] == "checkpoint_interval"]
    assert (change["step"], change["trajectory_step"]) == (19, 11)
    assert change["previous"] == 10 and change["save_seconds"] > 0  # no third save at trajectory 21 (step 29): >= 12
    assert change["floor"] == change["lead_steps"] == 12 and change["steps"] >= 12  # GuardConfig(health_window=12)
    with pytest.raises(ValueError, match="rollback_every must be"):
        _loop(tmp_path / "bad", bad_lr_steps=set(), steps=1, rollback_every="often")


def test_before_a_failure_no_interval_bets_more_than_the_run_has_survived():
    """The real controller on the real ledger (bench_goodput's simulation), a 24 h prior and a first failure
    after 60 s: the work it throws away is at most the interval that 60 s of survival calls for, not the one
    24 h would; with no failure in sight the prior caps the bet; after failures, T / (n + 1)."""
    from benchmarks.bench_goodput import simulate

    from vidstab.run.checkpoint_interval import optimal_interval_seconds, recommend
    from vidstab.run.goodput import LedgerBuilder

    step_s, save_s = 0.09, 0.07
    run = simulate(2000, step_s, save_s, 22.0, [60.0], None, prior_hours=24.0)
    assert run["failures"] == 1
    assert 0 < run["rework_steps"] <= optimal_interval_seconds(save_s, 60.0) / step_s  # about 32 steps, not ~1,200
    prior = simulate(2000, step_s, save_s, 22.0, [60.0], None, prior_hours=60.0 / 3600)
    assert run["rework_steps"] <= prior["rework_steps"] + 10 and run["ettr"] == pytest.approx(prior["ettr"], abs=0.01)

    book = LedgerBuilder()
    book.feed({"kind": "start", "time": 0.0, "step": 0, "process_started": 0.0})
    for step in range(100):
        book.feed({"kind": "metrics", "time": 1.0 + step, "step": step, "applied": True})
    book.feed({"kind": "checkpoint", "time": 100.5, "step": 100, "blocking_seconds": 0.5, "blocking_ended": 100.5})
    survived = recommend(book.result(), expected_mtbf_hours=24.0)
    assert (survived["mtbf_from"], survived["mtbf_seconds"]) == ("survived", pytest.approx(100.5))
    capped = recommend(book.result(), expected_mtbf_hours=0.01)  # 36 s: the run has gone longer than its prior
    assert (capped["mtbf_from"], capped["mtbf_seconds"]) == ("prior", pytest.approx(36.0))
    assert capped["interval_steps"] < survived["interval_steps"]
    book.feed({"kind": "crash", "time": 101.0, "step": 100})
    book.feed({"kind": "start", "time": 111.0, "step": 100, "process_started": 105.0})
    book.feed({"kind": "restart", "time": 111.0, "step": 100})
    failed = recommend(book.result(), expected_mtbf_hours=24.0)
    assert (failed["failures"], failed["mtbf_from"]) == (1, "failures")
    assert failed["mtbf_seconds"] == pytest.approx(book.result()["wall_seconds"] / 2)


def test_bench_goodput_quick_the_ledger_of_a_simulated_run_agrees_with_the_simulation(capsys):
    """benchmarks/bench_goodput.py --quick: for every interval, the ETTR the real ledger reads off the simulated
    events equals the simulation's own (steps x step time / wall time); the last line is one JSON object."""
    from benchmarks.bench_goodput import main

    assert main(["--quick", "--mtbf-hours", "0.02"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["rows"]) == {"5", "20", "100", "500", "auto"}
    assert sum(r["failures"] for r in out["rows"].values()) > 0
    for row in out["rows"].values():
        assert row["ledger_ettr"] == pytest.approx(row["ettr"], rel=1e-9)
