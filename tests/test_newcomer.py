"""A newcomer's first hour, replayed with the real trainer: the same command twice, and resuming a run that
already finished. Each answer is one clear message, nothing is redone, and the report counts what happened."""

from __future__ import annotations

import re
import subprocess
import sys

from trainer_utils import REPO, TRAIN, events, fast_flags, run_trainer

RUN = ["--max_train_steps", "3", "--checkpointing_steps", "3"]


def test_the_same_command_twice_ends_in_one_clear_line_and_a_finished_run_says_so(tmp_path):
    out = tmp_path / "run"
    first = run_trainer(out, *RUN, html_report=True)
    assert "took over the lock" not in first.stdout + first.stderr

    # 1. The same command again: one line naming the folder and the two ways on, exit 2, no traceback.
    again = run_trainer(out, *RUN, check=False)
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [line for line in again.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("recipes/train.py: error: output_dir"), again.stderr[-3000:]
    assert "--resume_from_checkpoint latest" in errors[0] and "--overwrite_output_dir" in errors[0]
    assert "Traceback" not in again.stderr and "RuntimeError" not in again.stderr
    # ... and through the README's launcher with -q (plain `accelerate launch` adds its own CalledProcessError).
    launched = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "1",
                               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(TRAIN),
                               "--output_dir", str(out), *fast_flags(), *RUN], capture_output=True, text=True,
                              timeout=300, cwd=REPO)
    assert launched.returncode != 0 and "Traceback" not in launched.stderr, launched.stderr[-3000:]
    assert launched.stderr.count("already holds a run") == 1, launched.stderr[-3000:]

    # 2. Resuming the finished run, twice: it says it is finished and does nothing; the lock was released cleanly.
    page_before = (out / "report.html").read_bytes()
    for _ in range(2):
        done = run_trainer(out, *RUN, "--resume_from_checkpoint", "latest", html_report=True)
        text = done.stdout + done.stderr
        assert "already finished: step 3 of --max_train_steps 3" in text, text[-3000:]
        assert "took over the lock" not in text and "loss None" not in text
    assert (out / "report.html").read_bytes() == page_before  # export, validation, report not redone
    assert [e["exit_code"] for e in events(out, 0, "stop")] == [0]
    assert len(events(out, 0, "resume")) == 2

    # 3. The report counts both resumes, one process, and the time the launches ran, not the time between them.
    from vidstab.tools.report import write_report

    page = write_report(out, tmp_path / "again.html").read_text(encoding="utf-8")
    assert "resumes</th><td>2 (at steps 3, 3)" in page
    assert "processes</th><td>1 (rank 0)" in page and "ranks 0" not in page
    assert re.search(r"wall time</th><td>\d+ s over 3 launches", page), re.search(r"wall time</th><td>[^<]*", page)


def test_an_incident_says_where_its_bundle_is_how_to_replay_it_and_that_it_has_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    done = run_trainer(out, "--max_train_steps", "4", "--inject_fault", "nan_batch@2")  # default --checkpointing_steps 100
    (bundle,) = (out / "vidstab" / "incidents").iterdir()
    said = [line for line in done.stdout.splitlines() if "incident bundle" in line]
    assert len(said) == 1 and f"replay it with: vidstab replay {bundle}" in said[0], done.stdout[-3000:]
    assert "no checkpoint was saved before step 2, --checkpointing_steps 100" in said[0]
    assert "fresh initialisation" in said[0]
    last = done.stdout.strip().splitlines()[-1]
    assert "skipped 1" in last and f"incidents 1 (newest {bundle}; replay: vidstab replay {bundle})" in last, last
    _strip_rows_are_the_clips(out)


def _strip_rows_are_the_clips(out):
    """strip.png holds one row per clip, each that clip's frames: closer to its own MP4 (decoded; H.264 adds
    noise of its own) than to any other clip's. Rows that look alike are clips that look alike."""
    import av
    import numpy as np
    from PIL import Image

    (folder,) = sorted((out / "validation").glob("step_*"))[-1:]
    clips = []
    for mp4 in sorted(folder.glob("clip_*.mp4")):
        with av.open(str(mp4)) as container:
            clips.append(np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(float))
    t, h, w, _ = clips[0].shape
    strip = np.asarray(Image.open(folder / "strip.png")).astype(float)
    scale = strip.shape[0] // (len(clips) * h)
    strip = strip[::scale, ::scale]
    rows = [strip[i * h:(i + 1) * h].reshape(h, t, w, 3).transpose(1, 0, 2, 3) for i in range(len(clips))]
    for i, row in enumerate(rows):
        gaps = [float(np.abs(row - clip).mean()) for clip in clips]
        assert int(np.argmin(gaps)) == i, (i, gaps)
