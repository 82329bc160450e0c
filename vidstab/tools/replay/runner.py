"""Running variants of the captured step: reset to the same weights and seed, forward + backward, one update."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch
from torch import nn

from ...evidence.localize import locate_nonfinite
from .base import ReplayError
from .report import RunResult, _fmt


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # NaN == NaN bitwise


class _Replayer:
    """Holds the rebuilt model, its starting weights, the batch and the loss; runs variants of the step."""

    def __init__(self, model: nn.Module, loss_fn: Callable, loss_kwargs: dict, batch: dict[str, torch.Tensor],
                 device: torch.device, seed: int, catch_errors: bool = False) -> None:
        # Replaying an ``exception`` incident: a raising run is the reproduced failure, not an unreplayable bundle.
        self.catch_errors = catch_errors
        self.model = model.to(device).float().train()
        self.loss_fn = loss_fn
        self.loss_kwargs = loss_kwargs
        self.device = device
        self.seed = seed
        self.batch = {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in batch.items()}
        # Every run starts from the same weights (an update test changes them).
        self.state0 = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def reset(self) -> None:
        self.model.load_state_dict(self.state0)
        for p in self.model.parameters():
            p.grad = None
        torch.manual_seed(self.seed)  # same dropout masks / random ops in every run
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(self.seed)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.loss_fn(self.model, batch, **self.loss_kwargs)
        if isinstance(out, dict) and "loss" in out:
            out = out["loss"]
        elif isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise ReplayError(f"the loss_fn returned a {type(out).__name__}, not a Tensor")
        return out

    def autocast(self, dtype: torch.dtype | None):
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def run(self, label: str, batch: dict[str, torch.Tensor] | None = None, *, dtype: torch.dtype | None = None,
            backward: bool = True) -> RunResult:
        """Reset, run loss (mean of the loss_fn's output) and its backward; gradients stay in ``param.grad``."""
        try:
            return self._run(label, batch, dtype, backward)
        except ReplayError:
            raise
        except Exception as e:
            if not self.catch_errors:
                raise
            return RunResult(label, float("nan"), False, None, False, note="raised", error=f"{type(e).__name__}: {e}"[:300])

    def _run(self, label: str, batch: dict[str, torch.Tensor] | None, dtype: torch.dtype | None,
             backward: bool) -> RunResult:
        batch = self.batch if batch is None else batch
        self.reset()
        with self.autocast(dtype):
            out = self.loss(batch)
        out = out.float()
        loss_finite = bool(torch.isfinite(out.detach()).all())
        loss = out.mean()
        grad_norm = grads_finite = None
        if backward and loss.requires_grad:
            loss.backward()
            grad_norm, grads_finite = self.grad_summary()
        return RunResult(label, float(loss.detach()), loss_finite, grad_norm, grads_finite)

    def grad_summary(self) -> tuple[float, bool]:
        sq = 0.0
        finite = True
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad.detach()
                finite = finite and bool(torch.isfinite(g).all())
                sq += float(g.double().pow(2).sum())
        return (math.sqrt(sq) if math.isfinite(sq) else float("nan")), finite

    def grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]

    def subset(self, keep: Sequence[int], bsz: int) -> dict[str, torch.Tensor]:
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        return {k: (v.index_select(0, idx) if v.ndim >= 1 and v.shape[0] == bsz else v) for k, v in self.batch.items()}

    def localize(self, batch: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> dict:
        batch = self.batch if batch is None else batch
        self.reset()

        def fn() -> torch.Tensor:
            with self.autocast(dtype):
                return self.loss(batch).float().mean()

        try:
            return locate_nonfinite(self.model, fn, keep_grads=True)
        except Exception as e:  # only reachable when replaying an exception incident (the run raised too)
            if not self.catch_errors:
                raise
            return {"forward": None, "backward": None, "loss_finite": False, "error": f"{type(e).__name__}: {e}"[:300]}

    def update_test(self, label: str, batch: dict[str, torch.Tensor], lr: float, optimizer: str,
                    max_grad_norm: float | None) -> tuple[RunResult, float]:
        """One fresh-optimizer step from the starting weights at ``lr`` on ``batch``.

        Returns the run (its loss is the loss *after* the update, its grad norm the one before) and the
        ratio loss-after / loss-before (``inf`` when the loss after is non-finite).
        """
        before = self.run(label, batch)
        if not before.finite:
            return RunResult(label, float("nan"), False, before.grad_norm, before.grads_finite,
                             note="gradients non-finite before the update"), math.inf
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr)
        opt.step()
        torch.manual_seed(self.seed)
        with torch.no_grad():
            after = self.loss(batch).float()
        after_loss = float(after.mean())
        finite = bool(torch.isfinite(after).all())
        ratio = after_loss / before.loss if before.loss > 0 and finite else (1.0 if finite else math.inf)
        return RunResult(label, after_loss, finite, before.grad_norm, before.grads_finite,
                         note=f"loss before {before.loss:.6g} -> after {_fmt(after_loss)} (x{ratio:.3g})"), ratio


def _precision_dtype(precision: str | None) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}.get(
        str(precision).lower() if precision else ""
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp16"
