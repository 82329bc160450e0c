"""The out-of-memory drills of the reference trainer: ``oom@STEP[:RANK]`` raises one OOM in that rank's forward,
``oom_batch_above@STEP=N`` makes every forward of more than N samples fail from STEP on (a device with a fixed
budget). The step is skipped on every rank together (no rollback, no LR change), then the same batch is re-run in
pieces of half the size with gradient accumulation, every rank alike; the size that fitted is remembered for the
bucket. On 2 processes (DDP), and on 1 process against an unfaulted run: the same weights up to rounding."""

from __future__ import annotations

import pytest
import torch

import vidstab
from tests.trainer_utils import run_trainer, run_trainers

pytestmark = pytest.mark.xdist_group("oom_drills")
STEPS = 8


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    out = tmp_path_factory.mktemp("oom_drills")
    proc = run_trainer(out, "--max_train_steps", str(STEPS), "--checkpointing_steps", "4",
                       "--inject_fault", "oom_batch_above@3:1=1", "--inject_fault", "oom@6:0", nproc=2, timeout=400)
    return out, proc


def test_every_rank_skips_the_oom_steps_together_and_retries_on_the_same_split(drilled):
    out, proc = drilled
    assert proc.returncode == 0
    ooms = vidstab.read_events(out, "oom")
    # step 3: rank 1's budget of 1 sample: 4 samples fail, then both pieces of 2; pieces of 1 fit, and later steps
    # start there; step 6: one OOM on rank 0 in a piece of 1 sample, which cannot be cut: the step stays skipped
    assert [(e["step"], e["rank"], e["phase"], e["micro_batch"]) for e in ooms] == [
        (3, 1, "forward", 4), (3, 1, "forward", 2), (3, 1, "forward", 2), (6, 0, "forward", 1)]
    skips = [e for e in vidstab.read_events(out, "skip") if e["detector"] == "oom"]
    retries = vidstab.read_events(out, "oom_retry")
    for rank in (0, 1):  # each rank's own log: the same steps, the same ranks named, the same split
        assert [(e["step"], e["bad_ranks"]) for e in skips if e["rank"] == rank] == [(3, [1]), (3, [1]), (6, [0])]
        assert [(e["step"], e["micro_batch"], e["applied"]) for e in retries if e["rank"] == rank] == [
            (3, 1, True), (6, 1, False)]
    (entry,) = vidstab.QuarantineList(out).entries()  # the sample that did not fit alone, named by its rank
    assert entry["rank"] == 0 and entry["step"] == 6 and entry["source"] == "oom"
    assert entry["reason"].startswith("out of memory alone: one sample of shape [1, ")
    assert not vidstab.read_events(out, ("rollback_request", "rollback", "crash"))
    stop = vidstab.read_events(out, "stop")
    assert stop and stop[-1]["exit_code"] == 0 and stop[-1]["step"] == STEPS


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))


def test_the_update_in_pieces_is_the_whole_batchs(tmp_path):
    """One process, 2 micro-batches of 4 per step, a budget of 1 sample from step 1 on: pieces of 2 fail, pieces of 1
    fit, later steps start there; the run ends on the weights of the run without an OOM, up to rounding. The
    budget run starts with ``--audit`` (its memory preflight takes one step and must leave nothing behind)."""
    flags = ("--max_train_steps", "4", "--gradient_accumulation_steps", "2", "--checkpointing_steps", "4")
    plain, budget = tmp_path / "plain", tmp_path / "budget"
    runs = run_trainers((plain, *flags), (budget, *flags, "--inject_fault", "oom_batch_above@1=1", "--audit"),
                        timeout=400)
    assert all(r.returncode == 0 for r in runs)
    # --audit's preflight of the run's one bucket (before the budget: it fits), a step that leaves no trace
    assert "memory.bucket           bucket 4x4x3x4x4 at a micro-batch of 4: peak " in runs[1].stdout
    assert [(e["step"], e["micro_batch"], e["applied"]) for e in vidstab.read_events(budget, "oom_retry")] == [
        (1, 1, True)]
    # 2 micro-batches of 4, then 4 pieces of 2: all too many; the pieces of 1 fit, and steps 2 and 3 start there
    assert [(e["step"], e["micro_batch"]) for e in vidstab.read_events(budget, "oom")] == [(1, 4)] * 2 + [(1, 2)] * 4
    want, got = _weights(plain), _weights(budget)
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_under_fsdp2_the_oom_step_is_retried_in_pieces_on_every_rank(tmp_path):
    """``--fsdp`` (FSDP2 per DiT block, 2 processes): rank 1's budget of 2 samples from step 2 on; the step is
    skipped on both ranks, re-run in pieces of 2 on both, and step 3 starts in pieces."""
    out = tmp_path / "fsdp"
    run_trainer(out, "--max_train_steps", "4", "--fsdp", "--checkpointing_steps", "4",
                "--inject_fault", "oom_batch_above@2:1=2", nproc=2, timeout=400)
    assert [(e["step"], e["rank"], e["micro_batch"]) for e in vidstab.read_events(out, "oom")] == [(2, 1, 4)]
    for rank in (0, 1):
        retries = [e for e in vidstab.read_events(out, "oom_retry") if e["rank"] == rank]
        assert [(e["step"], e["micro_batch"], e["applied"]) for e in retries] == [(2, 2, True)]
    assert not vidstab.read_events(out, ("rollback_request", "rollback", "crash"))
    assert [e["step"] for e in vidstab.read_events(out, "metrics") if e["rank"] == 0] == [0, 1, 2, 2, 3]
