"""A rollback restores from the copy of the last healthy checkpoint kept in host memory, bitwise as from its files.

Real Accelerate, real checkpoint files, real in-place rollbacks (``attach(..., rollback_every=N)``); 2 processes:
``memory_check`` in tests/scripts/ckpt_ddp.py (run by tests/test_checkpoint.py's 2-process test, one launch).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import vidstab
from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from vidstab.checkpoint.full_state import rng_state

from test_auto_rollback import _kinds, _loop


class GuardStandIn:
    def __init__(self):
        self.state = {"lr_multiplier": 1.0, "ema": {"grad_norm": float("nan")}, "window": [1, 2]}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, d):
        self.state = dict(d)


def _train(model, opt, sched, steps):
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _everything(model, opt, sched, guard):
    """Every bit a rollback restores: weights, optimizer moments and groups, scheduler, guard, RNG."""
    st = opt.state_dict()
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in st["state"].items()},
            "groups": st["param_groups"], "sched": sched.state_dict(), "guard": repr(guard.state),
            "rng": (torch.get_rng_state(), repr(rng_state()["numpy"]), rng_state()["python"])}


def _same(a, b):
    assert a["groups"] == b["groups"] and a["sched"] == b["sched"] and a["guard"] == b["guard"]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert all(torch.equal(a["opt"][i][k], b["opt"][i][k]) for i in a["opt"] for k in a["opt"][i])
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1:] == b["rng"][1:]


def test_memory_and_files_restore_the_same_bits_and_a_damaged_file_matters_only_to_a_relaunch(tmp_path, caplog):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    guard = GuardStandIn()
    ckpt = CheckpointManager(acc, str(tmp_path), CheckpointConfig(keep=2))  # async, default budget
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched), ("vidstab", guard)):
        ckpt.register(name, obj)
    _train(model, opt, sched, 3)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    _train(model, opt, sched, 2)
    ckpt.save(5, healthy=False, trainer_state={"step": 5})  # not a rollback target: the copy of step 3 stays
    ckpt.wait()
    assert ckpt.memory.name == "step_000003"

    def diverge():
        torch.manual_seed(7)
        _train(model, opt, sched, 2)
        guard.state = {"lr_multiplier": 0.5}

    diverge()
    from_files = ckpt.load("last_good", resume_event=False)
    want = _everything(model, opt, sched, guard)
    assert from_files["_checkpoint"]["source"] == "files"
    # The copy does not read the files: a damaged one does not matter to it.
    path = tmp_path / "vidstab" / "checkpoints" / "step_000003" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
    diverge()
    from_memory = ckpt.load("last_good", resume_event=False, from_memory=True)
    assert from_memory["_checkpoint"]["source"] == "memory" and from_memory["step"] == 3
    _same(_everything(model, opt, sched, guard), want)
    assert math.isnan(guard.state["ema"]["grad_norm"])
    # The restored optimizer does not share the copy's buffers: training on does not change it.
    _train(model, opt, sched, 2)
    diverge()
    assert ckpt.load("last_good", resume_event=False, from_memory=True)["_checkpoint"]["source"] == "memory"
    _same(_everything(model, opt, sched, guard), want)

    # A relaunch has no copy: it verifies the files, and refuses the damaged one.
    relaunch = CheckpointManager(acc, str(tmp_path), CheckpointConfig(keep=2))
    for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched), ("vidstab", guard)):
        relaunch.register(name, obj)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        relaunch.load("last_good", from_memory=True)

    # Over the budget: the files, said once at the first rollback.
    small = CheckpointManager(acc, str(tmp_path / "small"), CheckpointConfig(rollback_memory_budget_bytes=64))
    small.register("model", model)
    small.save(1, healthy=True)
    with caplog.at_level(logging.WARNING, logger="vidstab.checkpoint"):
        for _ in range(2):
            assert small.load("last_good", resume_event=False, from_memory=True)["_checkpoint"]["source"] == "files"
    said = [r.getMessage() for r in caplog.records if "not from host memory" in r.getMessage()]
    assert len(said) == 1 and "rollback_memory_budget_bytes=64" in said[0], said


def test_an_in_place_rollback_from_memory_takes_the_same_trajectory_as_one_from_files(tmp_path, monkeypatch):
    """attach(..., rollback_every=4) with a real guard: every step after the rollback, bitwise, either way."""
    attach = vidstab.attach
    runs = {}
    for source in ("memory", "files"):

        def attach_with(*args, _source=source, **kwargs):
            guard = attach(*args, **kwargs)
            if _source == "files":
                guard.auto_rollback.ckpt.memory = None  # rollback_memory_budget_bytes=0
            return guard

        monkeypatch.setattr(vidstab, "attach", attach_with)
        AcceleratorState._reset_state(True)
        out = tmp_path / source
        acc, model, opt, sched, guard, seen = _loop(out, bad_lr_steps=set(range(10, 16)), steps=20)
        (rollback,) = _kinds(out, "rollback")
        assert rollback["source"] == source and rollback["restore_seconds"] >= 0
        runs[source] = seen, guard.state_dict()
        guard.close()
    (mem, mem_guard), (files, files_guard) = runs["memory"], runs["files"]
    assert [{k: v for k, v in s.items() if k != "weights"} for s in mem] == \
        [{k: v for k, v in s.items() if k != "weights"} for s in files]
    assert all(torch.equal(a, b) for s, t in zip(mem, files) for a, b in zip(s["weights"], t["weights"]))
    assert repr(mem_guard) == repr(files_guard)
