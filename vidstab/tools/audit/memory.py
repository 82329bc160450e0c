"""Preflight per shape bucket: one forward, backward and optimizer step at each bucket's largest micro-batch, and
the peak memory it took, before a week-long run finds the bucket that does not fit at step 40,000.

What is measured is said in every finding (``details["measured"]``):

- on a GPU (CUDA): the allocator's peak, ``torch.cuda.max_memory_allocated`` over the step (weights, gradients,
  optimizer state and activations), against the device's total memory: the headroom is what is left;
- on a CPU there is no allocator peak to read: the peak of the CPU allocator's allocations during the step over
  what was allocated before it (the profiler's memory accounting, ``profile_memory=True``), against the host's
  available memory (``MemAvailable``). Weights allocated before the step are not in the figure.

A bucket whose step runs out of memory is a blocking finding that names the bucket and its micro-batch. The
model and the optimizer are put back as they were (the step's update and the optimizer state it created undone).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...recovery.oom import is_oom, release
from .findings import finding

LOW_HEADROOM = 0.1
"""A bucket whose step leaves less than this share of the memory free is a warning (fragmentation, a longer
caption, another process can take that much)."""


def audit_bucket_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        buckets: Mapping[str, tuple[int, Callable[[], torch.Tensor]]],
                        device: torch.device | str | None = None) -> list[dict]:
    """Per bucket ``name -> (micro_batch, loss_fn)``: ``loss_fn()`` runs the forward of one micro-batch of that
    bucket at its largest size and returns the loss; its backward and ``optimizer.step()`` follow, measured
    together. Returns a ``memory.bucket`` finding per bucket (info, warn on low headroom, block when it does not
    fit) and one ``memory.method`` finding saying how the figures were taken."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    cuda = device.type == "cuda"
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())
    method = ("torch.cuda.max_memory_allocated over the step, against the device's total memory" if cuda else
              "CPU: the peak of the CPU allocator's allocations during the step over those before it (the "
              "profiler's memory accounting), against the host's available memory; weights allocated before the "
              "step are not included")
    out = [finding("memory.method", "info", f"per-bucket preflight: {method}", measured="cuda" if cuda else "cpu")]
    total = _device_total(device) if cuda else _host_available()
    try:
        for name, (micro_batch, loss_fn) in buckets.items():
            try:
                peak = _measure(lambda: _one_step(loss_fn, optimizer), device)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                release(exc, device)
                out.append(finding("memory.bucket", "block",
                                   f"bucket {name} does not fit: a step at a micro-batch of {micro_batch} ran out of "
                                   f"memory ({str(exc)[:200]}); use a smaller micro-batch for it (gradient "
                                   f"accumulation keeps the batch), or a lower resolution or frame count",
                                   bucket=name, micro_batch=micro_batch, fits=False))
                continue
            finally:
                optimizer.zero_grad(set_to_none=True)
            headroom = total - peak if total is not None else None
            low = headroom is not None and headroom < LOW_HEADROOM * total
            where = "of the device's" if cuda else "of the host's available"
            room = (f", headroom {_mib(headroom)} {where} {_mib(total)}" if headroom is not None else
                    ", headroom unknown")
            out.append(finding("memory.bucket", "warn" if low else "info",
                               f"bucket {name} at a micro-batch of {micro_batch}: peak {_mib(peak)}{room}"
                               + (" (under 10% left)" if low else ""),
                               bucket=name, micro_batch=micro_batch, fits=True, peak_bytes=peak,
                               total_bytes=total, headroom_bytes=headroom, measured="cuda" if cuda else "cpu"))
    finally:  # the preflight leaves no trace: the weights and the optimizer as they were
        model.load_state_dict(weights)
        optimizer.load_state_dict(state)
        release(None, device)
    return out


def _one_step(loss_fn: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    loss = loss_fn()
    loss.backward()
    del loss
    optimizer.step()


def _measure(step: Callable[[], None], device: torch.device) -> int:
    """The step's peak bytes (module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == cpu), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _device_total(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory)


def _host_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (``None`` where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


def audit_model_memory(model: torch.nn.Module, buckets: Mapping[str, Any],
                       before_forward: Callable[[int], None] | None = None) -> list[dict]:
    """:func:`audit_bucket_memory` for ``vidstab audit --model ... --memory``: per bucket the model's example
    inputs at its largest micro-batch (a tuple of positional or a mapping of keyword arguments); the loss is the
    mean square of the first output tensor and the optimizer AdamW (its state is most of a step's extra memory).
    ``before_forward(samples)``: a drill's hook (``oom_batch_above``)."""
    from ...recovery.oom import micro_batch_size

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def loss_fn(inputs: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            if before_forward is not None:
                before_forward(size_of(inputs))
            out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
            return next(_tensors(out)).float().square().mean()
        return run

    def size_of(inputs: Any) -> int:
        return micro_batch_size(list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)) or 1

    runs = {str(name): (size_of(inputs), loss_fn(inputs)) for name, inputs in buckets.items()}
    return audit_bucket_memory(model, optimizer, runs)


def _tensors(out: Any):
    """The tensors of a model's output, first to last (a tensor, a tuple/list, a mapping or a diffusers output)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, Mapping):
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from _tensors(v)
