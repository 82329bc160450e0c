"""Issue to evidence, end to end: the trainer captures an incident, replay reproduces and localises it,
and the dashboard shows it. Real processes and files throughout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer_utils import REPO, run_trainer


def _replay(bundle):
    proc = subprocess.run([sys.executable, "scripts/replay.py", str(bundle)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((bundle / "replay_report.json").read_text())


@pytest.mark.slow
def test_nan_batch_on_rank1_replays_and_names_the_samples(nan_batch_rank1_run):
    out = nan_batch_rank1_run  # 2 processes, nan_batch@4:1, checkpoints every 3 of 9 steps, a kill and restart at 8
    (bundle,) = (out / "vidstab" / "incidents").glob("step000004-rank1*")
    meta = json.loads((bundle / "incident.json").read_text())
    proc, report = _replay(bundle)
    assert report["reproduced"] is True
    assert report["data"]["implicated"] is True
    # every sample of the poisoned micro-batch is NaN: the data step names all of them
    assert set(meta["bad_sample_ids"]) == set(meta["sample_ids"])
    assert "data" in report["verdict"].lower()
    html = (out / "report.html").read_text()
    assert bundle.name in html and meta["sample_ids"][0] in html


def test_nonfinite_module_output_is_localised_to_that_module(tmp_path):
    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "6", "--checkpointing_steps", "3", "--inject_fault", "inf_module@4=blocks.1.mlp")
    (bundle,) = (out / "vidstab" / "incidents").glob("step000004-rank0*")
    meta = json.loads((bundle / "incident.json").read_text())
    # the guard localised it when it happened (the first non-finite step of the run) ...
    assert meta["localization"]["forward"]["module"].startswith("blocks.1.mlp")
    # ... and the replay rebuilds the faulty model from the bundle, reproduces and localises it too
    proc, report = _replay(bundle)
    assert report["reproduced"] is True
    assert report["structure"]["implicated"] is True and report["data"]["implicated"] is False
    assert "blocks.1.mlp" in json.dumps(report["localization"]["forward"])


def test_report_of_a_real_run_has_every_section(tmp_path):
    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "30", "--checkpointing_steps", "10", "--inject_fault", "nan_batch@12",
                "--inject_fault", "lr_spike@20=1e4", html_report=True)
    from vidstab.tools.report import SECTIONS

    html = (out / "report.html").read_text()
    for section in SECTIONS:
        assert section in html, f"missing section {section!r}"
    assert "data:image/png;base64" in html and "step000012-rank0" in html
