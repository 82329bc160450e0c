"""An out-of-memory in the forward of the unmodified attached loop: a skipped step, not a traceback.

The user's own code calls ``model(batch)`` and builds the loss from what it returns; vidstab cannot re-run that
code, but it owns the model's ``forward`` (wrapped on the instance by ``attach``). When the forward runs out of
memory with grad enabled, its memory is released and a stand-in output is returned: the model run again on one
zero sample (with the same non-floating inputs), times zero, repeated to the batch's size, in the structure the
forward returns. The loop's loss and ``accelerator.backward`` (or ``guard.backward``) then run as always: the gradients are zero,
the collectives of a DDP backward match the other ranks', and the guard records the micro-step as an OOM, so the
``oom`` detector skips the step on every rank (no rollback) and after a few OOMs in one bucket names the
micro-batch to use. A forward that runs out of memory on one sample re-raises (nothing smaller to run).

Under FSDP2 or ZeRO-3 a forward gathers each layer's weights from the other ranks: an OOM part-way through leaves
the ranks in different collectives, so this only holds where the OOM strikes before the first layer runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils import _pytree

from ..recovery.oom import is_oom, micro_batch_size, release

if TYPE_CHECKING:
    from .core import Guard


class ForwardOOM:
    """Stands in for the wrapped model's ``forward``; :attr:`pending` holds the OOM the next backward reports."""

    def __init__(self, guard: "Guard", forward: Callable[..., Any]) -> None:
        self.guard, self.forward = guard, forward
        self.pending: BaseException | None = None
        self.active = True
        """False inside :meth:`off`: an OOM reaches the caller (a preflight measuring whether a bucket fits)."""
        functools.update_wrapper(self, forward)  # inspect.signature(model.forward) still reads the model's

    def __deepcopy__(self, memo: dict) -> Any:
        """A copy of the model (an EMA, a validation copy) gets the model's own forward, not the guard."""
        return copy.deepcopy(self.forward, memo)

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Let an OOM in the forward reach the caller while inside (``vidstab audit``'s preflight, for one)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def take(self) -> BaseException | None:
        """The OOM of a forward since the last backward (``None``: none), once."""
        error, self.pending = self.pending, None
        return error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.active and self.guard.config.enabled and torch.is_grad_enabled()):
            return self.forward(*args, **kwargs)
        error = None
        try:
            return self.forward(*args, **kwargs)
        except Exception as exc:
            if not is_oom(exc):
                raise
            error = exc
        size = micro_batch_size([*args, *kwargs.values()])
        if size is None or size < 2:
            raise error
        release(error, self.guard.accelerator.device)  # the failed forward's activations, the allocator's cache
        one = self.forward(*_first_sample(args, size), **_first_sample(kwargs, size))
        self.pending = error
        return _pytree.tree_map(lambda t: _repeat(t, size), one)


def _first_sample(values: Any, size: int) -> Any:
    """One sample of every tensor with the batch's leading size: floating ones zero, the others as given."""
    def first(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != size:
            return t
        return torch.zeros_like(t[:1]) if t.is_floating_point() else t[:1]

    if isinstance(values, dict):
        return {k: first(v) for k, v in values.items()}
    return tuple(first(v) for v in values)


def _repeat(t: Any, size: int) -> Any:
    """A stand-in output tensor: zero (still on the graph, so every weight gets a gradient), ``size`` samples."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() == 0 or t.shape[0] != 1:
        return t
    return (t * 0.0).expand(size, *t.shape[1:]).contiguous()
