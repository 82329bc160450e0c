"""``recipes/train.py --fsdp`` with 2 real processes (FSDP2 per DiT block on a gloo CPU mesh, sharded DCP
checkpoints): lockstep skip, rollback with LR back-off, bitwise resume, 2 -> 1 process resume."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from trainer_utils import events, losses_by_step, run_trainer, run_trainers


def _shards(output_dir, step) -> dict[str, torch.Tensor]:
    """Every rank's shards of the checkpoint of ``step`` (model and optimizer), by file and key."""
    folder = output_dir / "vidstab" / "checkpoints" / f"step_{step:06d}" / "dcp"
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2, files  # one file per rank: each wrote its own shards
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.slow
def test_fsdp_nan_on_rank1_skipped_in_lockstep_resume_is_bitwise_and_resumes_in_one_process(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    fault = ["--inject_fault", "nan_batch@4:1", "--fsdp", "--use_ema", "--checkpointing_steps", "3"]
    run_trainers((full, "--max_train_steps", "6", *fault),  # independent: started together
                 (split, "--max_train_steps", "3", "--fsdp", "--use_ema", "--checkpointing_steps", "3"), nproc=2)  # the fault is past its end
    run_trainer(split, "--max_train_steps", "6", *fault, "--resume_from_checkpoint", "latest", nproc=2)
    for rank in (0, 1):
        assert [e["step"] for e in events(full, rank, "skip")] == [4], rank  # lockstep: both ranks skip
        assert [e["step"] for e in events(split, rank, "skip")] == [4], rank
    a, b = losses_by_step(full, 0), losses_by_step(split, 0)  # the step's loss (rank 0 logs every step)
    assert [a[s] for s in (3, 5)] == [b[s] for s in (3, 5)], (a, b)
    a, b = _shards(full, 6), _shards(split, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
    assert any(k.split(":")[1].startswith("ema.") for k in a), "the EMA is not in the sharded checkpoint"
    # The EMA was updated on each rank's shard, saved and resumed through DCP, and exported gathered.
    ema_full, ema_split = (load_file(str(d / "transformer_ema" / "diffusion_pytorch_model.safetensors")) for d in (full, split))
    live = load_file(str(full / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert ema_full.keys() == live.keys() and all(torch.equal(ema_full[k], ema_split[k]) for k in ema_full)
    assert any(not torch.equal(ema_full[k], live[k]) for k in live)
    assert all(torch.isfinite(v).all() for k, v in a.items() if v.is_floating_point())
    # The 2-process sharded checkpoint resumes in 1 process (DCP reshards on load).
    one = tmp_path / "one"
    shutil.copytree(split, one)
    proc = run_trainer(one, "--max_train_steps", "8", "--fsdp", "--use_ema", "--checkpointing_steps", "4",
                       "--resume_from_checkpoint", "latest")
    assert "done: 8/8 steps" in proc.stdout
    assert [r["step"] for r in events(one, kind="resume")][-1] == 6


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
