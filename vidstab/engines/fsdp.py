"""FSDP2 (see the package): each rank holds shards of the weights (DTensor parameters)."""

from __future__ import annotations

from typing import Any

from .base import Engine


class FSDPEngine(Engine):
    """FSDP2 through Accelerate (``--use_fsdp --fsdp_version 2``) or ``fully_shard`` outside it. The step is the
    plain one (Accelerate's clip makes the sharded norm full); the sums over the shards add over ranks, and a
    registered model's checkpoints go through DCP (:meth:`Engine.save_backend`)."""

    name = "fsdp2"
    sharded = True

    def save_state_caveat(self) -> str | None:
        """Sharded with ``fully_shard`` outside Accelerate, the user's ``save_state`` keeps rank 0's optimizer shards
        only."""
        from ..checkpoint.dcp_backend import has_dtensor_params

        if self.model is None or not has_dtensor_params(self.model) or getattr(self.accelerator, "is_fsdp2", False):
            return None
        if not getattr(self.accelerator, "_optimizers", None):  # an optimizer Accelerate does not hold, it does not save
            return None
        return ("the model is sharded with fully_shard outside Accelerate, so your accelerator.save_state saves rank 0's "
                "optimizer shards only and a resume from it would load them on every rank. To resume, use the explicit "
                "form (CheckpointManager + Recovery: sharded checkpoints) or shard through Accelerate (accelerate "
                "launch --use_fsdp --fsdp_version 2)")

    def refuse_checkpoints(self) -> None:
        """FSDP1's flat parameters are not DTensors: DCP's sharded checkpoints serve FSDP2 only."""
        from ..checkpoint.config import CheckpointError

        plugin = getattr(getattr(self.accelerator, "state", None), "fsdp_plugin", None)
        if plugin is not None and int(getattr(plugin, "fsdp_version", 1) or 1) < 2:
            raise CheckpointError("vidstab checkpoints serve FSDP2 (DTensor parameters, saved with DCP), not FSDP1: "
                                  "launch with --fsdp_version 2")
