"""DeepSpeed ZeRO 1/2/3 (see the package): the guard steps the engine itself, checkpoints hold each rank's
partitions. The engine internals it reads live in :mod:`vidstab.engines.deepspeed_support` (tested versions only)."""

from __future__ import annotations

from typing import Any

import torch

from . import deepspeed_support
from .base import Engine


class ZeroEngine(Engine):
    """DeepSpeed ZeRO stage 1, 2 or 3 under Accelerate. Accelerate's ``accelerator.backward`` steps the engine
    itself, so the guard takes the backward without that step, reads the ZeRO optimizer's own pre-step norm, and
    applies or skips through :class:`~vidstab.engines.deepspeed_support.EngineStep` (skip: DeepSpeed's overflow path).
    Norms and finiteness read only the real elements of each partition (ZeRO-3 leaves the padding unwritten)."""

    name = "deepspeed"
    sharded = True
    steps_at_backward = True
    not_rerun = "under DeepSpeed a rerun would have to go through the engine's own forward and backward: not re-run"
    fixed_world_size = ("A DeepSpeed checkpoint of vidstab holds each rank's ZeRO partitions and resumes on the same "
                        "number of processes only (allow_world_size_change does not apply)")

    def __init__(self, accelerator: Any, model: Any = None, params: list | None = None) -> None:
        super().__init__(accelerator, model, params)
        self.step = deepspeed_support.EngineStep(accelerator, deepspeed_support.engine_of(accelerator, model))
        """The way into the engine's optimizer step (refuses, at construction, what is untested)."""
        self.checkpoint: Any = None  # the DeepSpeed checkpoint backend, once the manager asks for its backends

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward`` without the ``engine.step()`` Accelerate chains to it: the step is judged first."""
        self.step.backward(loss, **kwargs)

    def pre_step_norm(self, max_grad_norm: float | None) -> tuple[torch.Tensor | None, float | None]:
        """The ZeRO optimizer's own pre-step norm; DeepSpeed clips to its own ``gradient_clipping``, not
        ``max_grad_norm``."""
        return self.step.pre_step_norm(), self.step.max_grad_norm

    def optimizer_step(self, optimizer: Any) -> Any:
        """``engine.step()`` (Accelerate's ``optimizer.step()`` is a no-op under DeepSpeed)."""
        return self.step.apply

    def skip(self) -> None:
        """``engine.step()`` down DeepSpeed's own overflow path: gradients dropped, its counters and scheduler held."""
        self.step.skip()

    def step_weights(self) -> list[torch.Tensor]:
        """The fp32 master partitions, their padding left out: the module's ZeRO-3 parameters are empty."""
        return self.step.master_partitions()

    def step_marks(self, order: Any, trainable: list[torch.Tensor]) -> None:
        """None: DeepSpeed's step gathers partitions across ranks, so an OOM there leaves the peers waiting."""
        return None

    def optimizer_oom_stop(self, step: int, rank: int, exc: BaseException) -> Exception:
        """Always a stop: the engine updates this rank's partition, then gathers every rank's."""
        return self.step.oom_stop(step, rank, exc)

    def checkpoint_backends(self, config: Any) -> dict[str, Any]:
        """The others' and the DeepSpeed backend, which saves every checkpoint of a DeepSpeed run."""
        from ..checkpoint.deepspeed_backend import DeepSpeedBackend

        backends = super().checkpoint_backends(config)
        self.checkpoint = backends[DeepSpeedBackend.name] = DeepSpeedBackend(self.accelerator, config)
        return backends

    def save_backend(self, backends: dict[str, Any], objects: dict[str, Any], config: Any) -> Any:
        """The DeepSpeed backend, whatever is registered."""
        return backends["deepspeed"]

    def load_backend(self, kind: str | None, backends: dict[str, Any]) -> Any:
        """The DeepSpeed backend; a checkpoint of any other engine is refused (its partitions are not there)."""
        from ..checkpoint.config import CheckpointError

        if kind != "deepspeed":
            raise CheckpointError("not written by a DeepSpeed run; a DeepSpeed run loads only its own checkpoints")
        return backends["deepspeed"]

    def params_finite(self, objects: dict[str, Any]) -> bool:
        """The fp32 master partitions' real elements (the module's ZeRO-3 parameters are empty)."""
        return self.checkpoint.params_finite(objects)

    def refuse_registered(self, name: str, obj: Any) -> None:
        """An EMA at ZeRO-3 holds one rank's partition of the weights; a registered object is kept once for all."""
        from ..checkpoint.config import CheckpointError
        from ..recovery.script_state import is_ema

        super().refuse_registered(name, obj)
        plugin = getattr(getattr(self.accelerator, "state", None), "deepspeed_plugin", None)
        if getattr(plugin, "zero_stage", None) == 3 and is_ema(obj):
            raise CheckpointError(
                f"cannot register {name!r}: an EMA under DeepSpeed ZeRO-3 holds this rank's partition of the "
                "weights, and a registered object is kept once for all ranks; use ZeRO-1 or -2 with an EMA, or "
                "save it per rank in your own save/load-state hooks with vidstab.attach(..., rollback_every=N)")
