"""Sharded (DCP) checkpoints of an FSDP2 model + optimizer; run with torchrun (2 processes) or plainly (1).

``fsdp_ckpt.py MODE OUT``:

- ``save2`` (2 processes, FSDP2 on a gloo CPU mesh): train, save sync and async, check that every rank
  wrote its own shard and that the state loads back bitwise (model, optimizer by parameter name, scheduler,
  JSON object); that an async save holds the state of its call; that a model of another shape is refused
  naming the parameter; that an async save with a NaN in one rank's shard at its call is unhealthy; that a
  rollback from the in-memory copy restores the bits of one from the files, a damaged shard file notwithstanding.
  Writes ``OUT/full-2.safetensors`` (full weights and optimizer moments).
- ``load1`` (1 process, a plain unsharded model): load that checkpoint (DCP reshards 2 -> 1), compare with
  ``full-2``, train a step, save (sharded) -> ``OUT/full-1.safetensors``.
- ``load2`` (2 processes, FSDP2): load the 1-process checkpoint (1 -> 2) and compare with ``full-1``.
Prints ``OK MODE rank R``.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from vidstab.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 12):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, hidden), torch.nn.Linear(hidden, 6)])
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


class JsonState:
    """Guard-like JSON-only state."""

    def __init__(self):
        self.state = {"lr_multiplier": 1.0, "window": (1, 2)}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, d):
        self.state = dict(d)


def build(acc, sharded: bool, hidden: int = 12):
    torch.manual_seed(0)
    model = Net(hidden)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (acc.num_processes,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched


def step(model, opt, sched, seed):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))  # same batch on every rank
    model(x).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def manager(acc, out, model, opt, sched, js, **kw):
    # Resharding across world sizes is what this script tests: the loop here has no data position or
    # per-process schedule to re-derive, so it opts in (CheckpointManager refuses a world-size change by default).
    kw.setdefault("allow_world_size_change", True)
    ckpt = CheckpointManager(acc, out, CheckpointConfig(**kw))
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    ckpt.register("lr_scheduler", sched)
    ckpt.register("vidstab", js)
    return ckpt


def full(model, opt) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights and Adam moments by parameter name."""
    def f(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().contiguous()
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"w.{n}": f(p) for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        out[f"m.{names[id(p)]}"] = f(st["exp_avg"])
        out[f"v.{names[id(p)]}"] = f(st["exp_avg_sq"])
    return out


def same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    sharded = mode != "load1"
    model, opt, sched = build(acc, sharded)
    js = JsonState()
    if mode == "save2":
        for s in range(2):
            step(model, opt, sched, s)
        js.state["lr_multiplier"] = 0.5
        ckpt = manager(acc, os.path.join(out, "two"), model, opt, sched, js, async_save=False)
        ckpt.save(2)
        step(model, opt, sched, 2)
        want, want_lr = full(model, opt), sched.get_last_lr()
        ckpt.config.async_save = True
        ckpt.save(3)
        with torch.no_grad():  # the async save must hold the state of its call, not this
            for p in model.parameters():
                p.add_(1.0)
        ckpt.wait()
        folder = os.path.join(out, "two", "vidstab", "checkpoints", "step_000003")
        names = sorted(os.listdir(os.path.join(folder, "dcp")))
        assert names == ["shard-00001-model-00001-of-00001.safetensors",
                         "shard-00002-model-00001-of-00001.safetensors"], names
        model2, opt2, sched2 = build(acc, True)
        js2 = JsonState()
        ck2 = manager(acc, os.path.join(out, "two"), model2, opt2, sched2, js2)
        assert ck2.load("latest")["_checkpoint"]["step"] == 3
        same(full(model2, opt2), want, "reload at world size 2")
        assert sched2.get_last_lr() == want_lr and js2.state == {"lr_multiplier": 0.5, "window": (1, 2)}
        if rank == 0:
            save_file(want, os.path.join(out, "full-2.safetensors"))
        # Another model shape: refused on every rank, naming the parameter, nothing applied.
        model3, opt3, sched3 = build(acc, True, hidden=10)
        ck3 = manager(acc, os.path.join(out, "two"), model3, opt3, sched3, JsonState())
        try:
            ck3.load(folder)
            raise SystemExit("expected CheckpointError")
        except CheckpointError as e:
            assert "model.blocks.0.weight" in str(e) or "blocks.0.weight" in str(e), e
            print(f"rank {rank} refused: {e}", flush=True)
        # An async save checks the parameters it staged, in its writer thread: a NaN in rank 1's shard at
        # the call makes that checkpoint unhealthy on every rank's word, even once the live one is gone.
        ck4 = manager(acc, os.path.join(out, "nan"), model, opt, sched, js, async_save=True)
        ck4.save(3)
        shard = model.blocks[0].weight.to_local()
        kept = shard[0, 0].item()
        with torch.no_grad():
            if rank == 1:
                shard[0, 0] = float("nan")
            ck4.save(4)
            shard[0, 0] = kept
        ck4.wait()
        if rank == 0:
            import json

            root = os.path.join(out, "nan", "vidstab", "checkpoints")
            man = json.load(open(os.path.join(root, "step_000004", "manifest.json")))
            assert man["params_finite"] is False and man["healthy"] is False, man
            assert json.load(open(os.path.join(root, "step_000003", "manifest.json")))["params_finite"] is True
            assert open(os.path.join(root, "last_good")).read().strip() == "step_000003"
        # A rollback from the in-memory copy (each rank's staged shards) restores the bits one from the files
        # does; a damaged shard file does not matter to it.
        ck5 = manager(acc, os.path.join(out, "mem"), model, opt, sched, js, async_save=True)
        step(model, opt, sched, 5)
        ck5.save(5)
        step(model, opt, sched, 6)
        ck5.save(6, healthy=False)
        ck5.wait()
        assert ck5.memory.name == "step_000005" and ck5.memory.staged is not None, ck5.memory.name
        step(model, opt, sched, 7)
        assert ck5.load("last_good", resume_event=False)["_checkpoint"]["source"] == "files"
        want5, lr5, js5, rng5 = full(model, opt), sched.get_last_lr(), dict(js.state), torch.get_rng_state()
        acc.wait_for_everyone()
        if rank == 0:
            dcp_dir = os.path.join(out, "mem", "vidstab", "checkpoints", "step_000005", "dcp")
            shard = os.path.join(dcp_dir, sorted(os.listdir(dcp_dir))[0])
            data = open(shard, "rb").read()
            open(shard, "wb").write(data[:-8] + b"\0" * 8)
        acc.wait_for_everyone()
        step(model, opt, sched, 8)
        js.state = {"lr_multiplier": 0.1}
        assert ck5.load("last_good", resume_event=False, from_memory=True)["_checkpoint"]["source"] == "memory"
        same(full(model, opt), want5, "rollback from memory")
        assert sched.get_last_lr() == lr5 and js.state == js5 and torch.equal(torch.get_rng_state(), rng5)
        print(f"OK memory rank {rank}", flush=True)
    elif mode == "load1":
        ckpt = manager(acc, os.path.join(out, "two"), model, opt, sched, js, sharded=True, async_save=False)
        assert ckpt.load("latest")["_checkpoint"]["step"] == 3
        same(full(model, opt), load_file(os.path.join(out, "full-2.safetensors")), "2 -> 1")
        step(model, opt, sched, 3)
        one = manager(acc, os.path.join(out, "one"), model, opt, sched, js, sharded=True)
        one.save(4)
        one.wait()
        save_file(full(model, opt), os.path.join(out, "full-1.safetensors"))
    elif mode == "load2":
        ckpt = manager(acc, os.path.join(out, "one"), model, opt, sched, js)
        assert ckpt.load("latest")["_checkpoint"]["step"] == 4
        same(full(model, opt), load_file(os.path.join(out, "full-1.safetensors")), "1 -> 2")
    print(f"OK {mode} rank {rank}", flush=True)
    acc.end_training()


if __name__ == "__main__":
    main()
