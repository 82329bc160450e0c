"""On-device statistics of one accumulation window, reduced across ranks into one fixed-size summary.

Nothing here reads a value back to the host but :func:`reduce_and_read`, once per optimizer step.
:meth:`Window.record` keeps, per micro-step, references to the loss and four 0-d reductions of each floating
input tensor (no copies, no host sync); :meth:`Window.pack` turns them once per optimizer step into the rank's
vector of :data:`LAYOUT` columns; :func:`reduce_and_read` reduces the vectors of all ranks with two fixed-size
all_reduces (the sum columns with SUM, the others with MAX) and reads the summary and the rank's own vector in
ONE host transfer. The cost does not grow with the number of ranks: every rank gets the same summary, so every
rank takes the same branch. Per-rank detail (which ranks were bad, each rank's loss) is gathered only on a step
whose summary shows something (:func:`gather_rows`), and per-micro-step detail only for an incident bundle
(:meth:`Window.micro_flags`).

Columns (float64: a hash, a rank id or a count is exact), first those summed over ranks, then those maximised:

    sum:  loss_sum, loss_count, loss_nonfinite, ranks_loss_bad, ranks_input_bad, ranks_exception, stop,
          in_sum, in_sumsq, in_numel, param_sq, update_sq, seconds, ranks, batch_crc, batch_crc_ranks,
          bucket_sum[nb], bucket_count[nb]
    max:  grad_norm, norm_nan, norm_nonfinite, norm_known, in_absmax, param_sq, update_sq, param_measured,
          loss_scale, slowest (seconds and rank in one number), bucket, -bucket,
          micro_steps, lr, lr_peak, lr_scheduled (-1: unknown), oom (the largest micro-batch that ran out of memory, 0: none; vidstab.recovery.oom),
          oom_in_step, neg_oom_in_step (the previous optimizer step ran out of memory on a rank: 1 before touching
          its state, 2 after; the maximum and the negated minimum over ranks)

``loss_sum``/``loss_count`` are over the finite micro-step losses; the input columns over ranks whose inputs
were finite (a non-finite value anywhere makes a rank's ``ranks_input_bad`` 1 and its input sums 0).
``param_sq``/``update_sq`` are sums of squares of the *local* parameters (and of the last update): under FSDP
each rank holds a shard, so the summed column is the global one; under DDP every rank holds all of them, so the
maximised column is. A minimum is the maximum of the negated value. Which ranks were bad is per-rank detail: a
step with a bad rank gathers every rank's vector.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
DEVICE_VALUES = ("loss_nonfinite", "input_nonfinite", "loss_sum", "loss_count", "grad_norm", "norm_nan",
                 "norm_nonfinite", "ranks_loss_bad", "ranks_input_bad", "in_sum", "in_sumsq", "in_absmax", "in_numel",
                 "param_sq", "update_sq", "loss_scale")
"""What :meth:`Window.pack` computes on the device, in its order (``input_nonfinite`` is not a column)."""
HOST_VALUES = ("ranks_exception", "stop", "seconds", "ranks", "norm_known", "param_measured", "slowest", "bucket",
               "neg_bucket", "micro_steps", "batch_crc", "batch_crc_ranks", "lr", "lr_peak", "lr_scheduled", "oom",
               "oom_in_step", "neg_oom_in_step")
"""What the host knows of the step, in :meth:`Window.pack`'s order."""
_HOST_COUNT = len(HOST_VALUES)
_SLOWEST_SCALE = 1e6  # seconds to microseconds in the ``slowest`` column
_RANK_SPAN = 65536  # ``slowest = round(seconds * 1e6) * 65536 + rank``: exact in float64 up to ~38 h a step


@dataclass(frozen=True)
class Layout:
    """Column positions of a rank's vector for ``buckets`` timestep buckets (module docstring)."""

    buckets: int

    SUM_NAMES = ("loss_sum", "loss_count", "loss_nonfinite", "ranks_loss_bad", "ranks_input_bad", "ranks_exception",
                 "stop", "in_sum", "in_sumsq", "in_numel", "param_sq_sum", "update_sq_sum", "seconds", "ranks",
                 "batch_crc", "batch_crc_ranks")
    MAX_NAMES = ("grad_norm", "norm_nan", "norm_nonfinite", "norm_known", "in_absmax", "param_sq_max", "update_sq_max",
                 "param_measured", "loss_scale", "slowest", "bucket", "neg_bucket", "micro_steps",
                 "lr", "lr_peak", "lr_scheduled", "oom", "oom_in_step", "neg_oom_in_step")

    @property
    def sum_width(self) -> int:
        """Columns reduced with SUM (the first ones)."""
        return len(self.SUM_NAMES) + 2 * self.buckets

    @property
    def width(self) -> int:
        return self.sum_width + len(self.MAX_NAMES)

    def __post_init__(self) -> None:
        """Each column's position as a plain attribute (``layout.loss_sum``): read many times a step."""
        for i, name in enumerate(self.SUM_NAMES):
            object.__setattr__(self, name, i)
        for i, name in enumerate(self.MAX_NAMES):
            object.__setattr__(self, name, self.sum_width + i)

    def pack_index(self) -> torch.Tensor:
        """Where each column comes from in :meth:`Window.pack`'s ``[device values, host values, buckets]``."""
        d, h = len(DEVICE_VALUES), len(HOST_VALUES)
        src = {name: i for i, name in enumerate(DEVICE_VALUES)} | {name: d + i for i, name in enumerate(HOST_VALUES)}
        alias = {"param_sq_sum": "param_sq", "param_sq_max": "param_sq", "update_sq_sum": "update_sq",
                 "update_sq_max": "update_sq"}
        index = [src[alias.get(n, n)] for n in self.SUM_NAMES]
        index += [d + h + i for i in range(2 * self.buckets)]
        index += [src[alias.get(n, n)] for n in self.MAX_NAMES]
        return torch.tensor(index, dtype=torch.long)

    @property
    def bucket_sum(self) -> slice:
        start = len(self.SUM_NAMES)
        return slice(start, start + self.buckets)

    @property
    def bucket_count(self) -> slice:
        start = len(self.SUM_NAMES) + self.buckets
        return slice(start, start + self.buckets)


@functools.lru_cache(maxsize=4096)
def bucket_hash(key: str) -> float:
    """A shape bucket's name as a number below 2**52 (exact in float64), the same on every rank."""
    return float(int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") >> 12)


def slowest_key(seconds: float, rank: int) -> float:
    """One number whose maximum over ranks names the slowest rank and its time (``-1``: not measured)."""
    if seconds < 0:
        return -1.0
    return float(round(seconds * _SLOWEST_SCALE) * _RANK_SPAN + rank)


def decode_slowest(key: float) -> tuple[int, float] | None:
    """``(rank, seconds)`` of :func:`slowest_key`, or ``None`` when no rank measured its time."""
    if key < 0:
        return None
    k = int(key)
    return k % _RANK_SPAN, (k // _RANK_SPAN) / _SLOWEST_SCALE


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


_DTensor = None  # the class, once its module is imported


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 / tensor-parallel shards). A DTensor exists
    only once its module is imported, so nothing is imported here (a second of every process's start-up)."""
    global _DTensor
    if _DTensor is None:
        module = sys.modules.get("torch.distributed.tensor")
        if module is None:
            return False
        _DTensor = module.DTensor
    return isinstance(t, _DTensor)


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
    params = params if type(params) is list else list(params)  # the guard's own list: not copied every step
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
    """Sum of squares of the local parts of ``tensors`` on device, as a 0-d float32: one ``_foreach_norm`` per
    device (float32 norms of low-precision tensors, float64 ones of float64 tensors), added on the first device."""
    local = [local_tensor(t.detach()) for t in tensors if t.numel() > 0]
    if not local:
        return torch.zeros(())
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault(t.device, []).append(t)
    total = None
    for ts in by_device.values():
        s = device_sum_of_squares(ts)
        total = s if total is None else total + s.to(total.device)
    return total.float()


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm of ``dtype`` tensors is taken in: float32 for low-precision ones (and float32), else their own."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def device_sum_of_squares(ts: Sequence[torch.Tensor], weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of squares of non-empty tensors on one device: one ``_foreach_norm`` (float32 norms of low-precision
    tensors); ``weights``: one factor per tensor on that device multiplying its sum of squares."""
    kwargs = {"dtype": torch.float32} if all(norm_dtype(t.dtype) == torch.float32 for t in ts) else {}
    norms = torch.stack(torch._foreach_norm(ts, 2, **kwargs))
    return torch.dot(norms, norms) if weights is None else torch.dot(norms * norms, weights.to(norms.dtype))


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
    out = []
    for x in values:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0:
            out.append(x)
    return out


class Window:
    """On-device accumulator of one gradient-accumulation window of one rank (see the module docstring)."""

    def __init__(self, device: torch.device, buckets: int, num_train_timesteps: float,
                 input_keys: Sequence[str] | None = None):
        self.device = torch.device(device)
        self.dtype = torch.float64 if self.device.type != "mps" else torch.float32  # MPS has no float64
        self.layout = Layout(buckets)
        self.num_train_timesteps = float(num_train_timesteps)
        self.input_keys = None if input_keys is None else tuple(input_keys)
        self._zero = torch.zeros((), device=self.device, dtype=self.dtype)
        self._zero32 = torch.zeros((), device=self.device, dtype=torch.float32)
        self._map_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._no_buckets = torch.zeros(2 * buckets, device=self.device, dtype=self.dtype)
        self._host_buf = torch.zeros(_HOST_COUNT, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self._host_np = self._host_buf.numpy()
        self._pack_index = self.layout.pack_index().to(self.device)
        self.reset()

    def reset(self) -> None:
        """Start a new window (called after each optimizer step)."""
        self.losses: list[torch.Tensor] = []
        self.exceptions = 0
        self.exception_flags: list[bool] = []
        self.oom_batch = 0  # the largest micro-batch of the window that ran out of memory (0: none)
        self.oom_in_step = 0  # the previous optimizer step ran out of memory here: 1 untouched, 2 touched (vidstab.recovery.oom)
        self.in_values: list[torch.Tensor] = []  # per input tensor: max, min, sum, norm (0-d each)
        # The input tensors themselves, for the cold path's exact non-finite count: references only (the
        # guard's incident capture holds the same batches until the step).
        self.in_tensors: list[torch.Tensor] = []
        self.in_micro: list[int] = []  # micro-step of each input tensor
        self.in_numel = 0
        self.bucket_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.shape_buckets: set[str] = set()

    @property
    def micro_steps(self) -> int:
        """Micro-steps recorded in this window."""
        return len(self.losses)

    @property
    def shape_bucket(self) -> str:
        """The window's shape bucket: its micro-steps' one bucket, or ``"mixed"``."""
        if len(self.shape_buckets) == 1:
            return next(iter(self.shape_buckets))
        return "mixed" if self.shape_buckets else "default"

    def record(
        self,
        loss: torch.Tensor | None,
        batch: "Mapping[str, Any] | list[torch.Tensor] | None",
        per_sample_loss: torch.Tensor | None = None,
        timesteps: torch.Tensor | None = None,
        error: bool = False,
        bucket: str | None = None,
        oom: int = 0,
    ) -> None:
        """Fold one micro-step into the window: four reductions per input tensor, no host sync.
        ``bucket``: its shape bucket (default: :func:`shape_bucket` of the inputs); ``oom``: it ran out of memory, with this many samples (1 when unknown)."""
        if loss is None or not isinstance(loss, torch.Tensor) or loss.numel() == 0:
            loss_d = self._zero
        else:
            loss_d = loss.detach()
            loss_d = loss_d.float().mean() if loss_d.numel() != 1 else loss_d.reshape(())
        micro = len(self.losses)
        self.losses.append(loss_d)
        self.exceptions += bool(error)
        self.exception_flags.append(bool(error))
        self.oom_batch = max(self.oom_batch, int(oom))
        inputs = floating_inputs(batch, self.input_keys)
        for x in inputs:
            x = x.detach()
            self.in_values += _input_values(x)
            self.in_tensors.append(x)
            self.in_micro.append(micro)
            self.in_numel += x.numel()
        self.shape_buckets.add(str(bucket) if bucket is not None else shape_bucket(inputs))
        if per_sample_loss is not None and timesteps is not None:
            psl, t = per_sample_loss.detach().reshape(-1), timesteps.detach().reshape(-1)
            if psl.numel() == t.numel():  # documented: both [B]; shapes the guard cannot pair up are ignored
                self.bucket_parts.append((psl, t))

    def pack(
        self,
        grad_norm: torch.Tensor | None,
        *,
        stop: bool,
        param_sq: torch.Tensor | None,
        update_sq: torch.Tensor | None,
        loss_scale: torch.Tensor | None,
        seconds: float,
        rank: int,
        lr: tuple[float | None, float | None, float | None] = (None, None, None),
        batch_crc: int | None = None,
    ) -> torch.Tensor:
        """The rank's vector for this step (:data:`Layout` columns); device ops only, no host sync. ``lr``: this
        rank's ``(lr, lr_peak, lr_scheduled)`` (the largest over ranks is judged, so an LR wrong on one rank is
        seen by all); ``batch_crc``: the CRC-32 of this rank's sample ids (summed over ranks: the step's batch)."""
        dt, dev = self.dtype, self.device
        m, n = len(self.losses), len(self.in_values) // 4
        f32 = torch.float32
        scalars = [self._zero32 if v is None else v.detach().to(dev, f32).reshape(())
                   for v in (grad_norm, param_sq, update_sq, loss_scale)]
        raw = torch.stack(scalars + self.losses + self.in_values).to(dt)
        bad = (raw - raw) != 0  # x - x is NaN exactly where x is NaN or infinite
        clean = raw.masked_fill(bad, 0.0)
        sums_map, absmax_map = self._maps(m, n)
        squares = clean * clean
        if dt != torch.float64:  # a float32 square can overflow, and 0 * inf would spoil every other sum
            squares = squares.clamp_(max=torch.finfo(dt).max)
        # Every summed value is a fixed linear map of the window's values: one product instead of a slice each.
        sums = sums_map @ torch.cat([clean, squares, bad, raw != raw, ~bad])
        flags = sums[:2] > 0  # this rank's loss, its inputs had a NaN/inf
        absmax = (clean * absmax_map).amax(0, keepdim=True)  # max(max, -min) over the input tensors
        numel = torch.full((1,), float(self.in_numel), dtype=dt, device=dev)
        # A rank with a non-finite input adds nothing to the input statistics (its flag says why).
        inputs = torch.where(flags[1], 0.0, torch.cat([sums[7:], absmax, numel]))
        # The device values in DEVICE_VALUES order, then the host ones in HOST_VALUES order (Layout.pack_index).
        device = torch.cat([sums[:7], flags, inputs, raw[1:4]])
        key = bucket_hash(self.shape_bucket)
        host = self._host_values([float(self.exceptions > 0), float(stop), max(seconds, 0.0), 1.0,
                                  float(grad_norm is not None), float(param_sq is not None),
                                  slowest_key(seconds, rank), key, -key, float(m),
                                  float(batch_crc or 0), float(batch_crc is not None),
                                  *(-1.0 if v is None else float(v) for v in lr), float(self.oom_batch),
                                  float(self.oom_in_step), -float(self.oom_in_step)])
        buckets = self._buckets() if self.bucket_parts else self._no_buckets
        src = torch.cat([device, host, buckets])
        return src.index_select(0, self._pack_index)

    def _maps(self, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed maps of :meth:`pack` for ``m`` micro-steps and ``n`` input tensors (built once per shape): the
        ``[9, 5 * size]`` matrix whose rows sum DEVICE_VALUES' first nine values from ``(clean, squares, bad, nan,
        finite)``, and the +1/-1 weights whose maximum with the values is the inputs' largest magnitude."""
        maps = self._map_cache.get((m, n))
        if maps is not None:
            return maps
        size = 4 + m + 4 * n  # grad norm, param_sq, update_sq, loss scale, the losses, each input's 4 values
        clean, square, bad, nan, finite = (k * size for k in range(5))  # each block's offset in the product
        losses = torch.arange(4, 4 + m)
        tensors = 4 + m + 4 * torch.arange(n)  # each input tensor's (max, min, sum, norm)
        w = torch.zeros(9, 5 * size, dtype=self.dtype)
        w[0, bad + losses] = 1  # loss_nonfinite
        w[1, bad + 4 + m:bad + size] = 1  # input_nonfinite
        w[2, clean + losses] = 1  # loss_sum
        w[3, finite + losses] = 1  # loss_count
        w[4, clean] = w[5, nan] = w[6, bad] = 1  # grad_norm, norm_nan, norm_nonfinite
        w[7, clean + tensors + 2] = 1  # in_sum
        w[8, square + tensors + 3] = 1  # in_sumsq
        absmax = torch.zeros(size, dtype=self.dtype)
        absmax[tensors], absmax[tensors + 1] = 1.0, -1.0
        if len(self._map_cache) >= 64:  # window shapes a loop never repeats must not grow this without bound
            self._map_cache.clear()
        maps = self._map_cache[(m, n)] = (w.to(self.device), absmax.to(self.device))
        return maps

    def _host_values(self, values: list[float]) -> torch.Tensor:
        """Host-known values on the device: written into a (pinned) host buffer without a torch op, then one
        non-blocking copy (none on a CPU). The buffer is rewritten only after the step's read, long after the copy."""
        self._host_np[:] = values
        return self._host_buf if self.device.type == "cpu" else self._host_buf.to(self.device, non_blocking=True)

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
            v = torch.stack(self.in_values).float().view(-1, 4)[:, :2].abs().amax(1)
            exact = [torch.count_nonzero(~torch.isfinite(x)).float() for x in self.in_tensors]
            per_tensor = torch.cat([torch.stack(exact), v]).tolist()
            k = len(self.in_micro)
            for i, m in enumerate(self.in_micro):
                counts[m] += int(per_tensor[i])
                a = per_tensor[k + i]
                absmax[m] = a if (math.isnan(a) or a > absmax[m]) else absmax[m]
        return [MicroFlags(bad_loss[i], counts[i], absmax[i], self.exception_flags[i]) for i in range(n)]


def shape_bucket(inputs: Sequence[torch.Tensor]) -> str:
    """The default shape bucket of a micro-step: the shape of its first floating input with the most dimensions
    (the latents of an image or video model, batch size included), e.g. ``"2x16x5x32x32"``."""
    best = None
    for x in inputs:
        if x.dim() >= 2 and (best is None or x.dim() > best.dim()):
            best = x
    return "x".join(str(d) for d in best.shape) if best is not None else "default"


def _input_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, min, sum, L2 norm) of one input tensor, 0-d float32 each, on its device (no host sync)."""
    lo, hi = torch.aminmax(x)
    if x.dtype == torch.float32:  # the dtype argument costs a conversion check per call
        return hi, lo, x.sum(), torch.linalg.vector_norm(x)
    f32 = torch.float32
    return hi.to(f32), lo.to(f32), x.sum(dtype=f32), torch.linalg.vector_norm(x, 2, dtype=f32)


def reduce_and_read(local: torch.Tensor, layout: Layout, world_size: int) -> tuple[list[float], list[float]]:
    """``(summary, this rank's own vector)``: two fixed-size all_reduces (SUM over the sum columns, MAX over the
    others) and ONE host read for the whole step. With one process the summary is the rank's own vector."""
    if world_size <= 1:
        mine = local.tolist()  # the host sync
        return mine, mine
    k = layout.sum_width
    sums, maxes = local[:k].clone(), local[k:].clone()
    dist.all_reduce(sums, dist.ReduceOp.SUM)
    dist.all_reduce(maxes, dist.ReduceOp.MAX)
    flat = torch.cat([sums, maxes, local]).tolist()  # the host sync
    n = local.numel()
    return flat[:n], flat[n:]


def reduce_rows(rows: Sequence[Sequence[float]], layout: Layout) -> list[float]:
    """The summary :func:`reduce_and_read`'s two all_reduces produce from these ranks' vectors (a simulated
    collective, for benchmarks and tests)."""
    k = layout.sum_width
    return [sum(c) for c in zip(*(r[:k] for r in rows))] + [max(c) for c in zip(*(r[k:] for r in rows))]


def gather_rows(local: torch.Tensor, world_size: int) -> list[list[float]]:
    """Every rank's vector, ``rows[r]`` rank ``r``'s: the per-rank detail of a step whose summary shows something
    (a collective every rank enters, since every rank has the same summary). Costs O(world) bytes: never on a
    healthy step."""
    if world_size <= 1:
        return [local.tolist()]
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)
    return torch.stack(parts).tolist()
