"""Types checked like shapes: every tensor a checkpoint hands to a receiver (a model's parameter, an optimizer's
or an EMA's state, an RNG state) has the dtype and shape the receiver holds, or the checkpoint is refused naming
the tensor. ``load_state_dict`` casts silently (an ``F16`` or ``I32`` moment loaded into an ``F32`` optimizer
becomes F32 without a word); here a cast happens only when asked for (``CheckpointConfig.cast_dtypes``,
floating point to floating point), and each one is logged.

What the receiver holds is read from it: its current state where it has one; an optimizer of ``torch.optim``
that holds no state yet (a fresh process) expects each state tensor shaped like its parameter to have the
parameter's dtype (``step``: torch's scalar dtype), which is what its own ``load_state_dict`` casts to.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .config import CheckpointError

__all__ = ["check_like", "optimizer_expectation", "log_casts"]

logger = logging.getLogger("vidstab.checkpoint")


def _short(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(ckpt: str, where: str, t: Any, ref: Any, cast: bool, casts: list[str]) -> Any:
    shape, want_shape = tuple(t.shape), tuple(ref.shape)
    if shape != want_shape:
        raise CheckpointError(f"{ckpt}: {where} has shape {shape}, the receiver holds {want_shape}")
    if t.dtype == ref.dtype:
        return t
    floating = (t.dtype.is_floating_point and ref.dtype.is_floating_point if isinstance(t, torch.Tensor)
                else np.issubdtype(t.dtype, np.floating) and np.issubdtype(ref.dtype, np.floating))
    if cast and floating:
        casts.append(f"{where} {_short(t.dtype)}->{_short(ref.dtype)}")
        return t.to(ref.dtype) if isinstance(t, torch.Tensor) else t.astype(ref.dtype)
    hint = (" (a precision change on purpose? CheckpointConfig(cast_dtypes=True) casts it, logged)" if floating
            else "")
    raise CheckpointError(f"{ckpt}: {where} is {_short(t.dtype)}, the receiver holds {_short(ref.dtype)}{hint}")


def check_like(ckpt: str, where: str, saved: Any, current: Any, cast: bool = False,
               casts: list[str] | None = None) -> Any:
    """``saved`` with every tensor (or numpy array) that ``current`` has at the same place checked against it
    (dtype and shape; :class:`CheckpointError` naming ``where`` + the path otherwise); with ``cast``, a
    floating tensor of another floating dtype is cast and recorded in ``casts``. Places only one side has
    are left to the receiver's own ``load_state_dict``."""
    casts = [] if casts is None else casts
    if (isinstance(saved, torch.Tensor) and isinstance(current, torch.Tensor)) or (
            isinstance(saved, np.ndarray) and isinstance(current, np.ndarray)):
        return _check_tensor(ckpt, where, saved, current, cast, casts)
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: check_like(ckpt, f"{where}.{k}", v, current[k], cast, casts) if k in current else v
                for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)) and len(saved) == len(current):
        out = [check_like(ckpt, f"{where}[{i}]", v, c, cast, casts) for i, (v, c) in enumerate(zip(saved, current))]
        return tuple(out) if isinstance(saved, tuple) else out
    return saved


def optimizer_expectation(optimizer: Any, saved: Any) -> dict:
    """What ``optimizer`` expects of the saved state ``saved`` (see the module doc): its own state where it
    has one, else (``torch.optim`` optimizers) its parameters' dtypes and shapes, as meta tensors."""
    inner = getattr(optimizer, "optimizer", optimizer)
    current = inner.state_dict()
    state = dict(current.get("state", {}))
    if not type(inner).__module__.startswith("torch.optim") or not isinstance(saved, dict):
        return {"state": state}
    params = [p for g in inner.param_groups for p in g["params"]]
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for idx, entry in (saved.get("state") or {}).items():
        if idx in state or not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(entry, dict):
            continue
        p, want = params[idx], {}
        for k, v in entry.items():
            if not isinstance(v, torch.Tensor):
                continue
            if k == "step":
                want[k] = torch.empty((), dtype=scalar, device="meta")
            elif tuple(v.shape) == tuple(p.shape):
                want[k] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        state[idx] = want
    return {"state": state}


def log_casts(ckpt: str, name: str, casts: list[str]) -> None:
    """Log the casts ``cast_dtypes`` made while loading ``name`` from ``ckpt`` (one line)."""
    if casts:
        more = f" and {len(casts) - 5} more" if len(casts) > 5 else ""
        logger.warning("%s: cast %d tensor(s) of %r to the dtype the receiver holds (cast_dtypes=True): %s%s",
                       ckpt, len(casts), name, ", ".join(casts[:5]), more)
