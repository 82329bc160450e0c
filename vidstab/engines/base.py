"""The engine interface, and its plain implementation: one process or DDP under Accelerate (see the package)."""

from __future__ import annotations

from typing import Any

import torch

from .. import signals
from ..recovery.oom import StepMarks, WriteOrder


class Engine:
    """Plain PyTorch under Accelerate (one process or DDP): the optimizer steps itself, every rank holds every
    weight, checkpoints are full state. The other engines override what differs.

    Built once by :func:`vidstab.engines.engine_for` with the accelerator's own ``backward`` and
    ``clip_grad_norm_`` as they are then (before ``attach`` wraps them): the guard always calls these."""

    name = "plain"
    sharded = False
    """Whether each rank holds a part of the weights: statistics over them add over ranks."""
    steps_at_backward = False
    """Whether Accelerate steps the optimizer inside the last micro-step's ``accelerator.backward``: the attached
    form then judges the step there, and the user's ``optimizer.step()`` does nothing."""
    not_rerun: str | None = None
    """Why a skipped step cannot be re-run on this engine (None: it can)."""
    fixed_world_size: str | None = None
    """Why this engine's checkpoints resume on the same number of processes only, whatever
    ``allow_world_size_change`` says (None: that option decides)."""

    def __init__(self, accelerator: Any, model: Any = None, params: list | None = None) -> None:
        self.accelerator, self.model = accelerator, model
        self.params = params if params is not None else list(model.parameters()) if model is not None else []
        self.original_backward = accelerator.backward
        self.original_clip = accelerator.clip_grad_norm_

    # ------------------------------------------------------------------ the step (the guard, both forms)
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The backward of a micro-step: Accelerate's own (it never steps the optimizer here)."""
        self.original_backward(loss, **kwargs)

    def pre_step_norm(self, max_grad_norm: float | None) -> tuple[torch.Tensor | None, float | None]:
        """``(norm, max_norm)``: the global pre-clip gradient norm, clipped to ``max_grad_norm`` on the way (None: not
        clipped): what the guard judges before any weight changes."""
        return signals.global_grad_norm(self.accelerator, self.params, max_grad_norm, clip=self.original_clip), max_grad_norm

    def optimizer_step(self, optimizer: Any) -> Any:
        """The call that applies a judged step: the optimizer's own ``step`` (taken before ``attach`` wraps it)."""
        return optimizer.step

    def skip(self) -> None:
        """What the engine itself must do to drop a judged step, beyond dropping the gradients: nothing here."""

    def step_weights(self) -> list[torch.Tensor]:
        """The weights the optimizer steps, as the parameter-norm probe measures them: the trainable parameters."""
        return [p for p in self.params if p.requires_grad]

    def step_marks(self, order: WriteOrder, trainable: list[torch.Tensor]) -> StepMarks | None:
        """What tells whether an out-of-memory inside the step touched anything (None: such an OOM is not judged
        per rank): the step runs on this rank alone, so it can be judged and skipped."""
        return StepMarks(order, trainable)

    def optimizer_oom_stop(self, step: int, rank: int, exc: BaseException) -> Exception | None:
        """The error that ends the process after an out-of-memory inside the step where no skip or rollback can be
        had in lockstep (None: the step is judged and skipped like any other)."""
        return None

    def save_state_caveat(self) -> str | None:
        """Why the user's own ``accelerator.save_state`` would not resume this run correctly (None: it does)."""
        return None

    # ------------------------------------------------------------------ checkpoints (CheckpointManager)
    def refuse_checkpoints(self) -> None:
        """Raise :class:`~vidstab.checkpoint.CheckpointError` for a set-up vidstab's checkpoints cannot serve (at
        the manager's construction: never a hang later)."""

    def checkpoint_backends(self, config: Any) -> dict[str, Any]:
        """Every backend this engine's checkpoints may be saved or loaded with, by manifest name."""
        from ..checkpoint.dcp_backend import ShardedBackend
        from ..checkpoint.full_state import FullStateBackend

        full, sharded = FullStateBackend(self.accelerator, config), ShardedBackend(self.accelerator, config)
        return {full.name: full, sharded.name: sharded}

    def save_backend(self, backends: dict[str, Any], objects: dict[str, Any], config: Any) -> Any:
        """The backend the next save uses: sharded (DCP) when a registered model has DTensor parameters (FSDP2
        sharded outside Accelerate included) or ``CheckpointConfig.sharded`` says so, else full state."""
        from ..checkpoint.dcp_backend import ShardedBackend, has_dtensor_params

        want = config.sharded
        if want is None:
            want = any(isinstance(o, torch.nn.Module) and has_dtensor_params(self.accelerator.unwrap_model(o))
                       for o in objects.values())
        return backends[ShardedBackend.name] if want else backends["full"]

    def load_backend(self, kind: str | None, backends: dict[str, Any]) -> Any:
        """The backend that reads a checkpoint whose manifest names backend ``kind``."""
        from ..checkpoint.config import CheckpointError
        from ..checkpoint.dcp_backend import ShardedBackend

        if kind == "deepspeed":
            raise CheckpointError("written by a DeepSpeed run; this run does not use DeepSpeed")
        return backends[ShardedBackend.name] if kind == ShardedBackend.name else backends["full"]

    def params_finite(self, objects: dict[str, Any]) -> bool:
        """Whether this rank's (local shards of the) registered models' parameters are all finite."""
        from ..checkpoint.dcp_backend import all_finite

        return all_finite(p for o in objects.values() if isinstance(o, torch.nn.Module) for p in o.parameters())

    def refuse_registered(self, name: str, obj: Any) -> None:
        """Raise :class:`~vidstab.checkpoint.CheckpointError` for an object this engine's checkpoints cannot keep:
        on every engine, the modules of engines vidstab does not serve."""
        from ..checkpoint.config import CheckpointError

        kind = type(obj).__name__
        if kind == "PipelineEngine":
            raise CheckpointError(f"cannot register {name!r}: DeepSpeed's pipeline engine is not supported (its "
                                  "train_batch() leaves no point between the gradients and the update)")
        if kind == "FullyShardedDataParallel":
            raise CheckpointError(f"cannot register {name!r}: FSDP1 modules are not supported; use FSDP2 (fully_shard, "
                                  "or accelerate launch --use_fsdp --fsdp_version 2)")
