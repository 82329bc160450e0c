"""Out of memory: an incident of its own. What counts as one, and releasing the failed step's memory.

An OOM in the forward or the backward leaves the weights untouched: the step is skipped on every rank together
(the ``oom`` detector; no rollback, no LR change), its gradients are dropped, the references it held are freed
and the allocator's cache is emptied, so the next step starts from the memory a healthy step starts from. In the
unmodified attached loop the model's forward is wrapped so that an OOM there becomes such a step
(:mod:`vidstab.guard.forward_oom`). Inside ``optimizer.step()`` the judge is whether the update was applied
(:class:`StepMarks`): untouched on every rank, a skip; touched, or applied on some ranks only, a rollback at the
next step on every rank (the ``oom`` detector).
"""

from __future__ import annotations

import gc
from itertools import islice
from typing import Any

import torch

_MESSAGES = ("out of memory", "can't allocate memory", "failed to allocate", "not enough memory")
"""Lower-case fragments of the allocators' failure messages that surface as plain RuntimeErrors (CUDA/HIP
``CUDA out of memory``, XPU ``XPU out of memory``, MPS ``MPS backend out of memory``, the CPU allocator's
``DefaultCPUAllocator: can't allocate memory``, cuDNN/cuBLAS workspace failures)."""


def is_oom(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an out-of-memory failure of a device or host allocator."""
    if exc is None:
        return False
    if isinstance(exc, torch.OutOfMemoryError) or isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _MESSAGES)


def release(exc: BaseException | None = None, device: Any = None) -> None:
    """Free what a failed step holds: the exception's frames (its activations), then the allocator's cache of
    ``device`` (CUDA, XPU, MPS; nothing to empty on a CPU)."""
    if exc is not None:
        exc.__traceback__ = None
        exc.__context__ = exc.__cause__ = None
    gc.collect()
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if kind == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if kind == "mps" and hasattr(torch, "mps"):
        torch.mps.empty_cache()


def micro_batch_size(inputs: Any) -> int | None:
    """The leading size of the micro-batch's first floating input with the most dimensions (its samples)."""
    tensors = inputs.values() if isinstance(inputs, dict) else (inputs or [])
    best = None
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and (best is None or t.dim() > best.dim()):
            best = t
    return int(best.shape[0]) if best is not None else None



# ---------------------------------------------------------------- an OOM inside optimizer.step()
_VERSION = torch.Tensor._version.__get__  # a tensor's in-place modification counter (bumped under no_grad too)


IN_ORDER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""torch's own optimizers (these classes exactly, not subclasses: a subclass may step otherwise) whose step, in each
parameter group, writes the first parameter with a gradient of each device and dtype, or its state, before any
other tensor of that device and dtype (the per-parameter loop and the foreach kernels both go in order)."""


class WriteOrder:
    """Which tensors an ``optimizer.step()`` writes first, for :class:`StepMarks`: for an :data:`IN_ORDER` optimizer,
    the first parameter with a gradient of each (parameter group, device, dtype), found in per-group runs built once
    and again when a group's parameters change; for any other, all of them (None)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds torch's
        self.opaque = any(group.get("fused") for group in self.optimizer.param_groups)
        """Fused kernels do not bump the version counters: a failed fused step counts as touched."""
        self.in_order = type(self.optimizer) in IN_ORDER and not self.opaque
        self._runs: list[tuple[tuple[torch.device, torch.dtype], list[torch.Tensor]]] = []
        self._sizes: list[int] | None = None

    def _build(self, sizes: list[int]) -> None:
        self._runs = []
        for group in self.optimizer.param_groups:
            runs: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                runs.setdefault((p.device, p.dtype), []).append(p)
            self._runs.extend(runs.items())
        self._sizes = sizes

    def first_written(self) -> list[torch.Tensor] | None:
        """The parameters whose marks tell whether a step wrote anything (None: every parameter's)."""
        if not self.in_order:
            return None
        sizes = [len(group["params"]) for group in self.optimizer.param_groups]
        if sizes != self._sizes:
            self._build(sizes)
        first = []
        for key, run in self._runs:
            p = next((p for p in run if p.grad is not None), None)
            if p is None:
                continue
            if (p.device, p.dtype) != key:  # moved or cast since the runs were built: read every one this step
                self._sizes = None
                return None
            first.append(p)
        return first


class StepMarks:
    """What an ``optimizer.step()`` that raised has touched, from the tensors' in-place version counters.

    Taken before the step (no device work, no hashing: it runs on every step): the counters of the tensors the step
    writes first (:class:`WriteOrder`: a few for torch's in-order optimizers, else every weight and state tensor);
    after an exception, :meth:`judge` says whether any of them was modified, and drops the state the step created
    lazily (the first step's moments), so an untouched optimizer is exactly as it was. Fused kernels
    (``fused=True``) do not bump the counters: a failed fused step counts as touched (the safe side: a rollback).
    """

    def __init__(self, order: WriteOrder, params: list[torch.Tensor]) -> None:
        self.optimizer = order.optimizer
        self.entries = len(self.optimizer.state)  # a dict keeps insertion order: the step's new entries come after
        first = order.first_written()
        self.params = params if first is None else first
        state = self.optimizer.state
        self.keys = None if first is None else [p for p in first if p in state]
        """The marked parameters that had state before the step (None: every entry's)."""
        self.values = self._values()
        self.total = self._versions()
        self.opaque = order.opaque

    def _values(self) -> list[Any]:
        """The state's values of the (marked) parameters that had state before the step, in order."""
        state = self.optimizer.state
        if self.keys is not None:
            return [v for p in self.keys for v in state[p].values()]
        return [v for entry in islice(state.values(), self.entries) for v in entry.values()]

    def _versions(self) -> int:
        """The sum of the weights' and the state tensors' version counters (a state value may be a number)."""
        try:
            states = sum(map(_VERSION, self.values))
        except TypeError:
            states = sum(_VERSION(v) for v in self.values if isinstance(v, torch.Tensor))
        return sum(map(_VERSION, self.params)) + states

    def judge(self) -> bool:
        """Whether the failed step modified a weight or existing optimizer state: a tensor changed in place
        (versions only grow) or a state value replaced (``state["step"] += 1`` on a number). When it did not, the
        state entries it created are removed."""
        values = self._values()
        touched = (self.opaque or len(values) != len(self.values) or self._versions() != self.total
                   or any(a is not b for a, b in zip(values, self.values)))
        if not touched:
            state = self.optimizer.state
            for key in list(state)[self.entries:]:
                del state[key]
        return touched


class OptimizerStateDiverged(RuntimeError):
    """The optimizer ran out of memory after updating part of the weights (or on some ranks only) and no rollback
    checkpoint is kept: training on would silently continue from an inconsistent state."""
