"""Out of memory is an incident of its own (vidstab/recovery/oom.py, the ``oom`` detector): the step is skipped on every
rank, its memory released, no rollback and no LR change; an ``oom`` event names the phase, bucket and micro-batch.

Single-process cases with a real Accelerator and a real guard: the explicit form (the trainer's forward OOM,
passed as ``error``), a backward that runs out of memory (caught by the guard) in the explicit and the unmodified
attached loop, the advice after a few OOMs in one bucket, and the count per bucket kept across a resume. The
trainer's drills on 2 processes are in test_oom_drills.py."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import vidstab
from vidstab.detectors import Verdict
from vidstab.recovery.oom import is_oom


class OOMInBackward(torch.autograd.Function):
    """Identity forward; a backward that fails as an allocator does."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (drill)")


def _setup(tmp_path, **config):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model, opt, sched = acc.prepare(model, opt, sched)
    cfg = vidstab.GuardConfig.from_dict(config) if config else vidstab.GuardConfig()
    return acc, model, opt, sched, cfg


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_messages_that_are_out_of_memory():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert is_oom(RuntimeError("XPU out of memory. Tried to allocate 2 GiB"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered")) and not is_oom(None)


def test_forward_and_backward_ooms_skip_without_rollback_explicit_form(tmp_path):
    acc, model, opt, sched, cfg = _setup(tmp_path)
    guard = vidstab.Guard(acc, model, opt, sched, config=cfg, run_dir=tmp_path)
    x = torch.randn(4, 8)
    results = []
    for step in range(6):
        before = _weights(model)
        with acc.accumulate(model):
            if step == 2:  # the forward ran out of memory: the caller passes a zero loss and the error
                loss = model(torch.zeros_like(x[:1])).sum() * 0.0
                guard.backward(loss, batch={"x": x}, error=torch.OutOfMemoryError("CUDA out of memory (drill)"))
            elif step == 4:  # the backward runs out of memory: the guard catches it
                guard.backward(OOMInBackward.apply(model(x)).square().mean(), batch={"x": x})
                assert all(p.grad is None for p in model.parameters())  # dropped at once
            else:
                guard.backward(model(x).square().mean(), batch={"x": x})
            results.append(guard.step(1.0))
        assert _same(before, _weights(model)) == (step in (2, 4))
    for step in (2, 4):
        r = results[step]
        assert r.skipped and not r.applied and r.rollback is None and r.verdict == Verdict.SKIP
        assert [f.detector for f in r.findings] == ["oom"] and r.incidents == []  # no bundle for an OOM
    assert all(results[s].applied for s in (0, 1, 3, 5))
    assert guard.lr_multiplier == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    events = vidstab.read_events(tmp_path, "oom")
    assert [(e["step"], e["phase"], e["micro_batch"], e["bucket"], e["rank"]) for e in events] == [
        (2, "forward", 4, "4x8", 0), (4, "backward", 4, "4x8", 0)]
    assert not vidstab.read_events(tmp_path, "rollback_request")
    rss = [e["rss_mib"] for e in vidstab.read_events(tmp_path, "metrics")]  # each logged line: host memory
    assert len(rss) == 6 and all(isinstance(m, float) and m > 10 for m in rss)
    guard.close()


def test_attached_loop_backward_oom_is_skipped_and_advice_names_the_bucket(tmp_path):
    """The unmodified loop: after ``advise_after`` OOMs in one bucket the finding says which micro-batch to use;
    the count per bucket travels with the guard's state."""
    acc, model, opt, sched, cfg = _setup(tmp_path, oom={"advise_after": 2})
    guard = vidstab.attach(acc, model, opt, sched, config=cfg, run_dir=tmp_path)
    x = torch.randn(6, 8)
    for step in range(4):
        before = _weights(model)
        with acc.accumulate(model):
            out = model(x)
            loss = (OOMInBackward.apply(out) if step in (1, 3) else out).square().mean()
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        r = guard.last_result
        assert r.skipped == (step in (1, 3)) and r.rollback is None
        assert _same(before, _weights(model)) == (step in (1, 3))
    skips = [e for e in vidstab.read_events(tmp_path, "skip") if e["detector"] == "oom"]
    assert [e["step"] for e in skips] == [1, 3]
    assert "use" not in skips[0]["message"]
    assert "2 OOMs in bucket 6x8: use a micro-batch of at most 3 samples" in skips[1]["message"]
    state = json.loads(json.dumps(guard.state_dict()))
    assert state["detectors"]["oom"] == {"per_bucket": {"6x8": 2}, "fits": {}}
    guard.close()
    acc2, model2, opt2, sched2, cfg2 = _setup(tmp_path)
    fresh = vidstab.Guard(acc2, model2, opt2, sched2, config=cfg2, run_dir=tmp_path / "resumed")
    fresh.load_state_dict(state)
    assert next(d for d in fresh.detectors if d.name == "oom").state_dict() == {"per_bucket": {"6x8": 2}, "fits": {}}
    fresh.close()


def test_a_run_of_ooms_is_not_escalated_to_a_rollback(tmp_path):
    """A bucket over the memory budget skips every time: consecutive_skips does not count OOM skips."""
    acc, model, opt, sched, cfg = _setup(tmp_path)
    guard = vidstab.Guard(acc, model, opt, sched, config=cfg, run_dir=tmp_path)
    x = torch.randn(4, 8)
    for _ in range(cfg.consecutive_skips.max_consecutive + 2):
        with acc.accumulate(model):
            guard.backward(model(x[:1]).sum() * 0.0, batch={"x": x}, error=torch.OutOfMemoryError("out of memory"))
            r = guard.step(1.0)
        assert r.skipped and r.rollback is None
    assert not vidstab.read_events(tmp_path, "rollback_request")
    guard.close()
