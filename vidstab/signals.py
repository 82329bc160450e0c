"""On-device statistics of one accumulation window, packed into one small tensor.

Nothing here reads a value back to the host. :class:`Window` accumulates per-micro-step loss and input
statistics on the device; :meth:`Window.pack` builds the rank's row ``[k]``; :func:`gather_and_read`
gathers the rows of all ranks into a ``[world, k]`` table with ONE collective and reads it (plus the
rank-local per-micro-step rows) with ONE host transfer.

Row layout (``Layout``), float64 (float32 on MPS):

    grad_norm, norm_available, loss_sum, loss_count, loss_nonfinite, exceptions,
    in_absmax, in_sum, in_sumsq, in_count, in_nonfinite, stop,
    param_pending, param_sq, update_sq, loss_scale, bucket_sum[nb], bucket_count[nb]

``param_sq``/``update_sq`` are sums of squares of the *local* parameters (and of the last update). Under
DDP they are identical on every rank; under FSDP each rank holds a shard, so the guard sums them over
ranks (``sharded=True``) before taking the square root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

GRAD_NORM, NORM_OK, LOSS_SUM, LOSS_COUNT, LOSS_NONFINITE, EXCEPTIONS = range(6)
IN_ABSMAX, IN_SUM, IN_SUMSQ, IN_COUNT, IN_NONFINITE, STOP = range(6, 12)
PARAM_PENDING, PARAM_SQ, UPDATE_SQ, LOSS_SCALE = range(12, 16)
FIXED = 16
#: per-micro-step local row: loss non-finite, input non-finite count, input absmax, exception
MICRO_COLS = 4


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


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2 / tensor-parallel shards)."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


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


def global_grad_norm(accelerator: Any, params: Iterable[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor | None:
    """Global pre-clip gradient L2 norm, clipping to ``max_norm`` on the way (``None``: no clipping).

    With an ``accelerator`` this is ``accelerator.clip_grad_norm_`` (unscales fp16 grads first; DDP grads
    are already all-reduced; FSDP2 norms are DTensors and are made full here). Without one (tests,
    plain FSDP2) the same DTensor-aware computation is done directly. Under DeepSpeed Accelerate returns
    the engine's norm of the step it already applied, a float, or ``None``: returned as a tensor or None.
    No host sync.
    """
    params = list(params)
    limit = float("inf") if max_norm is None else float(max_norm)
    if accelerator is not None:
        norm = accelerator.clip_grad_norm_(params, limit)
    else:
        norm = _clip_dtensor_aware(params, limit)
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


class Window:
    """On-device accumulator of one gradient-accumulation window of one rank."""

    def __init__(self, device: torch.device, buckets: int, num_train_timesteps: float, input_keys: Sequence[str]):
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.layout = Layout(buckets)
        self.num_train_timesteps = float(num_train_timesteps)
        self.input_keys = tuple(input_keys)
        self.reset()

    def reset(self) -> None:
        """Start a new window (called after each optimizer step)."""
        self.acc = torch.zeros(self.layout.width, device=self.device, dtype=self.dtype)
        self.micro: list[torch.Tensor] = []

    def record(
        self,
        loss: torch.Tensor,
        batch: Mapping[str, Any] | None,
        per_sample_loss: torch.Tensor | None,
        timesteps: torch.Tensor | None,
        error: bool,
    ) -> None:
        """Fold one micro-step into the window, on device, without any host sync."""
        dt, dev = self.dtype, self.device
        loss_d = loss.detach().to(dev, dt).mean() if loss.numel() else torch.zeros((), device=dev, dtype=dt)
        finite = torch.isfinite(loss_d)
        # [loss_sum, loss_count, loss_nonfinite, exceptions] then [absmax, sum, sumsq, count, nonfinite]:
        # built as one vector so the window update is a couple of ops (this runs every micro-step).
        loss_part = torch.stack([torch.nan_to_num(loss_d, nan=0.0, posinf=0.0, neginf=0.0), finite.to(dt),
                                 (~finite).to(dt), torch.full((), float(error), device=dev, dtype=dt)])
        inputs = [x.detach() for x in (batch.get(k) if batch is not None else None for k in self.input_keys)
                  if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 0]
        if inputs:
            per_key = []
            for x in inputs:
                # Finite-only statistics in fp32 (no fp64 copy of the latents); non-finite values count apart.
                xz = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
                nonfinite = (xz != x).sum()  # NaN != anything; an inf became 0
                per_key.append(torch.stack([
                    torch.linalg.vector_norm(xz, ord=math.inf, dtype=torch.float32),
                    xz.sum(dtype=torch.float32),
                    torch.linalg.vector_norm(xz, ord=2, dtype=torch.float32).square(),
                    (x.numel() - nonfinite).float(), nonfinite.float(),
                ]).to(dev, dt))
            if len(per_key) == 1:
                in_part = per_key[0]
            else:  # several input tensors: the largest absmax, the other statistics summed
                keys = torch.stack(per_key)
                in_part = torch.cat([keys[:, :1].amax(0), keys[:, 1:].sum(0)])
        else:
            in_part = torch.zeros(5, device=dev, dtype=dt)
        self.acc[LOSS_SUM:EXCEPTIONS + 1] += loss_part
        self.acc[IN_ABSMAX] = torch.maximum(self.acc[IN_ABSMAX], in_part[0])
        self.acc[IN_SUM:IN_NONFINITE + 1] += in_part[1:]
        if per_sample_loss is not None and timesteps is not None:
            self._buckets(per_sample_loss, timesteps)
        self.micro.append(torch.stack([loss_part[2], in_part[4], in_part[0], loss_part[3]]))

    def _buckets(self, per_sample_loss: torch.Tensor, timesteps: torch.Tensor) -> None:
        nb = self.layout.buckets
        psl = per_sample_loss.detach().reshape(-1).to(self.device, self.dtype)
        t = timesteps.detach().reshape(-1).to(self.device, self.dtype)
        if t.numel() != psl.numel():
            return  # shapes the guard cannot pair up; documented: both must be [B]
        idx = (t * nb / self.num_train_timesteps).long().clamp_(0, nb - 1)
        fin = torch.isfinite(psl)
        self.acc[self.layout.bucket_sum] += torch.zeros(nb, device=self.device, dtype=self.dtype).index_add_(
            0, idx, torch.where(fin, psl, torch.zeros_like(psl)))
        self.acc[self.layout.bucket_count] += torch.zeros(nb, device=self.device, dtype=self.dtype).index_add_(
            0, idx, fin.to(self.dtype))

    def pack(
        self,
        grad_norm: torch.Tensor | None,
        stop: bool,
        param_sq: torch.Tensor | None,
        update_sq: torch.Tensor | None,
        loss_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The rank's row ``[k]`` for this step (window sums + step-time values). No host sync."""
        row = self.acc.clone()
        dt, dev = self.dtype, self.device
        if grad_norm is not None:
            row[GRAD_NORM] = grad_norm.detach().reshape(()).to(dev, dt)
            row[NORM_OK] = 1.0
        else:
            row[GRAD_NORM] = math.nan
        row[STOP] = float(stop)
        if param_sq is not None:
            row[PARAM_PENDING] = 1.0
            row[PARAM_SQ] = param_sq.reshape(()).to(dev, dt)
            row[UPDATE_SQ] = (update_sq if update_sq is not None else torch.zeros(())).reshape(()).to(dev, dt)
        row[LOSS_SCALE] = loss_scale.reshape(()).to(dev, dt) if loss_scale is not None else -1.0
        return row

    def micro_rows(self) -> torch.Tensor:
        """``[micro_steps, MICRO_COLS]`` local per-micro-step flags (kept rank-local, never gathered)."""
        if not self.micro:
            return torch.zeros((0, MICRO_COLS), device=self.device, dtype=self.dtype)
        return torch.stack(self.micro)


def gather_and_read(accelerator: Any, row: torch.Tensor, micro: torch.Tensor) -> tuple[list[list[float]], list[list[float]]]:
    """ONE collective (``accelerator.gather``) and ONE host read for the whole step.

    Returns ``(table, micro)``: ``table[r]`` is rank ``r``'s row; ``micro`` this rank's micro rows.
    """
    k = row.numel()
    table = accelerator.gather(row.reshape(1, k)) if accelerator is not None else row.reshape(1, k)
    table = table.reshape(-1, k)
    world = table.shape[0]
    flat = torch.cat([table.reshape(-1), micro.reshape(-1).to(table.device, table.dtype)]).tolist()  # the host sync
    rows = [flat[i * k:(i + 1) * k] for i in range(world)]
    rest = flat[world * k:]
    micro_rows = [rest[i * MICRO_COLS:(i + 1) * MICRO_COLS] for i in range(len(rest) // MICRO_COLS)]
    return rows, micro_rows
