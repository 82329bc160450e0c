"""The weights' norm and the last update's, measured around the optimizer step every ``param_norm_every`` steps.

``param_growth``, ``nonfinite_params`` and ``update_ratio`` read the global parameter norm and the norm of the
update the optimizer just applied. On a measured step the guard copies the local parameters before the step
(:meth:`ParamProbe.snapshot`) and takes both sums of squares after it (:meth:`ParamProbe.sums`), on the device,
left there for the next step's one host read: a few foreach ops over the whole parameter list (multi-tensor
kernels on CUDA).

The sums are of the *local* tensors: under FSDP2 each rank holds a shard, and the guard's reduction adds the
ranks' sums before the square root is taken (:func:`vidstab.guard.stats.build_stats`, ``sharded``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..signals import is_dtensor, local_tensor, sum_of_squares


class ParamProbe:
    """Sums of squares of a fixed list of (trainable) parameters and of their change across one optimizer step.

    Args:
        params: the parameters to measure (the model's trainable ones); empty ones are left out when the first
            measurement is taken (a lazy module has no size before its first forward).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.all_params = list(params)
        self.params: list[torch.nn.Parameter] | None = None

    def __bool__(self) -> bool:
        """Whether there are parameters to measure."""
        return bool(self.all_params)

    def _local(self) -> list[torch.Tensor]:
        """The local tensors to read (an FSDP2 shard, or the parameter itself)."""
        if self.params is None:
            self.params = [p for p in self.all_params if p.numel() > 0]
        return [local_tensor(p) if is_dtensor(p) else p for p in self.params]

    @torch.no_grad()
    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the local parameters, taken right before the optimizer step, for :meth:`sums` only."""
        return [t.clone() for t in self._local()]

    @torch.no_grad()
    def sums(self, before: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sum of squares of the parameters, sum of squares of their change since before)`` as 0-d float32
        device tensors (the second ``None`` without ``before``); ``before`` is overwritten."""
        cur = self._local()
        if not cur:
            zero = torch.zeros(())
            return zero, (zero if before is not None else None)
        if before is not None:
            torch._foreach_sub_(before, cur)
        return sum_of_squares(cur), (sum_of_squares(before) if before is not None else None)
