"""Out of memory: an incident of its own. What counts as one, and releasing the failed step's memory.

An OOM in the forward or the backward leaves the weights untouched: the step is skipped on every rank together
(the ``oom`` detector; no rollback, no LR change), its gradients are dropped, the references it held are freed
and the allocator's cache is emptied, so the next step starts from the memory a healthy step starts from.
"""

from __future__ import annotations

import gc
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

