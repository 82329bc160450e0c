"""Two-process checkpoint check (run with `accelerate launch --multi_gpu --num_processes 2`).

Async and sync saves, per-rank RNG restore, and a write failure on rank 1 only: both ranks must raise
CheckpointError at the same call (no hang), earlier checkpoints stay, the next save works.
Prints "OK rank R" on success.
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


for mode in ("async", "sync"):
    check(os.path.join(sys.argv[1], mode), mode)
acc.end_training()
