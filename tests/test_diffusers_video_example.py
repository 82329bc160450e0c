"""diffusers' own examples/cogvideo/train_cogvideox_lora.py (LoRA on a CogVideoX text-to-video transformer), with
vidstab added in at most six lines, none removed (examples/diffusers_cogvideox_lora/vidstab.patch), on a tiny
pipeline folder and a few clips (tests/tiny_cogvideox.py), no hub, 2 processes. Faults come from outside the
script (tests/scripts/drill.py).

It still does what it did -- its own checkpoint-N saving of the LoRA weights, --checkpoints_total_limit,
--resume_from_checkpoint latest, the final pytorch_lora_weights.safetensors -- and vidstab skips a NaN sample
on one rank and names it, refuses an LR x10^4 for as long as it lasts, rolls back in place when it does not
stop and aborts once the retry budget is spent; after a SIGKILL the script's own resume goes on. The replay
of the NaN bundle rebuilds the LoRA-wrapped transformer from what attach recorded, with no code of the user's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")  # the script's own imports: the [test] extra installs them
pytest.importorskip("decord")
pytest.importorskip("transformers")

from diffusers_drills import (KILL, LR_FOR_GOOD, SKIP_FAULTS, changed_lines, check_replay_names_the_sample,  # noqa: E402
                             check_resumed, check_rollbacks_then_abort, check_skips, launch, own_checkpoints)
from doc_snippets import doc_snippet  # noqa: E402
from tiny_cogvideox import save_pipeline, write_clips  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "examples" / "diffusers_cogvideox_lora"
UPSTREAM, GUARDED = FOLDER / "train_cogvideox_lora.py", FOLDER / "train_cogvideox_lora_vidstab.py"


def _inputs(tmp_path: Path, clips: int = 16) -> tuple[Path, Path]:
    return save_pipeline(tmp_path / "cogvideox-tiny"), write_clips(tmp_path / "clips", clips)


def _run(script: Path, out: Path, model: Path, clips: Path, *extra: str, faults: tuple[str, ...] = (),
         nproc: int = 2) -> subprocess.CompletedProcess:
    return launch(script, out, ["--pretrained_model_name_or_path", str(model), "--instance_data_root", str(clips),
                                "--caption_column", "prompts.txt", "--video_column", "videos.txt", "--output_dir", str(out),
                                "--height", "16", "--width", "16", "--max_num_frames", "9", "--train_batch_size", "2",
                                "--rank", "4", "--lora_alpha", "4", "--learning_rate", "1e-3", "--lr_warmup_steps", "0",
                                "--checkpointing_steps", "2", "--checkpoints_total_limit", "2", "--dataloader_num_workers", "0",
                                *extra], faults, nproc)


def _lora(out: Path) -> dict:
    return load_file(str(out / "pytorch_lora_weights.safetensors"))


def test_the_patch_is_the_diff_adds_at_most_six_lines_removes_none_and_the_docs_show_it():
    diff = subprocess.run(["diff", "-u", str(UPSTREAM), str(GUARDED)], capture_output=True, text=True).stdout
    patch = changed_lines((FOLDER / "vidstab.patch").read_text())
    assert changed_lines(diff) == patch
    added, removed = sum(x.startswith("+") for x in patch), sum(x.startswith("-") for x in patch)
    assert added <= 6 and removed == 0, (added, removed)
    shown = doc_snippet("cogvideox-diff")  # docs/own-loop.md: the added lines, in upstream's context
    assert changed_lines(shown) == patch
    upstream = UPSTREAM.read_text()
    assert all(x[1:] in upstream for x in shown.splitlines() if x.startswith(" "))


def test_healthy_run_is_bitwise_the_upstream_scripts(tmp_path):
    model, clips = _inputs(tmp_path, clips=8)  # one process, 4 steps per epoch: the numerics, not the lockstep
    upstream = _run(UPSTREAM, tmp_path / "upstream", model, clips, "--num_train_epochs", "2", nproc=1)
    guarded = _run(GUARDED, tmp_path / "guarded", model, clips, "--num_train_epochs", "2", nproc=1)
    assert upstream.returncode == 0 and guarded.returncode == 0, upstream.stderr[-3000:] + guarded.stderr[-3000:]
    a, b = _lora(tmp_path / "upstream"), _lora(tmp_path / "guarded")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert own_checkpoints(tmp_path / "guarded") == own_checkpoints(tmp_path / "upstream") == [6, 8]


def test_nan_on_rank1_and_an_lr_spike_for_three_steps_are_skipped_and_replay_names_the_sample(tmp_path):
    model, clips = _inputs(tmp_path)
    out = tmp_path / "run"
    # 16 clips / (2 processes x batch 2) = 4 steps per epoch, 3 epochs = 12 steps.
    bundle, meta = check_skips(_run(GUARDED, out, model, clips, "--num_train_epochs", "3", faults=SKIP_FAULTS), out)
    assert all(torch.isfinite(t).all() for t in _lora(out).values())
    # attach recorded the LoRA-wrapped transformer: its class, config, adapter and where its base came from
    peft = meta["model"]["peft"]
    assert meta["model"]["class"].endswith(":CogVideoXTransformer3DModel") and peft["adapters"]["default"]["r"] == 4
    assert peft["base"] == {"pretrained": str(model), "subfolder": "transformer", "dtype": "float32"}
    # The replay rebuilds base + adapter from the bundle alone (no code of the user's) and names the sample.
    report = check_replay_names_the_sample(bundle)
    assert any("frozen-base checkpoint" in n and "match the recorded fingerprint" in n for n in report["notes"])


def test_an_lr_spike_for_good_rolls_back_in_place_then_aborts(tmp_path):
    model, clips = _inputs(tmp_path)
    out = tmp_path / "run"
    check_rollbacks_then_abort(_run(GUARDED, out, model, clips, "--num_train_epochs", "10", faults=LR_FOR_GOOD), out)


def test_sigkill_on_rank1_then_the_scripts_own_resume_finishes(tmp_path):
    model, clips = _inputs(tmp_path)
    out = tmp_path / "run"
    killed = _run(GUARDED, out, model, clips, "--num_train_epochs", "3", faults=KILL)
    assert own_checkpoints(out) == [4, 6]
    resumed = _run(GUARDED, out, model, clips, "--num_train_epochs", "3", "--resume_from_checkpoint", "latest")
    check_resumed(killed, resumed, out)
    assert all(torch.isfinite(t).all() for t in _lora(out).values())
