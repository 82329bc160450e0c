"""The out-of-memory drills of the reference trainer on 2 real processes (DDP): ``oom@STEP:RANK`` raises one OOM in
that rank's forward, ``oom_batch_above@STEP=N`` makes every forward of more than N samples fail from STEP on (a
device with a fixed budget). Every rank skips the same steps, no rollback, no LR change, the run finishes, and
after a few OOMs in the one bucket the finding names the micro-batch to use. One run serves every assertion."""

from __future__ import annotations

import pytest

import vidstab
from tests.trainer_utils import run_trainer

pytestmark = pytest.mark.xdist_group("oom_drills")
STEPS = 8


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    out = tmp_path_factory.mktemp("oom_drills")
    proc = run_trainer(out, "--max_train_steps", str(STEPS), "--checkpointing_steps", "4",
                       "--inject_fault", "oom@2:1", "--inject_fault", "oom_batch_above@5:0=2", nproc=2, timeout=400)
    return out, proc


def test_every_rank_skips_the_oom_steps_together_without_rollback(drilled):
    out, proc = drilled
    assert proc.returncode == 0
    ooms = vidstab.read_events(out, "oom")
    assert [(e["step"], e["rank"], e["phase"], e["micro_batch"]) for e in ooms] == [
        (2, 1, "forward", 4), (5, 0, "forward", 4), (6, 0, "forward", 4), (7, 0, "forward", 4)]
    assert len({e["bucket"] for e in ooms}) == 1
    skips = [e for e in vidstab.read_events(out, "skip") if e["detector"] == "oom"]
    for rank in (0, 1):  # each rank's own log: the same steps, the same ranks named
        assert [(e["step"], e["bad_ranks"]) for e in skips if e["rank"] == rank] == [
            (2, [1]), (5, [0]), (6, [0]), (7, [0])]
    assert not vidstab.read_events(out, ("rollback_request", "rollback", "crash"))
    stop = vidstab.read_events(out, "stop")
    assert stop and stop[-1]["exit_code"] == 0 and stop[-1]["step"] == STEPS


def test_repeated_ooms_in_one_bucket_name_the_micro_batch_to_use(drilled):
    out, _ = drilled
    last = [e for e in vidstab.read_events(out, "skip") if e["detector"] == "oom" and e["step"] == 7 and e["rank"] == 0]
    assert "use a micro-batch of at most 2 samples" in last[0]["message"]
    metrics = [e for e in vidstab.read_events(out, "metrics") if e["rank"] == 0]
    assert {e["step"] for e in metrics if e.get("verdict") == "SKIP"} >= {2, 5, 6, 7}
