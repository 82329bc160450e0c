"""Out of memory where vidstab cannot re-run the batch: a forward OOM in the unmodified attached loop, and an OOM
inside ``optimizer.step()`` (judged by whether the update was applied), on 2 real processes (DDP) in the attached
and the explicit form (one launch: tests/scripts/attach_oom.py), and single-process cases in-process."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import vidstab
from test_guard_distributed import launch
from vidstab.faults import FaultInjector
from vidstab.recovery.oom import OptimizerStateDiverged, StepMarks, WriteOrder

pytestmark = pytest.mark.xdist_group("oom_attached")


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    """Attached (rollback_every=100: one rollback checkpoint; buckets of 2 and 4 samples take turns): rank 1's forward OOMs at step 1; every
    rank's optimizer fails before touching anything at step 2; rank 1's fails half-way at step 4; from step 5 on
    every forward of more than 2 samples fails. Explicit: every rank's optimizer fails untouched at step 1; rank 0's
    alone at step 3."""
    out = tmp_path_factory.mktemp("oom_attached")
    launch("attach_oom.py", "--out", str(out), "--steps", "10",
           "--inject_fault", "oom@1:1", "--inject_fault", "oom_in_step@2", "--inject_fault", "oom_in_step@4:1=partway",
           "--inject_fault", "oom_batch_above@5=2",
           "--explicit_fault", "oom_in_step@1", "--explicit_fault", "oom_in_step@3:0", timeout=400)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_forward_oom_in_the_users_own_loop_is_skipped_on_every_rank(drilled):
    out, (r0, r1) = drilled
    for r in (r0, r1):
        for step in (1, 7, 9):  # rank 1 alone at step 1; both ranks over the budget of 2 samples after
            assert r["steps"][step] == {"step": step, "applied": False, "skipped": True, "rollback": False,
                                        "detectors": ["oom"]}
    ooms = [e for e in vidstab.read_events(out, "oom") if e["phase"] == "forward"]
    assert [(e["step"], e["rank"], e["micro_batch"], e["bucket"]) for e in ooms if e["step"] == 1] == [
        (1, 1, 4, "4x4x4x4x4")]
    skips = [e for e in vidstab.read_events(out, "skip") if e["detector"] == "oom" and "optimizer" not in e["message"]]
    advice = [e["message"] for e in skips if "OOMs in bucket" in e["message"]]
    assert advice and all("in bucket 4x4x4x4x4: use a micro-batch of at most 2 samples for it (the data loader's "
                          "batch size" in m for m in advice)
    assert r0["finite"] and r0["sha256"] == r1["sha256"]  # one model on both ranks at the end


def test_an_optimizer_oom_before_any_update_skips_without_rollback(drilled):
    out, (r0, r1) = drilled
    for r in (r0, r1):  # every rank failed untouched at step 2: skipped everywhere; step 3 is a normal step
        assert r["steps"][2]["skipped"] and not r["steps"][2]["rollback"]
        assert r["steps"][3] == {"step": 3, "applied": True, "skipped": False, "rollback": False, "detectors": []}
        assert [x["rollback"] for x in r["explicit"]] == [None, None, None, None, r["explicit"][4]["rollback"], None]
        assert r["explicit"][1]["skipped"] and r["explicit"][2]["applied"]  # explicit form: the same at step 1
    ooms = [e for e in vidstab.read_events(out, "oom") if e["phase"] == "optimizer"]
    assert sorted((e["step"], e["rank"], e["touched"]) for e in ooms) == [(2, 0, False), (2, 1, False),
                                                                          (4, 1, True)]


def test_an_optimizer_oom_after_an_update_or_on_one_rank_rolls_back_every_rank(drilled):
    out, (r0, r1) = drilled
    # attached: rank 1 updated half its weights at step 4, rank 0 all of them; both roll back at step 5, in place
    assert r0["steps"][4]["applied"] and not r1["steps"][4]["applied"]
    assert r0["steps"][5]["rollback"] and r1["steps"][5]["rollback"]
    rollbacks = vidstab.read_events(out, "rollback")
    assert sorted(e["rank"] for e in rollbacks) == [0, 1] and all(e["failed_step"] == 5 for e in rollbacks)
    assert all(e["cause"] == "exception" and e["lr_multiplier"] == 1.0 for e in rollbacks)  # the LR is not lowered
    # explicit: rank 0 alone failed (untouched) at step 3 while rank 1 applied: both are told to roll back at step 4
    for r in (r0, r1):
        assert "on some ranks only" in r["explicit"][4]["rollback"] and r["explicit"][4]["bad_ranks"] == [0]
    assert r0["explicit"][3]["skipped"] and r1["explicit"][3]["applied"]


def _setup():
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def test_without_a_rollback_checkpoint_the_attached_loop_stops_with_a_message(tmp_path):
    acc, model, opt = _setup()
    guard = vidstab.attach(acc, model, opt, run_dir=tmp_path)
    FaultInjector(["oom_in_step@0=partway"], 0).arm_optimizer_step(opt, lambda: guard.global_step)
    x = torch.randn(4, 8)
    for step in range(2):
        acc.backward(model(x).square().mean())
        if step == 1:
            with pytest.raises(OptimizerStateDiverged, match="keeps no rollback checkpoints: stopping here. Resume "
                                                            "from your last checkpoint; attach"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    guard.close()


def test_marks_tell_an_untouched_step_and_drop_the_state_it_created():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    for p in params:
        p.grad = torch.ones(3)

    class StateThenOOM(torch.optim.SGD):
        """Allocates its state (as Adam's first step does), then fails as an allocator would."""

        def step(self, closure=None):
            for p in params:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            raise torch.OutOfMemoryError("CUDA out of memory (drill)")

    opt = StateThenOOM(params, lr=0.1)
    marks = StepMarks(WriteOrder(opt), params)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    assert marks.judge() is False and len(opt.state) == 0
    real = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    marks = StepMarks(WriteOrder(real), params)
    real.step()
    assert marks.judge() is True  # any weight or state modified counts
    fused = torch.optim.AdamW(params, lr=0.1, fused=True)
    assert StepMarks(WriteOrder(fused), params).judge() is True  # fused kernels keep no version counts: the safe side


@pytest.mark.parametrize("foreach", [False, True])
def test_marks_of_torchs_adamw_read_the_first_written_tensors_and_tell_an_untouched_step_from_a_partial_one(foreach):
    """torch's AdamW, two parameter groups of two dtypes each: the marks read the first parameter with a gradient of
    each (group, dtype) and its state, not every tensor. A step that fails while gathering its state (a sparse
    gradient in the first group) wrote nothing: untouched, and its new state dropped. A step that fails at the second
    group (a sparse gradient there) has updated the first group: touched."""
    params = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64 if i % 2 == 0 else torch.float32)) for i in range(8)]
    opt = torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:]}], lr=0.1, foreach=foreach)
    for p in params:
        p.grad = torch.ones_like(p)
    params[2].grad = torch.ones(4, dtype=torch.float64).to_sparse()
    marks = StepMarks(WriteOrder(opt), params)
    assert marks.params == [params[0], params[1], params[4], params[5]]
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert marks.judge() is False and len(opt.state) == 0  # the state the first group's gathering made is gone
    params[2].grad = torch.ones_like(params[2])
    opt.step()  # every parameter has state now
    params[6].grad = torch.ones(4, dtype=params[6].dtype).to_sparse()
    marks = StepMarks(WriteOrder(opt), params)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert marks.judge() is True

    class MyAdamW(torch.optim.AdamW):
        """A subclass may step in another order: every tensor is read."""

    assert StepMarks(WriteOrder(MyAdamW(params, lr=0.1)), params).params == params
