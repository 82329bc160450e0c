"""The weights' norm and the last update's, measured around the optimizer step every ``param_norm_every`` steps.

``param_growth``, ``nonfinite_params`` and ``update_ratio`` read the global parameter norm and the norm of the
update the optimizer just applied. On a measured step the guard copies the local parameters before the step
(:meth:`ParamProbe.snapshot`) and takes both sums of squares after it (:meth:`ParamProbe.sums`), on the device,
left there for the next step's one host read. Each is a handful of foreach ops over the whole parameter list,
with no Python call per tensor (it was a ``detach``/``clone``/``.float()`` per tensor). On CUDA a foreach op is a
multi-tensor kernel: about 6 launches instead of about 90 on the 18-tensor transformer of
``benchmarks/bench_guard_overhead.py``. On a CPU a foreach op is still one kernel per tensor: a measured step cost
0.15-0.3 ms more than a healthy one there with foreach ops alone. So on a CPU, for models up to
:data:`FLAT_MAX_NUMEL` values, the probe copies the parameters into the rows of one flat buffer instead (one
``_foreach_copy_`` into views of a row, made at the first measurement) and takes both sums with one subtraction
and one norm over the buffer, whatever the number of tensors: snapshot and sums 281 -> 174 us on the transformer,
cold, and a measured step about 0.06 ms more than a healthy one (``benchmarks/RESULTS.md``, "The weights' probe
in one buffer").

The sums are of the *local* tensors: under FSDP2 each rank holds a shard, and the guard adds the ranks' sums
before taking the square root (:func:`vidstab.guard.stats.build_stats`, ``sharded``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..signals import is_dtensor, local_tensor, sum_of_squares

_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
# One multi-tensor copy where torch has it (a fused kernel on CUDA); a clone per tensor where it does not.
_foreach_clone = getattr(torch, "_foreach_clone", None) or (lambda tensors: [t.clone() for t in tensors])

FLAT_MAX_NUMEL = 1 << 22
"""Most parameter values a CPU probe copies into one flat buffer (two rows of them, kept from the first measurement
on: at most 32 MiB in float32). Past this the per-tensor kernels are a small part of the copies' own time, and
the buffer's memory is not worth keeping."""


class ParamProbe:
    """Sums of squares of a fixed list of (trainable) parameters and of their change across one optimizer step.

    Args:
        params: the parameters to measure (the model's trainable ones); empty ones are left out when the first
            measurement is taken.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.all_params = list(params)
        self._prepared = False

    def __bool__(self) -> bool:
        """Whether there are parameters to measure (their sizes are read at the first measurement)."""
        return bool(self.all_params)

    def _prepare(self) -> None:
        """Read the parameters' layout on the first measurement, not at attach: a lazy module's parameters
        (``nn.LazyLinear``) have no size until the first forward."""
        self.params = [p for p in self.all_params if p.numel() > 0]
        self.sharded = any(is_dtensor(p) for p in self.params)
        # One foreach call needs one device; the rare model spread over several takes the per-device path.
        self._one_device = len({p.device for p in self.params}) <= 1
        # Norms in float32 whatever the weights' precision (a bfloat16 norm keeps about three digits); a float64
        # model keeps its own (foreach_norm refuses to narrow).
        self._norm_kwargs = {"dtype": torch.float32} if all(p.dtype in _LOW_PRECISION for p in self.params) else None
        # A CPU runs a foreach op as one kernel per tensor: there, one flat buffer (module docstring), sized by the
        # local tensors (an FSDP2 parameter's numel() is the whole tensor's, its shard is smaller), with views of
        # its rows shaped like them, made once.
        local = self._local()
        total = sum(t.numel() for t in local)
        self._buffer: torch.Tensor | None = None
        if ({t.device.type for t in local} == {"cpu"} and len({t.dtype for t in local}) == 1
                and total <= FLAT_MAX_NUMEL):
            self._buffer = torch.empty(2, total, dtype=local[0].dtype)
            sizes = [t.numel() for t in local]
            self._rows = [[v.view(t.shape) for v, t in zip(row.split(sizes), local)] for row in self._buffer]
        self._prepared = True

    def _local(self) -> list[torch.Tensor]:
        """The tensors to read: the parameters themselves (autograd is off where they are read), or the shards."""
        if self.sharded:
            return [local_tensor(p) for p in self.params]
        return self.params

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the local parameters, taken right before the optimizer step, for :meth:`sums` only (one
        foreach op; on a CPU, into the second row of the probe's flat buffer, which the next snapshot overwrites)."""
        if not self._prepared:
            self._prepare()
        if not self.params:
            return []
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            local = self._local()
            if self._buffer is not None:  # the buffer's second row
                torch._foreach_copy_(self._rows[1], local)
                return [self._buffer]
            return list(_foreach_clone(local))
        finally:
            torch._C._set_grad_enabled(grad)

    def sums(self, before: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sum of squares of the parameters, sum of squares of their change since before)`` as 0-d float32
        device tensors (the second ``None`` without ``before``); ``before`` is overwritten."""
        if not self._prepared:
            self._prepare()
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            cur = self._local()
            if not cur:
                zero = torch.zeros(())
                return zero, (zero if before is not None else None)
            if self._buffer is not None:
                return self._flat_sums(cur, before)
            if not self._one_device or self._norm_kwargs is None:
                if before is not None:
                    torch._foreach_sub_(before, cur)
                return sum_of_squares(cur), (sum_of_squares(before) if before is not None else None)
            if before is None:
                v = torch.stack(torch._foreach_norm(cur, 2, **self._norm_kwargs))
                return torch.dot(v, v), None
            torch._foreach_sub_(before, cur)
            v = torch.stack(torch._foreach_norm([*before, *cur], 2, **self._norm_kwargs))
            sq = (v * v).view(2, len(cur)).sum(1)
            return sq[1], sq[0]
        finally:
            torch._C._set_grad_enabled(grad)

    def _flat_sums(self, cur: list[torch.Tensor], before: list[torch.Tensor] | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`sums` through the flat buffer: the parameters copied into its first row (one foreach copy into
        views made once), the change into its second, one norm per row (float32, or float64 for a float64 model)."""
        both = self._buffer
        torch._foreach_copy_(self._rows[0], cur)
        if before is None:
            n = torch.linalg.vector_norm(both[0], 2, **(self._norm_kwargs or {}))
            return (n * n).float(), None
        both[1].sub_(both[0])
        sq = torch.linalg.vector_norm(both, 2, 1, **(self._norm_kwargs or {})).square()
        if sq.dtype is not torch.float32:
            sq = sq.float()
        return sq[0], sq[1]
