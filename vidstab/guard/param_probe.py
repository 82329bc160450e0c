"""The weights' norm and the last update's, measured around the optimizer step every ``param_norm_every`` steps.

``param_growth``, ``nonfinite_params`` and ``update_ratio`` read the global parameter norm and the norm of the
update the optimizer just applied. The weights' sum of squares is exact. The update's is estimated from a fixed
systematic sample of every tensor (one element in ``UPDATE_SAMPLE_STRIDE`` of its flat order; tensors of at most
``WHOLE_UP_TO`` elements whole), copied right before the step (:meth:`ParamProbe.snapshot`) and compared after it
(:meth:`ParamProbe.sums`), each tensor's sample weighted by its size over the sample's: about 1/16 of the weights
is copied at the peak of the step instead of all of them, and an optimizer's dense update (Adam's moves every
element) is measured to well under a percent, far inside what ``update_ratio`` judges (a several-fold jump).

Host time: the tensors are grouped per device once (and again only when a parameter's storage changes); a
measurement is a few foreach ops per device over the large tensors and, per run of small ones, one concatenation
before the step (its sample copied) and one after it (its norm taken and its sample subtracted in place); the runs'
norms are added in one op per dtype at the end, left on the device for the next step's read.

The sums are of the *local* tensors: under FSDP2 each rank holds a shard, and the guard's reduction adds the
ranks' sums before the square root is taken (:func:`vidstab.guard.stats.build_stats`, ``sharded``).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..signals import device_sum_of_squares, is_dtensor, local_tensor, norm_dtype

UPDATE_SAMPLE_STRIDE = 16
"""One element in this many of each tensor is copied to measure the update."""
WHOLE_UP_TO = 64
"""A tensor (or a run of small tensors) of at most this many elements is copied whole."""
FLAT_UP_TO = 16384
"""Contiguous tensors of at most this many elements are measured as runs of flat concatenations (one op per run
instead of one per tensor: the per-tensor cost of a foreach op on a CPU is a few microseconds)."""


class _DeviceGroup(NamedTuple):
    """One device's local tensors: the large ones measured per tensor (their update samples: views, and each
    sample's weight), the small ones as runs of flat views concatenated per measurement (the runs' indices per
    dtype, and each run's sample's weight, on the device)."""

    tensors: list[torch.Tensor]
    samples: list[torch.Tensor]
    weights: torch.Tensor | None
    runs: list[list[torch.Tensor]]
    run_sets: list[tuple[list[int], torch.Tensor]]


Snapshot = list[tuple[_DeviceGroup, list[torch.Tensor], list[torch.Tensor]]]
"""Each device group with copies of its tensors' samples and of its runs' samples, taken before the step."""


def update_sample(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` holding about one element in ``UPDATE_SAMPLE_STRIDE`` (``t`` itself when small): every
    ``UPDATE_SAMPLE_STRIDE``-th element of a contiguous tensor, else every so many slices of its largest dimension."""
    if t.numel() <= WHOLE_UP_TO:
        return t
    if t.is_contiguous():
        return t.view(-1)[::UPDATE_SAMPLE_STRIDE]
    dim = max(range(t.dim()), key=t.size)
    return t[(slice(None),) * dim + (slice(None, None, min(UPDATE_SAMPLE_STRIDE, t.size(dim))),)]


def _runs(flat: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """``flat`` (1-d views) cut into runs of one dtype and at most ``budget`` elements each (a run's
    concatenation is the largest temporary a measurement makes)."""
    runs: list[list[torch.Tensor]] = []
    size = 0
    for t in flat:
        if not runs or size + t.numel() > budget or t.dtype != runs[-1][0].dtype:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += t.numel()
    return runs


class ParamProbe:
    """Sums of squares of a fixed list of (trainable) parameters and of their change across one optimizer step.

    Args:
        params: the parameters to measure (the model's trainable ones); empty ones are left out when the first
            measurement is taken (a lazy module has no size before its first forward).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.all_params = list(params)
        self.params: list[torch.nn.Parameter] | None = None
        self._groups: list[_DeviceGroup] = []
        self._storages: list[int] | None = None  # the storages the groups were built on (plain tensors only)
        self._sharded = False

    def __bool__(self) -> bool:
        """Whether there are parameters to measure."""
        return bool(self.all_params)

    def _plan(self) -> list[_DeviceGroup]:
        """The device groups of the local tensors (an FSDP2 shard, or the parameter itself), rebuilt when a
        parameter's storage changed (``p.data`` replaced) and every time for DTensors (their local part may move)."""
        if self.params is None:
            self.params = [p for p in self.all_params if p.numel() > 0]
            self._sharded = any(is_dtensor(p) for p in self.params)
        storages = None if self._sharded else list(map(torch.Tensor.data_ptr, self.params))
        if storages is not None and storages == self._storages:
            return self._groups
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in self.params:
            t = local_tensor(p).detach()
            if t.numel() > 0:
                by_device.setdefault(t.device, []).append(t)
        budget = max(WHOLE_UP_TO, sum(p.numel() for p in self.params) // 64)
        self._groups = []
        for device, ts in by_device.items():
            small = [t.view(-1) for t in ts if t.numel() <= FLAT_UP_TO and t.is_contiguous()]
            large = [t for t in ts if not (t.numel() <= FLAT_UP_TO and t.is_contiguous())]
            samples = [update_sample(t) for t in large]
            weights = (torch.tensor([t.numel() / s.numel() for t, s in zip(large, samples)], dtype=torch.float32)
                       .to(device) if large else None)
            runs = _runs(small, budget)
            self._groups.append(_DeviceGroup(large, samples, weights, runs, _run_sets(runs, device)))
        self._storages = storages
        return self._groups

    @torch.no_grad()
    def snapshot(self) -> Snapshot:
        """Copies of the update samples, taken right before the optimizer step, for :meth:`sums` only."""
        return [(g, [s.clone() for s in g.samples], [_run_sample(torch.cat(run)).clone() for run in g.runs])
                for g in self._plan()]

    @torch.no_grad()
    def sums(self, before: Snapshot | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sum of squares of the parameters, estimated sum of squares of their change since before)`` as 0-d
        float32 device tensors (the second ``None`` without ``before``); ``before`` is overwritten."""
        groups = self._plan() if before is None else [g for g, _, _ in before]
        params, update = [], []
        for i, g in enumerate(groups):
            if g.tensors:
                params.append(device_sum_of_squares(g.tensors))
                if before is not None:
                    copies = before[i][1]
                    torch._foreach_sub_(copies, g.samples)
                    update.append(device_sum_of_squares(copies, g.weights))
            copies = before[i][2] if before is not None else None
            norms = []
            for j, run in enumerate(g.runs):  # one run's concatenation at a time: the largest temporary
                flat = torch.cat(run)
                norms.append(torch.linalg.vector_norm(flat, dtype=norm_dtype(flat.dtype)))
                if copies is not None:
                    copies[j].sub_(_run_sample(flat))
            for indices, weights in g.run_sets:
                run_norms = torch.stack([norms[j] for j in indices])
                params.append(torch.dot(run_norms, run_norms))
                if copies is not None:
                    update_norms = torch.stack(torch._foreach_norm([copies[j] for j in indices], 2,
                                                                   dtype=run_norms.dtype))
                    update.append(torch.dot(update_norms * update_norms, weights))
        return _added(params), (_added(update) if before is not None else None)


def _run_sets(runs: list[list[torch.Tensor]], device: torch.device) -> list[tuple[list[int], torch.Tensor]]:
    """The runs' indices per norm dtype, each with its runs' sample weights (a run's size over its sample's) in
    that dtype."""
    sets: dict[torch.dtype, tuple[list[int], list[float]]] = {}
    for j, run in enumerate(runs):
        size = sum(t.numel() for t in run)
        indices, weights = sets.setdefault(norm_dtype(run[0].dtype), ([], []))
        indices.append(j)
        weights.append(size / _run_sample(torch.empty(size, device="meta")).numel())
    return [(indices, torch.tensor(weights, dtype=torch.float64).to(device, dtype))
            for dtype, (indices, weights) in sets.items()]


def _run_sample(flat: torch.Tensor) -> torch.Tensor:
    """The update sample of a run's concatenation (a view)."""
    return flat if flat.numel() <= WHOLE_UP_TO else flat[::UPDATE_SAMPLE_STRIDE]


def _added(sums: list[torch.Tensor]) -> torch.Tensor:
    """Per-device sums added on the first device, as float32 (0 without any)."""
    if not sums:
        return torch.zeros(())
    total = sums[0]
    for s in sums[1:]:
        total = total + s.to(total.device)
    return total.float()
