"""Every file of a run folder is bounded: the quarantine list (size, line length, depth, a FIFO in its place),
an incident bundle's sample-id lists (against its batch), a FIFO or a link to /dev/zero in a bundle, an event
log read back by the resume check. Each answer is one message naming the file, never a traceback or a hang;
what a file holds is printed without its terminal escapes. Real ``python -m vidstab`` processes and trainer."""

from __future__ import annotations

import json
import os

import pytest
from test_hostile_input import DEEP, a_bundle, cli, deep_json, no_traceback
from trainer_utils import run_trainer

from vidstab.evidence.capture import IncidentError, read_incident
from vidstab.recovery.quarantine import QuarantinedDataset, QuarantineError, QuarantineList
from vidstab.run.run_dir import RunDirError

GOOD = json.dumps({"sample_id": "clip-7", "reason": "non-finite latents", "step": 3, "bundle": None, "rank": 0,
                   "source": "capture", "time": 0.0}) + "\n"


def _quarantine_file(run, body: str | bytes):
    path = run / "vidstab" / "quarantine.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return path


def test_a_deeply_nested_quarantine_line_is_named_by_the_cli_and_stops_the_trainers_resume(tmp_path):
    run = tmp_path / "run"
    _quarantine_file(run, GOOD + '{"sample_id": ' + deep_json(DEEP) + "}\n")
    done, _ = cli("quarantine", str(run))
    no_traceback(done)
    assert done.returncode == 2 and "quarantine.jsonl line 2: JSON nested 200001 levels deep" in done.stderr
    assert "move" in done.stderr and "aside" in done.stderr  # what to do
    with pytest.raises(QuarantineError) as err:
        QuarantinedDataset(list(range(4)), run)  # where a loop builds its data: before any worker starts
    assert isinstance(err.value, RunDirError)  # what the reference trainer answers with one line, exit 2
    # The reference trainer resuming that run: one line naming the file, no traceback, nothing trained.
    done = run_trainer(run, "--resume_from_checkpoint", "latest", check=False, timeout=300)
    no_traceback(done)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "recipes/train.py: error: quarantine list" in done.stderr and "line 2: JSON nested" in done.stderr
    assert not (run / "vidstab" / "checkpoints").exists() or not list((run / "vidstab" / "checkpoints").glob("step_*"))
    # The report still renders, saying why it shows no list.
    from vidstab.tools.report.page import render_report

    section = render_report(run).split('<section id="quarantine">', 1)[1].split("</section>", 1)[0]
    assert "line 2: JSON nested 200001 levels deep" in section


def test_a_quarantine_list_beyond_its_caps_is_refused_unread_in_bounded_memory(tmp_path, monkeypatch):
    run = tmp_path / "run"
    path = _quarantine_file(run, "")
    with open(path, "w") as fh:  # ~130 MB of distinct entries, twice the 64 MiB default (read whole: GBs)
        for i in range(1_000_000):
            fh.write(GOOD.replace("clip-7", f"clip-{i:07d}"))
    done, rss = cli("quarantine", str(run))
    no_traceback(done)
    assert done.returncode == 2 and "more than the 67108864 allowed (VIDSTAB_MAX_QUARANTINE_BYTES)" in done.stderr
    assert 0 < rss < 1000, f"vidstab quarantine grew to {rss} MiB"  # this process's own peak (VmHWM)
    # Under a lower cap a small list is refused alike; under its cap it is read line by line.
    path.write_text(GOOD * 100)
    monkeypatch.setenv("VIDSTAB_MAX_QUARANTINE_BYTES", "1000")
    with pytest.raises(QuarantineError, match="more than the 1000 allowed"):
        QuarantinedDataset(list(range(4)), run)
    monkeypatch.delenv("VIDSTAB_MAX_QUARANTINE_BYTES")
    assert QuarantineList(run).ids() == {"clip-7"}
    # A line longer than the line cap; a FIFO in the file's place (refused from stat: never opened).
    path.write_text(GOOD + json.dumps({"sample_id": "x", "reason": "y" * 2_000_000}) + "\n")
    with pytest.raises(QuarantineError, match="line 2: longer than 1048576 bytes \\(VIDSTAB_MAX_EVENT_LINE_BYTES\\)"):
        QuarantineList(run).ids()
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(QuarantineError, match="is a FIFO \\(named pipe\\), not a regular file; refused unread"):
        QuarantineList(run).ids()


def test_quarantine_listing_prints_no_terminal_escape_and_a_torn_line_is_not_glued_to_the_next(tmp_path):
    run = tmp_path / "run"
    evil = {"sample_id": "s1\x1b]0;pwned\x07\x1b[2J", "reason": "r\x1b[31m\u202e\nFAKE LINE", "step": 1}
    _quarantine_file(run, json.dumps(evil) + "\n" + GOOD[:40])  # the last line cut by a kill
    QuarantineList(run).add(["clip-9"], "named by a user")
    assert QuarantineList(run).ids() == {evil["sample_id"], "clip-9"}
    done, _ = cli("quarantine", str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    for stream in (done.stdout, done.stderr.split("MAXRSS")[0]):
        assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream and "\nFAKE" not in stream
    assert "s1\\x1b]0;pwned\\x07" in done.stdout and "clip-9" in done.stdout
    assert "line 2: not JSON (cut by a kill?); skipped" in done.stderr


def test_a_bundle_with_more_sample_ids_than_its_batch_is_refused_and_quarantines_nothing(tmp_path):
    run = tmp_path / "run"
    bundle = a_bundle(run)  # a batch of 2
    (run / "vidstab" / "checkpoints").mkdir(parents=True)  # a run folder: replay quarantines culprits there
    meta = json.loads((bundle / "incident.json").read_text())
    ids = [f"clip-{i}" for i in range(1_000_000)]
    (bundle / "incident.json").write_text(json.dumps({**meta, "sample_ids": ids, "bad_sample_ids": ids[:2]}))
    done, _ = cli("replay", str(bundle))
    no_traceback(done)
    assert done.returncode == 2 and "1000000 sample_ids for a batch of 2 sample(s)" in done.stderr, done.stderr
    assert not (run / "vidstab" / "quarantine.jsonl").exists()
    # A bad sample that is not one of the bundle's, or an id that is not a short string, is refused alike.
    for change, said in (({"bad_sample_ids": ["elsewhere"]}, "'elsewhere' is not one of the bundle's sample_ids"),
                         ({"sample_ids": ["a", {"b": 1}]}, "sample_ids[1] is not a sample id")):
        (bundle / "incident.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(IncidentError) as err:
            read_incident(bundle)
        assert said in str(err.value)


def test_a_fifo_or_a_link_to_dev_zero_in_a_bundle_is_named_without_blocking(tmp_path):
    bundle = a_bundle(tmp_path / "run")
    (bundle / "batch.safetensors").unlink()
    (bundle / "batch.safetensors").symlink_to("/dev/zero")
    done, _ = cli("replay", str(bundle))
    no_traceback(done)
    assert done.returncode == 2 and "batch.safetensors is a character device (a link to /dev/zero)" in done.stderr
    (bundle / "incident.json").unlink()
    os.mkfifo(bundle / "incident.json")
    with pytest.raises(IncidentError, match="incident.json is a FIFO \\(named pipe\\)"):
        read_incident(bundle)  # a reader that opened it would wait here for a writer, for ever
    done, _ = cli("incidents", str(tmp_path / "run"))  # listed, as what it is
    no_traceback(done)
    assert done.returncode == 0 and "unreadable incident.json" in done.stdout and "a FIFO (named pipe)" in done.stdout


def test_the_resume_check_reads_an_event_log_with_a_deep_line(tmp_path):
    from vidstab.events import EventLog
    from vidstab.run.resume_check import ResumeCheck

    log = EventLog(tmp_path, rank=0)
    for step in range(4):
        log.log("metrics", step, loss=1.0, lr=1e-3, grad_norm=1.0)
    log.flush()
    with open(log.path, "a") as fh:
        fh.write('{"kind": "metrics", "step": 1, "x": ' + deep_json(DEEP) + "}\n")
    check = ResumeCheck(tmp_path, rank=0, world_size=1, steps=2)
    check.begin(1)
    for step in (1, 2):
        log.log("metrics", step, loss=1.0, lr=1e-3, grad_norm=1.0)
    assert check.after_step(3) == []  # compared, quiet: the deep line was skipped, not a RecursionError
    log.close()
