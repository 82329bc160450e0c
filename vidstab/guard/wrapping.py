"""The unmodified loop: the guard's patches on the user's own instances (what ``vidstab.attach`` does).

``accelerator.backward(loss)`` records the loss and the model's floating inputs (seen by a forward
pre-hook); ``accelerator.clip_grad_norm_`` hands over the global pre-clip norm; ``optimizer.step()`` runs
the guarded step on the last micro-step; ``lr_scheduler.step()`` is held right after a skipped step. The
instances are wrapped, not the classes; :meth:`UserLoopWrapping.detach` undoes it all.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .. import signals

ATTACHED_ATTR = "_vidstab_guard"
"""Set on the optimizer a guard is attached to (``attach`` is idempotent)."""


class UserLoopWrapping:
    """The :class:`~vidstab.guard.Guard` methods that patch and stand in for the user's own calls."""

    auto_rollback: Any = None
    """:class:`vidstab.auto_rollback.AutoRollback` when attached with ``rollback_every``: called after each step."""

    def wrap(self) -> Any:
        """Guard the user's own calls on these instances (what :func:`attach` does); undone by :meth:`detach`."""
        if self._patches:
            return self
        self._patch(self.accelerator, "backward", self._user_backward)
        self._patch(self.accelerator, "clip_grad_norm_", self._user_clip_grad_norm)
        self._patch(self.optimizer, "step", self._user_optimizer_step)
        if self.lr_scheduler is not None:
            self._patch(self.lr_scheduler, "step", self._user_scheduler_step)
        forward = getattr(self.accelerator.unwrap_model(self.model), "forward", None)
        try:
            self._forward_names = [n for n, p in inspect.signature(forward).parameters.items()
                                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self._forward_names = []
        self._handles.append(self.model.register_forward_pre_hook(self._see_model_inputs, with_kwargs=True))
        setattr(self.optimizer, ATTACHED_ATTR, self)
        return self

    def detach(self) -> None:
        """Undo :meth:`wrap` and the save/load hooks: the instances behave as before :func:`attach`.
        Idempotent; the event log is flushed (``close`` closes it)."""
        for obj, name, had, old in reversed(self._patches):
            if had:
                setattr(obj, name, old)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
        self._patches.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self.optimizer, ATTACHED_ATTR, None) is self:
            delattr(self.optimizer, ATTACHED_ATTR)
        self.events.flush()

    def _patch(self, obj: Any, name: str, fn: Callable) -> None:
        had = name in vars(obj)
        self._patches.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, fn)

    def _see_model_inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: keep references to the inputs of the latest forward with grad enabled (the one
        the next backward is most likely about; a forward without a backward is simply replaced)."""
        if torch.is_grad_enabled():
            self._model_inputs = (args, kwargs)

    def _model_batch(self, inputs: tuple[tuple, dict]) -> dict[str, torch.Tensor]:
        """Every tensor of a forward's ``(args, kwargs)``, named after ``forward``'s parameters: the incident
        bundle's evidence, built on that cold path only (the step keeps the inputs themselves)."""
        args, kwargs = inputs
        names = self._forward_names
        batch = {(names[i] if i < len(names) else f"arg{i}"): a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        batch.update((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return batch

    def _model_data(self, inputs: tuple[tuple, dict]) -> "list[torch.Tensor] | dict[str, torch.Tensor]":
        """The model inputs whose statistics are recorded. With ``input_keys`` unset, the tensors of two or more
        dimensions: per-sample scalars (flow-matching timesteps or sigmas, ``[B]`` with values up to 1000) are
        not data, they would set the inputs' absmax and RMS and hide the latents' scale. With it set, every
        tensor by name (the window keeps those named). One pass, no names: this runs on every micro-step."""
        if self.config.input_keys is not None:
            return self._model_batch(inputs)
        args, kwargs = inputs
        data = []  # loops, not comprehensions (vidstab.signals.HostRow.finish says why)
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                data.append(a)
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, torch.Tensor) and v.dim() >= 2:
                    data.append(v)
        return data

    def _user_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The user's ``accelerator.backward(loss)``: the original, then the micro-step's on-device flags."""
        if not self.config.enabled or self._model_inputs is None:
            # This guard's model did not run since the last backward: another model's loss (a second
            # guard on the same accelerator, an unguarded model) passes straight through.
            return self._backward(loss, **kwargs)
        # The window's last micro-step: the optimizer step follows. (The attribute Accelerator.sync_gradients
        # reads: one Python call less on each of the wrapped calls, each a cache miss right after a kernel.)
        last = self.accelerator.gradient_state.sync_gradients
        if last:
            self.clock.mark()  # DDP all-reduces inside this backward: the rank's own time ends here
        self._backward(loss, **kwargs)
        inputs, self._model_inputs = self._model_inputs, None
        # The inputs themselves (named only if an incident is captured: Guard._capture).
        self._refs.append((inputs if self.config.capture_incidents else None, None, None))
        self._hold((loss, None, None, None, False, inputs), last)

    def _user_clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
        """The user's ``accelerator.clip_grad_norm_``: the original; its pre-clip norm feeds the guard."""
        norm = self._clip(parameters, max_norm, norm_type, **kwargs)
        if (self._held is not None or self.window.losses) and self.accelerator.gradient_state.sync_gradients and float(norm_type) == 2.0:
            self._user_norm = (norm if type(norm) is torch.Tensor else signals.norm_tensor(norm), float(max_norm))
        return norm

    def _user_optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``optimizer.step()``: the guarded step on the last micro-step, else the original."""
        if not self.config.enabled or not self.accelerator.gradient_state.sync_gradients:
            return self._optimizer_step(*args, **kwargs)
        if self._user_norm is not None:
            norm, max_norm = self._user_norm
        else:  # the loop does not clip: measure the global norm once, without clipping
            norm, max_norm = signals.global_grad_norm(self.accelerator, self._params, None, clip=self._clip), None
        self._guarded_step(norm, max_norm, step_scheduler=False)
        if self.auto_rollback is not None:
            self.auto_rollback.after_step()
        return None

    def _user_scheduler_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``lr_scheduler.step()``: held right after a skipped optimizer step."""
        if self._hold_scheduler and self.accelerator.gradient_state.sync_gradients:
            return None
        return self._scheduler_step(*args, **kwargs)

