"""A run folder whose checkpoints cannot be verified is never resumed from scratch on top of them: the
resume refuses and names every folder, and only --overwrite_output_dir (moving them aside) starts over.
Real trainer processes, real files."""

from __future__ import annotations

from pathlib import Path

from trainer_utils import run_trainer


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_that_finds_only_unverifiable_checkpoint_folders_refuses_names_them_and_overwrites_nothing(tmp_path):
    out = tmp_path / "run"
    run_trainer(out, "--max_train_steps", "6", "--checkpointing_steps", "2")
    root = out / "vidstab" / "checkpoints"
    for folder in root.glob("step_*"):
        (folder / "manifest.json").unlink()
    for ptr in ("latest", "last_good"):
        (root / ptr).unlink(missing_ok=True)
    folders = sorted(p.name for p in root.glob("step_*"))
    assert len(folders) >= 2, folders
    before = _files(root)

    done = run_trainer(out, "--max_train_steps", "6", "--checkpointing_steps", "2", "--resume_from_checkpoint", "latest",
                       check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 2, text[-3000:]
    assert "starting from scratch" not in text
    assert "cannot be verified" in text and "--overwrite_output_dir" in text, text[-3000:]
    for name in folders:
        assert name in text, (name, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    assert _files(root) == before, "a refused resume changed a checkpoint folder"

    # Starting over moves the whole earlier run aside, every byte of the unverifiable folders included.
    run_trainer(out, "--max_train_steps", "2", "--checkpointing_steps", "2", "--overwrite_output_dir")
    (moved,) = (out / "previous-runs").iterdir()
    assert _files(moved / "vidstab" / "checkpoints") == before
