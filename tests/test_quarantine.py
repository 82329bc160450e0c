"""Quarantine: a sample named bad is kept out of later epochs and of a resumed run, on 2
processes, through the data set wrapper a user's loop (and the reference trainer) uses; the CLI lists and
clears the list."""

from __future__ import annotations

import json

from test_guard_distributed import launch

from vidstab.recovery.quarantine import QuarantineList
from vidstab.tools.cli import main as cli

BAD = "13"


def _seen(out, phase):
    by_epoch: dict[int, list[int]] = {}
    for rank in (0, 1):
        for epoch, ids in json.loads((out / f"seen-rank{rank}-{phase}.json").read_text()).items():
            by_epoch.setdefault(int(epoch), []).extend(ids)
    return by_epoch


def test_a_bad_sample_seen_in_epoch_1_is_not_seen_in_epoch_2_nor_after_a_resume(tmp_path, capsys):
    launch("quarantine_ddp.py", "--out", str(tmp_path), "--phase", "first", timeout=240)
    seen = _seen(tmp_path, "first")
    assert seen[0].count(13) == 1  # epoch 1: trained on once, skipped, captured, quarantined
    assert all(13 not in seen[e] for e in (1, 2))  # later epochs: never again
    assert all(len(seen[e]) == 32 for e in seen)  # every rank kept its share of batches (its slot refilled)
    entries = QuarantineList(tmp_path).entries()
    assert [e["sample_id"] for e in entries] == [BAD]
    assert "non-finite" in entries[0]["reason"] and entries[0]["bundle"].startswith("vidstab/incidents/step")
    assert (tmp_path / entries[0]["bundle"] / "incident.json").is_file()
    events = [json.loads(x) for r in (0, 1) for x in (tmp_path / "vidstab" / f"events-rank{r}.jsonl").read_text().splitlines()]
    assert [e["sample_ids"] for e in events if e["kind"] == "quarantine"] == [[BAD]]

    launch("quarantine_ddp.py", "--out", str(tmp_path), "--phase", "resume", timeout=240)
    resumed = _seen(tmp_path, "resume")
    assert sorted(resumed) == [3, 4, 5] and all(13 not in ids for ids in resumed.values())

    # The report shows it; the CLI lists it and releases it.
    from vidstab.tools.report.page import render_report

    page = render_report(tmp_path)
    section = page.split('<section id="quarantine">', 1)[1].split("</section>", 1)[0]
    assert f"<td>{BAD}</td>" in section and "non-finite" in section
    assert cli(["quarantine", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert BAD in out and "non-finite" in out
    assert cli(["quarantine", str(tmp_path), "--clear"]) == 0
    assert QuarantineList(tmp_path).ids() == set()
