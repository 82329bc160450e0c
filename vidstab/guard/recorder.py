"""Recording a step: what the micro-steps of one accumulation window leave for their optimizer step.

The on-device statistics (:class:`vidstab.signals.Window`), references to each micro-batch for an incident
bundle (no copies: dropped after the step), the shape bucket, and this rank's own compute time
(:class:`vidstab.signals.StepClock`). Nothing here reads a value back to the host.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import torch

from .. import signals
from ..run.resume_check import batch_crc, host_ids


class MicroBatch(NamedTuple):
    """What an incident bundle needs of one micro-step (references only)."""

    batch: Mapping[str, Any] | None
    """Its tensors by name (``None`` when incident capture is off)."""
    sample_ids: Any
    error: BaseException | None


class StepRecorder:
    """The micro-steps of the current accumulation window of this rank."""

    def __init__(self, device: torch.device, config: Any) -> None:
        self.window = signals.Window(device, config.timestep_buckets, config.num_train_timesteps, config.input_keys)
        self.clock = signals.StepClock(device)
        self.capture = config.capture_incidents
        self.micro_batches: list[MicroBatch] = []
        self.bucket_name = "default"
        """This rank's name for the last packed window's shape bucket."""

    def record(self, loss: torch.Tensor, inputs: "Mapping[str, Any] | list[torch.Tensor] | None",
               batch: Mapping[str, Any] | None, sample_ids: Any = None, per_sample_loss: torch.Tensor | None = None,
               timesteps: torch.Tensor | None = None, error: BaseException | None = None,
               bucket: Any = None, oom: int = 0) -> None:
        """One micro-step after its backward: ``inputs`` are what its input statistics cover, ``batch`` what an
        incident bundle would hold; ``oom``: it ran out of memory with this many samples (``error`` is then None)."""
        self.micro_batches.append(MicroBatch(batch if self.capture else None, host_ids(sample_ids), error))
        self.window.record(loss, inputs, per_sample_loss, timesteps, error is not None, bucket, oom)

    @property
    def empty(self) -> bool:
        return not self.micro_batches

    def pack(self, grad_norm: torch.Tensor | None, *, stop: bool, param_sums: tuple, loss_scale: torch.Tensor | None,
             rank: int, lr: tuple) -> torch.Tensor:
        """This rank's vector for the step (:meth:`vidstab.signals.Window.pack`)."""
        self.bucket_name = self.window.shape_bucket
        return self.window.pack(grad_norm, stop=stop, param_sq=param_sums[0], update_sq=param_sums[1],
                                loss_scale=loss_scale, seconds=self.clock.seconds(), rank=rank, lr=lr,
                                batch_crc=batch_crc(m.sample_ids for m in self.micro_batches))

    def reset(self) -> None:
        """The step is over: drop the references and start the next window."""
        self.micro_batches.clear()
        self.window.reset()
