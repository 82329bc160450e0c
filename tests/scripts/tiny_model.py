"""The two-layer model the checkpoint scripts train: FSDP2-sharded per layer or DDP-prepared."""

import torch


def two_layer_model(acc, kind: str) -> torch.nn.Module:
    """``Sequential(Linear(8, 8), Linear(8, 8))`` seeded 0; ``kind`` ``fsdp``: ``fully_shard`` per layer and
    at the top on a CPU mesh of every process; else ``acc.prepare`` (DDP)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    if kind != "fsdp":
        return acc.prepare(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (acc.num_processes,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
