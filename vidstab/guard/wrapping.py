"""The unmodified loop: patches on the user's own instances (what ``vidstab.attach`` does).

``accelerator.backward(loss)`` records the micro-step with the model's inputs (seen by a forward pre-hook); an
out-of-memory in the model's forward becomes a skipped step (:mod:`vidstab.guard.forward_oom`);
``accelerator.clip_grad_norm_`` hands over the global pre-clip norm; ``optimizer.step()`` runs the guarded step
on the last micro-step; ``lr_scheduler.step()`` is held right after a skipped step. The instances are wrapped,
not the classes; :meth:`UserLoopPatches.remove` undoes it all.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import signals
from .forward_oom import ForwardOOM

if TYPE_CHECKING:
    from .core import Guard

ATTACHED_ATTR = "_vidstab_guard"
"""Set on the optimizer a guard is attached to (``attach`` is idempotent)."""


class UserLoopPatches:
    """Stands in for the user's own calls and hands what they carry to the guard."""

    def __init__(self, guard: "Guard") -> None:
        self.guard = guard
        self.patches: list[tuple[Any, str, bool, Any]] = []
        self.handles: list[Any] = []
        self.model_inputs: tuple[tuple, dict] | None = None  # (args, kwargs) of the latest forward with grad
        self.user_norm: tuple[torch.Tensor | None, float] | None = None  # from the user's clip_grad_norm_
        self.sample_ids: list[str] | None = None  # the current batch's, from guard.track_samples(loader)
        self.forward_oom: ForwardOOM | None = None  # the model's forward, an OOM in it a skipped step (install)
        forward = getattr(guard.accelerator.unwrap_model(guard.model), "forward", None)
        try:
            self.forward_names = [n for n, p in inspect.signature(forward).parameters.items()
                                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self.forward_names = []

    def install(self) -> None:
        g = self.guard
        self._patch(g.accelerator, "backward", self.backward)
        self._patch(g.accelerator, "clip_grad_norm_", self.clip_grad_norm)
        self._patch(g.optimizer, "step", self.optimizer_step)
        if g.lr_scheduler is not None:
            self._patch(g.lr_scheduler, "step", self.scheduler_step)
        self.handles.append(g.model.register_forward_pre_hook(self.see_model_inputs, with_kwargs=True))
        inner = g.accelerator.unwrap_model(g.model)  # inside DDP's forward: its collectives already ran as usual
        self.forward_oom = ForwardOOM(g, inner.forward)
        self._patch(inner, "forward", self.forward_oom)
        setattr(g.optimizer, ATTACHED_ATTR, g)

    def remove(self) -> None:
        for obj, name, had, old in reversed(self.patches):
            if had:
                setattr(obj, name, old)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
        self.patches.clear()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if getattr(self.guard.optimizer, ATTACHED_ATTR, None) is self.guard:
            delattr(self.guard.optimizer, ATTACHED_ATTR)

    def _patch(self, obj: Any, name: str, fn: Callable) -> None:
        had = name in vars(obj)
        self.patches.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, fn)

    def see_model_inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: references to the inputs of the latest forward with grad enabled (the one the next
        backward is most likely about; a forward without a backward is simply replaced)."""
        if torch.is_grad_enabled():
            self.model_inputs = (args, kwargs)

    def named_inputs(self, inputs: tuple[tuple, dict]) -> dict[str, torch.Tensor]:
        """Every tensor of a forward's ``(args, kwargs)``, named after ``forward``'s parameters."""
        args, kwargs = inputs
        names = self.forward_names
        batch = {(names[i] if i < len(names) else f"arg{i}"): a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        batch.update((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return batch

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The user's ``accelerator.backward(loss)``: the original, then the micro-step's record."""
        g = self.guard
        if not g.config.enabled or self.model_inputs is None:
            # This guard's model did not run since the last backward: another model's loss (a second guard on
            # the same accelerator, an unguarded model) passes straight through.
            return g.original_backward(loss, **kwargs)
        inputs, self.model_inputs = self.model_inputs, None
        named = self.named_inputs(inputs)
        if g.config.input_keys is not None:
            data: Any = named
        else:  # per-sample scalars (timesteps, sigmas: [B] up to 1000) are not data: they would hide the latents' scale
            data = [t for t in named.values() if t.dim() >= 2]
        last = g.accelerator.sync_gradients
        g.record_backward(loss, data, named, self.sample_ids, backward_kwargs=kwargs)
        if g.engine.steps_at_backward and last:  # Accelerate steps this engine (DeepSpeed) here: judged first
            self.judged_step(*g.engine.pre_step_norm(None))

    def clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
        """The user's ``accelerator.clip_grad_norm_``: the original; its pre-clip norm feeds the guard."""
        g = self.guard
        norm = g.original_clip(parameters, max_norm, norm_type, **kwargs)
        if not g.recorder.empty and g.accelerator.sync_gradients and float(norm_type) == 2.0:
            self.user_norm = (signals.norm_tensor(norm), float(max_norm))
        return norm

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``optimizer.step()``: the guarded step on the last micro-step, else the original."""
        g = self.guard
        if g.engine.steps_at_backward:  # stepped at the last micro-step's backward
            return None
        if not g.config.enabled or not g.accelerator.sync_gradients:
            return g.control.optimizer_step(*args, **kwargs)
        if self.user_norm is not None:
            norm, max_norm = self.user_norm
        else:  # the loop does not clip: measure the global norm once, without clipping
            norm, max_norm = g.engine.pre_step_norm(None)
        self.user_norm = None
        self.judged_step(norm, max_norm)
        return None

    def judged_step(self, norm: torch.Tensor | None, max_norm: float | None) -> None:
        """The guarded step of the user's loop, then the automatic rollback's turn (``rollback_every``): the one
        path of every engine (DeepSpeed's comes from ``backward``, the others' from ``optimizer.step()``)."""
        g = self.guard
        result = g.guarded_step(norm, max_norm, step_scheduler=False)
        if g.rollback_not_kept is not None:
            g.rollback_not_kept.after_step(result)
        if g.console is not None:
            g.console.after_step(result)
        if g.auto_rollback is not None:
            g.auto_rollback.after_step()

    def scheduler_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``lr_scheduler.step()``: held right after a skipped optimizer step."""
        g = self.guard
        if g.control.scheduler_held and g.accelerator.sync_gradients:
            return None
        return g.control.scheduler_step(*args, **kwargs)
