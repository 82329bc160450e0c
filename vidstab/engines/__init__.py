"""One backend object per training engine: everything that differs between plain PyTorch/DDP, FSDP2 and
DeepSpeed ZeRO 1/2/3, behind one small interface (:class:`Engine`), chosen once by :func:`engine_for`.

The guard builds its engine at construction (``Guard(...)``, which both ``vidstab.attach`` and the explicit form
build), the checkpoint manager at its own (``CheckpointManager(...)``, which ``Recovery`` and ``attach(...,
rollback_every=N)`` roll back through). Neither tests which engine it runs on: each asks its engine. The
manager's engine, built without a model, is asked about checkpoints only; the guard's about its step only.

=====================  ===================================================================================
:class:`Engine`        plain PyTorch under Accelerate: one process or DDP (the default the others depart from)
:class:`FSDPEngine`    FSDP2: each rank holds shards (DTensor parameters), checkpoints through DCP
:class:`ZeroEngine`    DeepSpeed ZeRO 1/2/3: the guard steps the engine itself; checkpoints of its partitions
=====================  ===================================================================================
"""

from __future__ import annotations

from typing import Any

from .. import signals
from .deepspeed_support import is_deepspeed
from .base import Engine
from .fsdp import FSDPEngine
from .zero import ZeroEngine

__all__ = ["Engine", "FSDPEngine", "ZeroEngine", "engine_for"]


def engine_for(accelerator: Any, model: Any = None, params: list | None = None) -> Engine:
    """The engine ``accelerator`` trains through (``model``: the prepared model, when the caller has one;
    ``params``: its parameters as the caller holds them). The one place that tells the engines apart."""
    if is_deepspeed(accelerator):
        return ZeroEngine(accelerator, model, params)
    params = params if params is not None else list(model.parameters()) if model is not None else []
    if str(getattr(accelerator, "distributed_type", "")).endswith("FSDP") or any(signals.is_dtensor(p) for p in params):
        return FSDPEngine(accelerator, model, params)
    return Engine(accelerator, model, params)
