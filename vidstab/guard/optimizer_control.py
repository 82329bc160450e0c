"""Acting on a judged step: the only place the guard touches the optimizer, the scheduler and the scaler.

Apply: ``optimizer.step()`` (the original, also when the instance is wrapped), then in ``guard.step`` the
scheduler and ``zero_grad``. Skip: the gradients set to None, the scheduler held until the next applied step,
``optimizer._is_overflow`` set so that ``accelerator.optimizer_step_was_skipped`` is true and Accelerate's
``AcceleratedScheduler.step`` does nothing, and a GradScaler's step closed without stepping. Every
``param_norm_every`` steps the weights' and the update's sums of squares are taken around an applied step and
left on the device for the next step's read (:class:`~vidstab.guard.param_probe.ParamProbe`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..engines import Engine
from ..recovery.oom import WriteOrder, is_oom, release
from .param_probe import ParamProbe


class OptimizerControl:
    """Owns the optimizer's and the scheduler's step functions (the originals) and whether the scheduler is held."""

    def __init__(self, accelerator: Any, optimizer: Any, lr_scheduler: Any, params: list[torch.nn.Parameter],
                 param_norm_every: int, engine: Engine) -> None:
        self.accelerator, self.optimizer, self.lr_scheduler = accelerator, optimizer, lr_scheduler
        self.engine = engine
        """The training engine (:mod:`vidstab.engines`): its step function, its part of a skip, the weights it steps."""
        self.optimizer_step = engine.optimizer_step(optimizer)
        self.scheduler_step = lr_scheduler.step if lr_scheduler is not None else None
        self.probe = ParamProbe(engine.step_weights())
        self.param_norm_every = param_norm_every
        self.trainable = [p for p in params if p.requires_grad]
        self.write_order = WriteOrder(optimizer)
        """Which tensors the optimizer's step writes first: what the marks of an OOM inside it read."""
        self.step_oom: tuple[BaseException, bool] | None = None
        """The last ``apply`` ran out of memory inside the optimizer step: the error and whether the step had
        touched a weight or the optimizer's state (:class:`vidstab.recovery.oom.StepMarks`); the guard takes it."""
        self.scheduler_held = False
        """A step was skipped: the user's next ``lr_scheduler.step()`` does nothing."""
        self.param_sums: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        """``(param_sq, update_sq)`` of the last measured step, on the device, for the next step's vector."""

    def measures(self, step: int) -> bool:
        """Whether ``step`` measures the weights and the update (every ``param_norm_every`` steps)."""
        every = self.param_norm_every
        return every > 0 and step % every == 0 and bool(self.probe)

    def take_param_sums(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        sums, self.param_sums = self.param_sums, (None, None)
        return sums

    def loss_scale(self) -> torch.Tensor | None:
        """The GradScaler's scale as a device tensor (``get_scale()`` would sync), or None without one."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        scale = scaler._get_scale_async()
        return scale if scale is not None else torch.tensor(float(scaler._init_scale))

    def apply(self, measure: bool, step_scheduler: bool) -> bool:
        """The optimizer step (under fp16 the scaler may still skip it: read back); ``step_scheduler``: also the
        scheduler and ``zero_grad`` (``guard.step``; the user's loop makes its own calls). Returns whether the
        weights changed."""
        opt = self.optimizer
        self.scheduler_held = False
        before = self.probe.snapshot() if measure else None
        _set_skipped(opt, False)  # Accelerate only resets this flag under a GradScaler
        # None where the step gathers across ranks (DeepSpeed): an OOM there leaves the peers waiting, nothing to judge
        # (touched: None) and no skip to take in lockstep; the guard stops the process.
        marks = self.engine.step_marks(self.write_order, self.trainable)
        try:
            self.optimizer_step()
        except Exception as exc:
            if not is_oom(exc):
                raise
            self.step_oom = (exc, marks.judge() if marks is not None else None)
            release(exc, self.accelerator.device)
            if marks is not None:
                self.skip(measure)  # the gradients dropped, the schedule held: the rank did not take the step
            return False
        applied = not bool(getattr(opt, "step_was_skipped", False))
        if step_scheduler:
            if applied and self.scheduler_step is not None:
                self.scheduler_step()
            opt.zero_grad(set_to_none=True)
        if measure:
            self.param_sums = self.probe.sums(before)
        return applied

    def skip(self, measure: bool) -> None:
        """Drop the step: poisoned gradients are never used, the schedule waits for the next applied step.
        ``measure``: take the weights' norm (no update to measure)."""
        self.scheduler_held = True
        self.optimizer.zero_grad(set_to_none=True)
        self.engine.skip()  # DeepSpeed's own overflow path: grads dropped, its scheduler held
        _set_skipped(self.optimizer, True)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:  # clip_grad_norm_ unscaled: close the scaler's step without stepping
            try:
                scaler.update()
            except (AssertionError, RuntimeError):
                pass
        if measure:
            self.param_sums = self.probe.sums(None)

    def plain_step(self, clip: Any, params: list, max_grad_norm: float | None) -> None:
        """``enabled=False``: exactly a plain Accelerate step."""
        if max_grad_norm is not None:
            clip(params, max_grad_norm)
        self.optimizer_step()
        if self.scheduler_step is not None:
            self.scheduler_step()
        self.optimizer.zero_grad(set_to_none=True)


def _set_skipped(optimizer: Any, skipped: bool) -> None:
    """Set AcceleratedOptimizer's overflow flag, read by ``accelerator.optimizer_step_was_skipped`` and by
    AcceleratedScheduler (which then holds the schedule)."""
    if hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = skipped
