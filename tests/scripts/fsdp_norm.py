"""Launched by tests/test_fsdp_norm.py with torchrun on 2 CPU processes (gloo).

Builds the same model twice: a plain replica and an FSDP2 (``fully_shard``) copy on a 2-rank CPU mesh.
Both see the same input on every rank, so FSDP's averaged gradient equals the replica's gradient. The
guard's norm helpers (``vidstab.signals.global_grad_norm`` — the path ``guard.step`` takes, minus the
Accelerator — and the sharded parameter sum of squares) must reproduce the unsharded numbers.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vidstab import signals
from vidstab.run.exit_fence import register_exit_fence
from vidstab.guard.param_probe import ParamProbe


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    register_exit_fence()  # no guard here to register it: FSDP2 on gloo must not abort at exit
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 7), torch.nn.Linear(7, 5))
    sharded = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))  # same batch on every rank
    ref(x).square().mean().backward()
    sharded(x).square().mean().backward()

    ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    ref_param = math.sqrt(sum(float(p.detach().double().square().sum()) for p in ref.parameters()))
    is_dtensor = any(signals.is_dtensor(p) for p in sharded.parameters())
    # Same code path as guard.step (accelerator=None: Accelerate does not enable FSDP on CPU).
    norm = signals.global_grad_norm(None, list(sharded.parameters()), max_norm=None)
    psq = signals.sum_of_squares(list(sharded.parameters())).double().reshape(1)
    dist.all_reduce(psq)  # the guard sums the local-shard squares over ranks (via its gathered table)
    # The guard's weight probe across one optimizer step (the same step on both copies): its sums of squares of
    # the local shards, added over the ranks, are the whole model's (vidstab/guard/param_probe.py).
    probe = ParamProbe([p for p in sharded.parameters()])
    before = probe.snapshot()
    ref_before = [p.detach().clone() for p in ref.parameters()]
    for model in (ref, sharded):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    probe_sums = torch.stack(probe.sums(before)).double()
    dist.all_reduce(probe_sums)
    ref_after = math.sqrt(sum(float(p.detach().double().square().sum()) for p in ref.parameters()))
    ref_update = math.sqrt(sum(float((p.detach().double() - b.double()).square().sum())
                               for p, b in zip(ref.parameters(), ref_before)))
    clipped = signals.global_grad_norm(None, list(sharded.parameters()), max_norm=0.01 * ref_norm)
    after = float(signals.global_grad_norm(None, list(sharded.parameters()), max_norm=None))
    res = {"rank": rank, "is_dtensor": is_dtensor, "ref_norm": ref_norm, "norm": float(norm),
           "norm_is_plain": not signals.is_dtensor(norm), "ref_param": ref_param, "param": math.sqrt(float(psq)),
           "clipped_pre": float(clipped), "after_clip": after,
           "probe_param": math.sqrt(float(probe_sums[0])), "probe_update": math.sqrt(float(probe_sums[1])),
           "ref_param_after": ref_after, "ref_update": ref_update}
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
