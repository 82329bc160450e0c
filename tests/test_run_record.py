"""The run record says what the run ran with: the precision `accelerate launch --mixed_precision` chose (the
trainer's own flag left unset), the number of processes and the library versions, in train_config.yaml and in
every rank's `start` event."""

from __future__ import annotations

import subprocess
from importlib import metadata

import yaml

from trainer_utils import _trainer_cmd, events


def test_precision_from_accelerate_launch_world_size_and_versions_are_recorded(tmp_path):
    out = tmp_path / "run"
    cmd, env = _trainer_cmd(out, ("--max_train_steps", "2", "--checkpointing_steps", "100", "--num_validation_videos", "0"), nproc=2, env=None)
    cmd[cmd.index("--mixed_precision") + 1] = "bf16"  # chosen by the launcher only, as `accelerate launch --mixed_precision bf16`
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]

    config = yaml.safe_load((out / "train_config.yaml").read_text())
    assert config["mixed_precision"] is None  # the flag as given...
    run = config["run"]  # ...and what the run ran with
    assert run["mixed_precision"] == "bf16" and run["world_size"] == 2
    assert run["versions"]["torch"] == metadata.version("torch")
    assert run["versions"]["accelerate"] == metadata.version("accelerate")
    assert run["versions"]["diffusers"] == metadata.version("diffusers")
    assert run["versions"]["vidstab"]
    for rank in (0, 1):
        (start,) = events(out, rank, "start")
        assert start["run"] == run
