"""Two-process checkpoint check (run with `accelerate launch --multi_gpu --num_processes 2`).

Async and sync saves, per-rank RNG restore, and a write failure on rank 1 only: both ranks must raise
CheckpointError at the same call (no hang), earlier checkpoints stay, the next save works.
Then a rollback from the in-memory copy restores the same bits as one from the files on every rank (weights, AdamW
moments, scheduler, replicated state, this rank's RNG); a damaged file does not matter to it, a relaunch's load
refuses it. Prints "OK rank R MODE" on success.
"""

import os
import resource
import signal
import sys

import torch
from accelerate import Accelerator

from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager

acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), 1e-2)
model, opt = acc.prepare(model, opt)


def check(out: str, mode: str) -> None:
    ckpt = CheckpointManager(acc, out, CheckpointConfig(async_save=mode == "async", keep=2))
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    torch.manual_seed(100 + acc.process_index)  # different RNG stream per rank
    for step in range(1, 4):
        acc.backward(model(torch.randn(4, 8)).square().mean())
        opt.step()
        opt.zero_grad()
        ckpt.save(step, healthy=True, trainer_state={"step": step})
    ckpt.wait()
    want_rng = torch.rand(3)
    want_w = acc.unwrap_model(model).weight.detach().clone()
    with torch.no_grad():
        acc.unwrap_model(model).weight.zero_()
    state = ckpt.load("latest")
    assert state["step"] == 3, state
    assert torch.equal(acc.unwrap_model(model).weight, want_w)
    assert torch.equal(torch.rand(3), want_rng), "per-rank RNG not restored"
    names = set(os.listdir(os.path.join(out, "vidstab", "checkpoints", "step_000003")))
    assert {"rng-rank0.safetensors", "rng-rank1.safetensors", "rng-rank0.json", "rng-rank1.json"} <= names, names

    # Rank 1 cannot write (file size limit): every rank must get the error at the same call.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if acc.process_index == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        ckpt.save(4, healthy=True, trainer_state={"step": 4})
        ckpt.wait()
        raise SystemExit(f"rank {acc.process_index}: expected CheckpointError")
    except CheckpointError as e:
        print(f"rank {acc.process_index} got: {e}", flush=True)
        assert "step_000004" in str(e)
    if acc.process_index == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    acc.wait_for_everyone()
    root = os.path.join(out, "vidstab", "checkpoints")
    assert open(os.path.join(root, "latest")).read().strip() == "step_000003"
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")], os.listdir(root)
    ckpt.save(5, healthy=True, trainer_state={"step": 5})
    ckpt.wait()
    assert ckpt.load("latest")["step"] == 5
    print(f"OK rank {acc.process_index} {mode}", flush=True)


class Replicated:
    def __init__(self):
        self.state = {"lr_multiplier": 1.0, "seen": [1, 2]}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, d):
        self.state = dict(d)


def memory_check(out: str) -> None:
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    guard = Replicated()

    def train(steps):
        for _ in range(steps):
            acc.backward(model(torch.randn(4, 8)).square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()

    def everything():
        st = opt.state_dict()
        return ({k: v.clone() for k, v in model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in st["state"].items()},
                st["param_groups"], sched.state_dict(), dict(guard.state), torch.get_rng_state())

    def manager():
        m = CheckpointManager(acc, out, CheckpointConfig(keep=2))
        for name, obj in (("model", model), ("optimizer", opt), ("lr_scheduler", sched), ("vidstab", guard)):
            m.register(name, obj)
        return m

    def diverge():
        torch.manual_seed(50 + acc.process_index)
        train(2)
        guard.state = {"lr_multiplier": 0.5}

    ckpt = manager()
    torch.manual_seed(10 + acc.process_index)  # each rank its own RNG stream
    train(3)
    ckpt.save(3, healthy=True, trainer_state={"step": 3})
    train(1)
    ckpt.save(4, healthy=False, trainer_state={"step": 4})
    ckpt.wait()
    assert ckpt.memory.name == "step_000003", ckpt.memory.name
    diverge()
    assert ckpt.load("last_good", resume_event=False)["_checkpoint"]["source"] == "files"
    want = everything()
    acc.wait_for_everyone()
    if acc.is_main_process:
        path = os.path.join(out, "vidstab", "checkpoints", "step_000003", "optimizer.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[:-8] + b"\0" * 8)
    acc.wait_for_everyone()
    diverge()
    state = ckpt.load("last_good", resume_event=False, from_memory=True)
    assert state["_checkpoint"]["source"] == "memory" and state["step"] == 3, state
    got = everything()
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0]), "weights"
    assert all(torch.equal(got[1][i][k], want[1][i][k]) for i in want[1] for k in want[1][i]), "optimizer"
    assert got[2:5] == want[2:5], "param groups, scheduler, replicated state"
    assert torch.equal(got[5], want[5]), "RNG"
    try:
        manager().load("last_good", from_memory=True)  # a relaunch: no copy, the files are verified
        raise SystemExit("the relaunch loaded a damaged checkpoint")
    except CheckpointError as e:
        assert "optimizer.safetensors" in str(e) or not acc.is_main_process, e  # the main process verified it
    print(f"OK rank {acc.process_index} memory", flush=True)


for mode in ("async", "sync"):
    check(os.path.join(sys.argv[1], mode), mode)
memory_check(os.path.join(sys.argv[1], "memory"))
acc.end_training()
