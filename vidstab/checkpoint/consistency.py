"""One source of truth for replicated state after a load: every rank's copy hashed and compared.

The guard's detector statistics, the recovery's LR multiplier and retries, the scheduler and the trainer
state must be identical on every rank, or the ranks decide differently (one skips a step another applies:
replicas diverge without an error). They all come from the files the main process wrote, but a rank on
another node reads its own copy when folders are node-local (``ProjectConfiguration(save_on_each_node=True)``),
and a stale or different copy there used to go unnoticed. After every load, each rank hashes each
replicated object's state (sha256 of its pickle-free encoding, :mod:`vidstab.files.statedict_io`), the hashes
are compared across ranks, and a copy that differs from rank 0's is either replaced by rank 0's (its
encoding broadcast as bytes: safetensors + JSON, never a pickle) or refused with an error naming the object
and the ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch

from ..files import statedict_io as sio
from .config import CheckpointError

__all__ = ["encode_state", "decode_state", "ensure_identical"]

logger = logging.getLogger("vidstab.checkpoint")


def encode_state(state: Any) -> bytes:
    """Deterministic pickle-free bytes of a state dict: ``len(json) | json | safetensors`` of its tensors."""
    from safetensors.torch import save

    tensors, structure = sio.flatten(state, prefix="t")
    head = sio.dumps(structure)
    body = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}) if tensors else b""
    return len(head).to_bytes(8, "little") + head + body


def decode_state(data: bytes) -> Any:
    """Inverse of :func:`encode_state`."""
    from safetensors.torch import load

    n = int.from_bytes(data[:8], "little")
    structure = json.loads(data[8 : 8 + n])
    return sio.unflatten(structure, load(data[8 + n :]) if len(data) > 8 + n else {})


def _digest(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)


def _broadcast_bytes(data: bytes | None, rank: int, group) -> bytes:
    import torch.distributed as dist

    size = torch.tensor([len(data) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0
           else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=group)
    return bytes(buf.numpy())


def ensure_identical(states: dict[str, Any], rank: int, world_size: int, group, repair: bool = True
                     ) -> tuple[dict[str, Any], list[str]]:
    """Make the loaded ``states`` (name -> state dict about to be applied, e.g. the guard's, the scheduler's,
    the trainer state) identical on every rank; all ranks call this together, on ``group``, before anything
    is applied (a no-op at world size 1). What is compared is what each rank read, not the objects after
    loading: an object may keep rank-local counters across a load (the guard's incident budget).

    Returns ``(states, repaired names)``: a state that differs from rank 0's is replaced by rank 0's
    (``repair``) or refused with :class:`CheckpointError` naming it and the ranks that differ."""
    if world_size == 1:
        return states, []
    import torch.distributed as dist

    names = sorted(states)
    blobs = {n: encode_state(states[n]) for n in names}
    mine = torch.stack([_digest(blobs[n]) for n in names])
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    out, repaired = dict(states), []
    for i, n in enumerate(names):
        differ = [r for r in range(1, world_size) if not torch.equal(gathered[r][i], gathered[0][i])]
        if not differ:
            continue
        if not repair:
            raise CheckpointError(f"after loading, {n!r} differs between rank 0 and rank(s) {differ} (node-local "
                                  "checkpoint folders out of step?); refusing to train with replicas that disagree")
        data = _broadcast_bytes(blobs[n] if rank == 0 else None, rank, group)
        if rank in differ:
            out[n] = decode_state(data)
            logger.warning("rank %d: %r as read differed from rank 0's; using rank 0's", rank, n)
        repaired.append(n)
    return out, repaired
