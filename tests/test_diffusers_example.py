"""diffusers' own examples/unconditional_image_generation/train_unconditional.py, with vidstab added
(examples/diffusers_unconditional/vidstab.patch), on a local image folder and a tiny UNet2DModel, no hub.

It still does what it did -- its own checkpoint-N saving, --checkpoints_total_limit, --resume_from_checkpoint
latest, the final pipeline -- plus vidstab's guard, checkpoints and rollback; and after a rollback the two
checkpoint systems agree: the script's own `latest` never picks a checkpoint-N of the abandoned trajectory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "examples" / "diffusers_unconditional"
UPSTREAM, GUARDED = FOLDER / "train_unconditional.py", FOLDER / "train_unconditional_vidstab.py"
TINY_UNET = {"_class_name": "UNet2DModel", "sample_size": 16, "in_channels": 3, "out_channels": 3, "layers_per_block": 1,
             "block_out_channels": [8, 16], "norm_num_groups": 4, "attention_head_dim": 4,
             "down_block_types": ["DownBlock2D", "AttnDownBlock2D"], "up_block_types": ["AttnUpBlock2D", "UpBlock2D"]}


def _data(tmp_path: Path) -> tuple[Path, Path]:
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(images / f"img{i}.png")
    config = tmp_path / "unet"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(TINY_UNET))
    return images, config


def _run(script: Path, out: Path, images: Path, config: Path, *extra: str) -> subprocess.CompletedProcess:
    paths = [str(REPO)] + ([] if importlib.util.find_spec("torchvision") else [str(REPO / "tests" / "shims")])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(script), "--train_data_dir", str(images), "--model_config_name_or_path", str(config),
           "--output_dir", str(out), "--resolution", "16", "--center_crop", "--train_batch_size", "2", "--eval_batch_size", "1",
           "--lr_warmup_steps", "2", "--learning_rate", "1e-3", "--checkpointing_steps", "2", "--checkpoints_total_limit", "2",
           "--ddpm_num_inference_steps", "2", "--save_images_epochs", "100", "--save_model_epochs", "100",
           "--dataloader_num_workers", "0", "--cache_dir", str(out.parent / "hf_cache"), *extra]
    return subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)


def _own_checkpoints(out: Path) -> list[int]:
    return sorted(int(m.group(1)) for n in os.listdir(out) if (m := re.fullmatch(r"checkpoint-(\d+)", n)))


def _events(out: Path, kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "vidstab" / "events-rank0.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == kind]


def test_the_patch_is_the_diff_between_upstream_and_the_guarded_copy():
    diff = subprocess.run(["diff", "-u", str(UPSTREAM), str(GUARDED)], capture_output=True, text=True).stdout
    body = lambda text: [x for x in text.splitlines() if x[:1] in "+-" and not x.startswith(("+++", "---"))]
    assert body(diff) == body((FOLDER / "vidstab.patch").read_text())


def test_diffusers_script_rollback_then_its_own_resume_latest(tmp_path):
    images, config = _data(tmp_path)
    out = tmp_path / "run"
    # 8 images / batch 2 = 4 steps per epoch, 3 epochs = 12 steps. A bug multiplies the LR by 10^5 at step 6
    # (until a reload); it recurs after every rollback: the retry budget runs out and the run aborts.
    faults = [x for _ in range(5) for x in ("--inject_fault", "lr_spike@6=100000")]
    first = _run(GUARDED, out, images, config, "--num_epochs", "3", *faults)
    assert first.returncode != 0 and "vidstab: run aborted" in first.stderr
    # An LR bug leaves no incident bundle (lr_bound captures no batch): the message names none, and says where
    # the evidence is.
    assert "vidstab replay" not in first.stderr and "No incident bundle was written" in first.stderr
    rollbacks = _events(out, "rollback")
    assert len(rollbacks) == 3 and all(r["to_step"] <= 6 for r in rollbacks)
    for r in rollbacks:  # every rollback removed the script's own checkpoint-N of the abandoned trajectory
        assert all(int(n.split("-")[1]) > r["to_step"] for n in r["discarded_own_checkpoints"])
    abort = [e for e in _events(out, "recovery") if e["action"] == "abort"][-1]
    discarded = [n for e in rollbacks + [abort] for n in e["discarded_own_checkpoints"]]
    assert discarded, "the abandoned trajectory left no checkpoint-N: the drill did not test the agreement"
    # One source of truth: what the script's own `latest` finds is not newer than vidstab's last good checkpoint.
    own = _own_checkpoints(out)
    assert own and max(own) <= abort["last_good_step"] and len(own) <= 2  # --checkpoints_total_limit still holds

    # The fixed script (no fault) resumes with its own --resume_from_checkpoint latest and finishes; the changed
    # configuration gets a fresh retry budget, and that is said.
    second = _run(GUARDED, out, images, config, "--num_epochs", "3", "--resume_from_checkpoint", "latest")
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"Resuming from checkpoint checkpoint-{max(own)}" in second.stdout + second.stderr
    assert "started afresh because the run's configuration changed" in second.stderr
    assert (out / "model_index.json").is_file() and (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert _own_checkpoints(out) == [10, 12]  # its own saving and total limit, after the resume
    metrics = _events(out, "metrics")
    assert metrics[-1]["step"] == 11 and all(np.isfinite(m["loss"]) for m in metrics[-3:])


def test_readme_states_the_patch_line_count():
    body = [x for x in (FOLDER / "vidstab.patch").read_text().splitlines() if not x.startswith(("+++", "---"))]
    added, removed = sum(x.startswith("+") for x in body), sum(x.startswith("-") for x in body)
    assert f"`vidstab.patch` between them (+{added} / −{removed} lines" in (REPO / "README.md").read_text()
