"""``recipes/train.py --fsdp`` with 2 real processes (FSDP2 per DiT block on a gloo CPU mesh, sharded DCP
checkpoints): rollback with LR back-off, a rank killed inside a sharded save. The lockstep skip, the bitwise resume
and the 2 -> 1 process resume run on the conformance matrix's FSDP2 row (tests/test_conformance.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from trainer_utils import events, run_trainer


def _shards(output_dir, step) -> dict[str, torch.Tensor]:
    """Every rank's shards of the checkpoint of ``step`` (model and optimizer), by file and key."""
    folder = output_dir / "vidstab" / "checkpoints" / f"step_{step:06d}" / "dcp"
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2, files  # one file per rank: each wrote its own shards
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.slow
def test_fsdp_lr_spike_rolls_back_to_last_good_with_lr_backoff(tmp_path):
    out = tmp_path / "run"
    # The spike scales the schedule's base LR until a reload: step 9 is refused (its LR put back to the schedule's),
    # step 10 runs, then the schedule itself is x10^4 and five refusals in a row (11-15) roll back.
    proc = run_trainer(out, "--max_train_steps", "20", "--checkpointing_steps", "4", "--inject_fault", "lr_spike@9=1e4",
                       "--fsdp", nproc=2)
    for rank in (0, 1):
        rollbacks = events(out, rank, "rollback")
        assert rollbacks, f"no rollback on rank {rank}:\n{proc.stdout[-2000:]}"
        assert rollbacks[0]["lr_multiplier"] == 0.5
    assert "done: 20/20 steps" in proc.stdout
    assert all(torch.isfinite(v).all() for v in _shards(out, 20).values() if v.is_floating_point())


@pytest.mark.slow
def test_fsdp_rank_sigkilled_inside_a_sharded_save_resumes_from_the_previous_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = ["--max_train_steps", "5", "--fsdp", "--checkpointing_steps", "2"]
    # Rank 1 dies by SIGKILL inside the save of step 4, its own shards written, before the ranks agree.
    killed = run_trainer(out, *args, "--inject_fault", "kill_in_save@4:1", nproc=2, check=False)
    assert killed.returncode != 0
    assert "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    root = out / "vidstab" / "checkpoints"
    assert not (root / "step_000004").exists()
    assert (root / "latest").read_text().strip() == "step_000002"
    assert [e["step"] for e in events(out, 0, "checkpoint")] == [2]
    resumed = run_trainer(out, *args, "--resume_from_checkpoint", "latest", nproc=2)
    assert "done: 5/5 steps" in resumed.stdout
    for rank in (0, 1):
        assert [e["step"] for e in events(out, rank, "resume")] == [2], rank
    assert not list(root.glob(".tmp-*"))  # the killed save's folder was removed, never loaded
    assert all(torch.isfinite(v).all() for v in _shards(out, 5).values() if v.is_floating_point())
