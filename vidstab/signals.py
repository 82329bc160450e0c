"""On-device statistics of one accumulation window, packed into one small row per rank.

Nothing here reads a value back to the host. :meth:`Window.record` keeps, per micro-step, references to
the loss and a handful of 0-d reductions of each floating input tensor (no copies, no host sync; the guard
records the window's last micro-step right before the packing, where the caches favour it: ``Guard._hold``);
:meth:`Window.pack` stacks them once per optimizer step into the rank's row ``[k]``; :func:`gather_and_read`
gathers the rows of all ranks into a ``[world, k]`` table with ONE collective and reads it with ONE host
transfer. A run of one process gathers nothing: :meth:`Window.pack_for_host` stacks only the device values
(one op) and the same row is finished on the host after the read, which saves the five or so small device
ops of the packing (about 60-100 us per step on a CPU, where each costs 10-15 us after a training step).
Per-micro-step details (which micro-batch was bad) stay on the device and are read only on the cold path
of an incident (:meth:`Window.micro_flags`).

Row layout, float32, every column a fixed position (``[world, k]`` must have the same k on every rank):
first what the device computes (one ``torch.stack`` of scalars, four column reductions over the input
tensors' ``[n, 4]`` statistics, two counts), then what the host already knows (one small tensor), then the
timestep buckets:

    grad_norm, param_sq, update_sq, loss_scale, loss_sum,
    max|.| of (max, min, sum, norm) [4], sum of (max, min, sum, norm) [4], sum of squares of the same [4],
    nonfinite (inputs + losses), loss_nonfinite,
    norm_ok, loss_total, exceptions, in_numel, stop, param_pending, local_seconds,
    bucket_sum[nb], bucket_count[nb]

Input statistics are over every value of every floating input tensor: one non-finite value makes
absmax/sum/sumsq non-finite. A tensor holds a non-finite value exactly when its max or min is non-finite
(``aminmax`` propagates NaN), so the row needs no count of them: the host reads "this rank's inputs were
non-finite" off the absmax columns (:func:`inputs_nonfinite`), and the exact per-micro-step count is
taken on the cold path of an incident (:meth:`Window.micro_flags`). The device writes the loss count in
both count columns (rows recorded before this counted the input values in ``nonfinite``; the host reads
both kinds). ``loss_sum`` sums the finite micro-step losses (``loss_total - loss_nonfinite`` of them);
with ONE micro-step, the common case, it is the raw loss and its count is 0: the host classifies it
(:func:`loss_count`), which saves the device three ops per step. ``param_sq``/``update_sq`` are sums of
squares of the *local* parameters (and of the last update). Under DDP they are identical on every rank;
under FSDP each rank holds a shard, so the guard sums them over ranks (``sharded=True``) before taking the
square root. ``local_seconds`` is the rank's own compute time of the step (:class:`StepClock`), the
straggler detector's input.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

GRAD_NORM, PARAM_SQ, UPDATE_SQ, LOSS_SCALE, LOSS_SUM = range(5)
#: max |.| over input tensors of (max, min, sum, norm): IN_ABSMAX_HI/LO give the absmax
IN_ABSMAX_HI, IN_ABSMAX_LO = 5, 6
IN_SUM = 11  # column "sum" of the per-tensor sums
IN_SUMSQ = 16  # column "norm" of the per-tensor squared norms
NONFINITE_ALL, LOSS_NONFINITE = 17, 18  # non-finite values in inputs + losses; non-finite micro-step losses
DEVICE_COLS = 19
NORM_OK, LOSS_TOTAL, EXCEPTIONS, IN_NUMEL, STOP, PARAM_PENDING, LOCAL_SECONDS = range(19, 26)
FIXED = 26


def loss_count(r: Sequence[float]) -> tuple[float, float]:
    """(sum of the finite micro-step losses, number of non-finite ones) of a row (module docstring)."""
    total, nonfinite, loss_sum = r[LOSS_TOTAL], r[LOSS_NONFINITE], r[LOSS_SUM]
    if total == 1 and not math.isfinite(loss_sum):  # one micro-step, carried raw
        return 0.0, 1.0
    return loss_sum, nonfinite


def stop_requested(table: Sequence[Sequence[float]]) -> bool:
    """Whether some rank's row carries a stop request (a loop, not a generator: this runs on every judged step)."""
    for r in table:
        if r[STOP] > 0:
            return True
    return False


def inputs_nonfinite(r: Sequence[float]) -> bool:
    """Whether this row's rank saw a non-finite input value (module docstring)."""
    if r[NONFINITE_ALL] - r[LOSS_NONFINITE] > 0:  # a row that counted them
        return True
    return r[IN_NUMEL] > 0 and not (math.isfinite(r[IN_ABSMAX_HI]) and math.isfinite(r[IN_ABSMAX_LO]))


class MicroFlags(NamedTuple):
    """What one micro-step of the window looked like (:meth:`Window.micro_flags`, the cold path)."""

    loss_nonfinite: bool
    """The micro-step's loss was NaN/inf."""
    input_nonfinite: int
    """Non-finite values in its floating inputs."""
    input_absmax: float
    """Largest absolute input value (NaN when an input held a NaN)."""
    exception: bool
    """The caller reported an exception for this micro-step (``guard.backward(..., error=e)``)."""


@dataclass(frozen=True)
class Layout:
    """Positions in the packed row for a given number of timestep buckets."""

    buckets: int

    @property
    def width(self) -> int:
        return FIXED + 2 * self.buckets

    @property
    def bucket_sum(self) -> slice:
        return slice(FIXED, FIXED + self.buckets)

    @property
    def bucket_count(self) -> slice:
        return slice(FIXED + self.buckets, FIXED + 2 * self.buckets)


try:
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch without distributed
    _DTensor = None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 / tensor-parallel shards)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (D)Tensor: the shard of an FSDP2 DTensor, else the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def as_full(norm: Any) -> Any:
    """A DTensor norm made a plain (replicated) tensor with ``.full_tensor()``; other values unchanged."""
    return norm.full_tensor() if is_dtensor(norm) else norm


def _clip_dtensor_aware(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """What ``Accelerator.clip_grad_norm_`` does for one mesh (FSDP2) or plain params, without an Accelerator."""
    if not any(p.grad is not None for p in params):
        return torch.zeros(())
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def global_grad_norm(accelerator: Any, params: Iterable[torch.nn.Parameter], max_norm: float | None,
                     clip: Callable[..., Any] | None = None) -> torch.Tensor | None:
    """Global pre-clip gradient L2 norm, clipping to ``max_norm`` on the way (``None``: no clipping).

    With an ``accelerator`` this is ``accelerator.clip_grad_norm_`` (or ``clip``, the same bound method
    before the guard wrapped it): it unscales fp16 grads first; DDP grads are already all-reduced; FSDP2
    norms are DTensors and are made full here. Without one (tests, plain FSDP2) the same DTensor-aware
    computation is done directly. Under DeepSpeed Accelerate returns the engine's norm of the step it
    already applied, a float, or ``None``: returned as a tensor or None. No host sync.
    """
    params = list(params)
    limit = float("inf") if max_norm is None else float(max_norm)
    if clip is not None:
        norm = clip(params, limit)
    elif accelerator is not None:
        norm = accelerator.clip_grad_norm_(params, limit)
    else:
        norm = _clip_dtensor_aware(params, limit)
    return norm_tensor(norm)


def norm_tensor(norm: Any) -> torch.Tensor | None:
    """What ``clip_grad_norm_`` returned, as a plain tensor (DTensor made full, a float wrapped) or None."""
    if type(norm) is torch.Tensor:  # the common case first (a DTensor is a subclass)
        return norm
    if norm is None:
        return None
    if not isinstance(norm, torch.Tensor):
        return torch.tensor(float(norm))
    return as_full(norm)


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of the local parts of ``tensors`` on device (``_foreach_norm`` + one stack)."""
    local = [local_tensor(t.detach()) for t in tensors if t.numel() > 0]
    if not local:
        return torch.zeros(())
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault(t.device, []).append(t)
    total = None
    for dev, ts in by_device.items():
        norms = torch._foreach_norm(ts, 2)
        s = torch.stack([n.float() for n in norms]).square().sum()
        total = s if total is None else total + s.to(total.device)
    return total


class StepClock:
    """A rank's own compute time per optimizer step, measured without any sync or collective.

    The time runs from the end of the previous step's collective (the one gather, after which every rank
    leaves together) to the moment this rank enters the first call that may wait for other ranks: the
    backward of the last micro-step (DDP all-reduces gradients inside it). A slow GPU, a slow data loader
    or a throttled host makes this time longer on that rank only; time spent waiting for others is not in
    it. On CUDA the host runs ahead of the device, so the interval is measured with CUDA events and read one
    step late (both events have completed by the next step's read: no sync).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._start = time.perf_counter()
        self._mark: float | None = None
        self._events: tuple[Any, Any] | None = None
        self._pending_events: tuple[Any, Any] | None = None
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def mark(self) -> None:
        """This rank is about to enter a call that may wait for other ranks (first call per step counts)."""
        if self._mark is None:
            self._mark = time.perf_counter()
            if self._events is not None:
                self._events[1].record()

    def seconds(self) -> float:
        """This step's local time (CPU) or the previous step's (CUDA); ``-1`` when unknown."""
        if self._mark is None:
            self._mark = time.perf_counter()
            if self._events is not None:
                self._events[1].record()
        if not self.cuda:
            return self._mark - self._start
        done, self._pending_events = self._pending_events, self._events
        if done is None or not done[1].query():
            return -1.0
        return done[0].elapsed_time(done[1]) / 1e3

    def restart(self) -> None:
        """The collective is over: the next step's time starts now."""
        self._start, self._mark = time.perf_counter(), None
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()


def floating_inputs(batch: "Mapping[str, Any] | list[Any] | None", keys: Sequence[str] | None) -> list[torch.Tensor]:
    """The non-empty floating tensors of ``batch`` named in ``keys`` (``None``: every one of them; a list has no
    names: all of its tensors)."""
    if not batch:
        return []
    if type(batch) is list:
        values = batch
    else:
        values = batch.values() if keys is None else (batch.get(k) for k in keys)
    out = []  # a loop, not a comprehension: it runs on every micro-step (HostRow.finish says why)
    for x in values:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0:
            out.append(x)
    return out


class Window:
    """On-device accumulator of one gradient-accumulation window of one rank (see the module docstring)."""

    def __init__(self, device: torch.device, buckets: int, num_train_timesteps: float,
                 input_keys: Sequence[str] | None = None):
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.layout = Layout(buckets)
        self.num_train_timesteps = float(num_train_timesteps)
        self.input_keys = None if input_keys is None else tuple(input_keys)
        self._zero = torch.zeros((), device=self.device, dtype=self.dtype)
        # Tensor.get_device() of a tensor on this device (-1: the CPU), or None where it says nothing (MPS,
        # an unindexed CUDA device): _scalar then compares devices (``Tensor.device`` builds an object per call).
        self._device_index = {"cpu": -1, "cuda": self.device.index}.get(self.device.type)
        self._no_inputs = torch.zeros(12, device=self.device, dtype=self.dtype)
        self._no_counts = torch.zeros(2, device=self.device, dtype=self.dtype)
        self._no_buckets = torch.zeros(2 * buckets, device=self.device, dtype=self.dtype)
        self.reset()

    def reset(self) -> None:
        """Start a new window (called after each optimizer step)."""
        self.losses: list[torch.Tensor] = []
        self.exceptions = 0
        self.exception_flags: list[bool] = []
        self.in_values: list[torch.Tensor] = []  # per input tensor: max, min, sum, norm (0-d float32 each)
        # The input tensors themselves, for the cold path's exact non-finite count: references only (the
        # guard's incident capture holds the same batches until the step).
        self.in_tensors: list[torch.Tensor] = []
        self.in_micro: list[int] = []  # micro-step of each input tensor
        self.in_numel = 0
        self.bucket_parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def micro_steps(self) -> int:
        """Micro-steps recorded in this window."""
        return len(self.losses)

    def record(
        self,
        loss: torch.Tensor | None,
        batch: "Mapping[str, Any] | list[torch.Tensor] | None",
        per_sample_loss: torch.Tensor | None = None,
        timesteps: torch.Tensor | None = None,
        error: bool = False,
    ) -> None:
        """Fold one micro-step into the window: three reductions per input tensor, no host sync."""
        f32 = torch.float32
        if loss is None or not isinstance(loss, torch.Tensor) or loss.numel() == 0:
            loss_d = self._zero
        else:
            loss_d = loss.detach()
            if loss_d.ndim or loss_d.dtype is not f32:  # the common case, a 0-d float32 loss, is taken as it is
                loss_d = loss_d.float().mean() if loss_d.numel() != 1 else loss_d.to(f32).reshape(())
        micro = len(self.losses)
        self.losses.append(loss_d)
        self.exceptions += bool(error)
        self.exception_flags.append(bool(error))
        for x in floating_inputs(batch, self.input_keys):
            if x.requires_grad:  # inputs rarely do; a detach is a dispatched op
                x = x.detach()
            self.in_values += _input_values(x)
            self.in_tensors.append(x)
            self.in_micro.append(micro)
            self.in_numel += x.numel()
        if per_sample_loss is not None and timesteps is not None:
            psl, t = per_sample_loss.detach().reshape(-1), timesteps.detach().reshape(-1)
            if psl.numel() == t.numel():  # documented: both [B]; shapes the guard cannot pair up are ignored
                self.bucket_parts.append((psl, t))

    def pack(
        self,
        grad_norm: torch.Tensor | None,
        stop: bool,
        param_sq: torch.Tensor | None,
        update_sq: torch.Tensor | None,
        loss_scale: torch.Tensor | None,
        local_seconds: float = -1.0,
    ) -> torch.Tensor:
        """The rank's row ``[k]`` for this step: six device ops in the common case (one micro-step, one
        input tensor); no host sync."""
        dt, dev, zero = self.dtype, self.device, self._zero
        m, n = len(self.losses), len(self.in_values) // 4
        if m > 1:
            losses = torch.stack(self.losses)
            loss_sum = torch.nan_to_num(losses, nan=0.0, posinf=0.0, neginf=0.0).sum()
            counts = torch.count_nonzero(losses - losses).to(dt).expand(2)  # x - x is NaN exactly where x is not finite
        else:  # one micro-step: the raw loss, classified on the host (loss_count)
            loss_sum, counts = (self.losses[0] if m else zero), self._no_counts
        scalars = [zero if v is None else self._scalar(v) for v in (grad_norm, param_sq, update_sq, loss_scale)]
        pieces = [torch.stack(scalars + [loss_sum])]
        if n == 1:
            v = torch.stack(self.in_values)
            pieces += (v.abs(), v, v.square())
        elif n:
            v = torch.stack(self.in_values).view(-1, 4)
            pieces += (v.abs().amax(0), v.sum(0), v.square().sum(0))
        else:
            pieces.append(self._no_inputs)
        pieces.append(counts)  # the loss count in both count columns (module docstring)
        host = torch.from_numpy(np.array([grad_norm is not None, m, self.exceptions, self.in_numel, stop,
                                          param_sq is not None, local_seconds], dtype=np.float32))
        pieces.append(host if dev.type == "cpu" else host.to(dev, non_blocking=True))
        if self.layout.buckets:
            pieces.append(self._buckets() if self.bucket_parts else self._no_buckets)
        return torch.cat(pieces)

    def pack_for_host(
        self,
        grad_norm: torch.Tensor | None,
        stop: bool,
        param_sq: torch.Tensor | None,
        update_sq: torch.Tensor | None,
        loss_scale: torch.Tensor | None,
        local_seconds: float = -1.0,
    ) -> "HostRow":
        """The same row as :meth:`pack` for a run with ONE process, where nothing is gathered: the device
        values stacked raw (one op in the common case) and the rest of the row composed on the host after the
        one read (:meth:`HostRow.finish`), so the host-known values never travel to the device."""
        present = (grad_norm is not None, param_sq is not None, update_sq is not None, loss_scale is not None)
        values = []  # a loop, not a comprehension; _scalar's test inline (HostRow.finish says why)
        f32, index = self.dtype, self._device_index
        for v in (grad_norm, param_sq, update_sq, loss_scale):
            if v is not None:
                values.append(v if v.dtype is f32 and v.ndim == 0 and v.get_device() == index else self._scalar(v))
        values += self.losses
        values += self.in_values
        raw = torch.stack(values) if values else self._zero.reshape(1)[:0]
        if self.layout.buckets and self.bucket_parts:
            raw = torch.cat([raw, self._buckets()])
        host = [float(grad_norm is not None), float(len(self.losses)), float(self.exceptions), float(self.in_numel),
                float(stop), float(param_sq is not None), float(local_seconds)]
        return HostRow(raw, present, len(self.losses), len(self.in_values) // 4, host, self.layout)

    def _scalar(self, v: torch.Tensor) -> torch.Tensor:
        """``v`` as a 0-d float32 tensor on the window's device (no op when it already is one)."""
        if v.dtype is self.dtype and v.ndim == 0 and (
                v.get_device() == self._device_index if self._device_index is not None else v.device == self.device):
            return v
        return v.to(self.device, self.dtype).reshape(())

    def _buckets(self) -> torch.Tensor:
        nb, dt, dev = self.layout.buckets, self.dtype, self.device
        psl = torch.cat([p for p, _ in self.bucket_parts]).to(dev, dt)
        t = torch.cat([t for _, t in self.bucket_parts]).to(dev, dt)
        idx = (t * (nb / self.num_train_timesteps)).long().clamp_(0, nb - 1)
        fin = torch.isfinite(psl)
        values = torch.cat([torch.where(fin, psl, self._zero), fin.to(dt)])
        return torch.zeros(2 * nb, device=dev, dtype=dt).index_add_(0, torch.cat([idx, idx + nb]), values)

    def micro_flags(self) -> list[MicroFlags]:
        """One :class:`MicroFlags` per micro-step of the window.

        Cold path (an incident is being captured): this is an extra host read.
        """
        n = len(self.losses)
        if n == 0:
            return []
        losses = torch.stack(self.losses)
        bad_loss = [not math.isfinite(x) for x in losses.tolist()]
        counts, absmax = [0] * n, [0.0] * n
        if self.in_values:
            v = torch.stack(self.in_values).view(-1, 4)[:, :2].abs().amax(1)
            exact = [torch.count_nonzero(x - x).to(self.dtype) for x in self.in_tensors]  # x - x: NaN where x is not
            per_tensor = torch.cat([torch.stack(exact), v]).tolist()
            k = len(self.in_micro)
            for i, m in enumerate(self.in_micro):
                counts[m] += int(per_tensor[i])
                a = per_tensor[k + i]
                absmax[m] = a if (math.isnan(a) or a > absmax[m]) else absmax[m]
        return [MicroFlags(bad_loss[i], counts[i], absmax[i], self.exception_flags[i]) for i in range(n)]


def _input_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, min, sum, L2 norm) of one input tensor, 0-d float32 each, on its device (no host sync)."""
    lo, hi = torch.aminmax(x)
    if x.dtype == torch.float32:  # the dtype argument costs a conversion check per call
        return hi, lo, x.sum(), torch.linalg.vector_norm(x)
    f32 = torch.float32
    return hi.to(f32), lo.to(f32), x.sum(dtype=f32), torch.linalg.vector_norm(x, 2, dtype=f32)


class HostRow:
    """A one-process row still in two parts (:meth:`Window.pack_for_host`): ``raw`` on the device (the
    present scalars among grad_norm, param_sq, update_sq, loss_scale, then the micro-step losses, the
    input values (max, min, sum, norm per tensor), then the buckets), the rest known on the host. A plain
    class with slots: one is made per step, and a frozen dataclass's ``__init__`` costs a call per field.

    Once :meth:`read` (the one host read), it is the step's gathered table of one row: ``table[0]`` is the row
    :meth:`Window.pack` would have built, finished on the host when first asked for (:meth:`finish`). A healthy
    step's screen reads the raw values instead (:func:`vidstab.guard.healthy.host_row_values`), and the row is
    finished later, with the other held-back steps', when its metrics line is made: right after a training step
    every Python object touched is a cache miss (``benchmarks/RESULTS.md``, "The screen on the raw read")."""

    __slots__ = ("raw", "present", "micro_steps", "tensors", "host", "layout", "flat", "_row")

    def __init__(self, raw: torch.Tensor, present: tuple[bool, bool, bool, bool], micro_steps: int, tensors: int,
                 host: list[float], layout: Layout) -> None:
        self.raw, self.present, self.micro_steps, self.tensors, self.host, self.layout = (
            raw, present, micro_steps, tensors, host, layout)
        self.flat: list[float] = []
        self._row: list[float] | None = None

    def read(self) -> "HostRow":
        """The host sync: ``raw`` read back once (:attr:`flat`); returns the row, now a table of one row."""
        self.flat = self.raw.tolist()
        return self

    def __len__(self) -> int:
        return 1

    def __getitem__(self, rank: int) -> list[float]:
        """The finished row (rank 0, the only one), made on first use."""
        if rank not in (0, -1):
            raise IndexError(f"a run of one process has one row, not row {rank}")
        row = self._row
        if row is None:
            row = self._row = self.finish()
        return row

    def __iter__(self) -> Iterator[list[float]]:
        yield self[0]

    def finish(self) -> list[float]:
        """The row :meth:`Window.pack` would have built, from ``raw`` read back (:attr:`flat`): the same columns and
        encodings. Plain Python (numpy's or torch's per-call cost on 30 numbers is more than the sums):
        float64 arithmetic, so a derived column may differ from the device's float32 in its last bits."""
        # Unrolled where it runs on every step (one micro-step, one input tensor): on Python 3.11 a comprehension
        # is a call of its own, and right after a training step every code object run is a cache miss.
        it = iter(self.flat)
        p0, p1, p2, p3 = self.present
        row = [next(it) if p0 else 0.0, next(it) if p1 else 0.0, next(it) if p2 else 0.0, next(it) if p3 else 0.0]
        m, n = self.micro_steps, self.tensors
        if m > 1:
            losses = [next(it) for _ in range(m)]
            finite = [x for x in losses if math.isfinite(x)]
            bad = float(m - len(finite))
            row.append(math.fsum(finite))
        else:  # one micro-step: the raw loss, as Window.pack carries it
            bad = 0.0
            row.append(next(it) if m else 0.0)
        if n == 1:
            v0, v1, v2, v3 = next(it), next(it), next(it), next(it)
            row += (abs(v0), abs(v1), abs(v2), abs(v3), v0, v1, v2, v3, v0 * v0, v1 * v1, v2 * v2, v3 * v3)
        elif n:
            v = [next(it) for _ in range(4 * n)]
            cols = [v[j::4] for j in range(4)]
            row += [_nan_max([abs(x) for x in c]) for c in cols]
            row += [sum(c) for c in cols]
            row += [sum([x * x for x in c]) for c in cols]
        else:
            row += _NO_INPUTS
        row += (bad, bad)  # the loss count in both count columns (module docstring)
        row += self.host
        if self.layout.buckets:
            rest = list(it)
            row += rest if rest else [0.0] * (2 * self.layout.buckets)
        return row


_NO_INPUTS = [0.0] * 12


def _nan_max(values: list[float]) -> float:
    """``max`` that is NaN when any value is (as ``torch.amax``)."""
    return math.nan if any(x != x for x in values) else max(values)


def gather_and_read(accelerator: Any, row: "torch.Tensor | HostRow") -> "list[list[float]] | HostRow":
    """ONE collective (``accelerator.gather``) and ONE host read for the whole step: ``table[r]`` is rank
    ``r``'s row. With one process there is nothing to gather (and a :class:`HostRow` is read, to be finished
    on the host when its row is asked for)."""
    if isinstance(row, HostRow):
        return row.read()  # the host sync
    k = row.numel()
    if accelerator is not None and accelerator.num_processes > 1:
        table = accelerator.gather(row.reshape(1, k)).reshape(-1)
    else:
        table = row
    flat = table.tolist()  # the host sync
    return [flat[i:i + k] for i in range(0, len(flat), k)]
