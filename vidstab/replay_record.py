"""What ``vidstab replay`` needs to rebuild an incident without code from the user, recorded at attach.

For a diffusers model (a ``ConfigMixin`` with ``from_config``: UNets, transformers, VAEs), :func:`model_spec_of`
records its class and config, so a replay rebuilds it the way ``from_config`` does. The loss is not needed
either: :class:`OutputGradients` keeps, for each micro-step of the optimizer step, the gradient that reached
the model's output -- where the backward started from. An incident bundle stores it beside the model's
inputs (:data:`OUTPUT_GRAD_KEY`), and the replay's loss (:data:`OUTPUT_GRAD_LOSS`) is ``sum(output x that
gradient)``, whose gradients with respect to the weights are the step's own. A user's ``model_spec`` (a
factory, a loss function) takes precedence over all of this.
"""

from __future__ import annotations

from typing import Any

import torch

OUTPUT_GRAD_KEY = "vidstab_output_grad"
"""The bundle's tensor holding the gradient at the model's output (the rest are the model's inputs)."""
OUTPUT_GRAD_LOSS = "vidstab.tools.replay.output_grad:output_grad_loss"
"""The replay loss for bundles that hold :data:`OUTPUT_GRAD_KEY`."""


def model_spec_of(model: torch.nn.Module) -> dict | None:
    """``{"class", "config", "loss_fn"}`` for a diffusers ``ConfigMixin`` model; None for any other model, and
    for one holding PEFT adapters (a replay would rebuild it without them)."""
    config = getattr(model, "config", None)
    cls = type(model)
    if getattr(model, "peft_config", None):
        return None
    if config is None or not callable(getattr(cls, "from_config", None)) or not hasattr(config, "items"):
        return None
    spec = {"class": f"{cls.__module__}:{cls.__qualname__}", "config": _plain(dict(config.items())),
            "loss_fn": OUTPUT_GRAD_LOSS}
    return spec


def _plain(value: Any) -> Any:
    """JSON values (tuples and sets as lists, anything else not JSON as its ``str``)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def first_tensor(output: Any) -> torch.Tensor | None:
    """The model's output tensor: the output itself, or the first tensor of a ``ModelOutput``/dict/tuple."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class OutputGradients:
    """The gradient at the model's output of each micro-step of the current optimizer step (references, no
    copies), through a forward hook on the model and a tensor hook on its output. ``accelerator``'s
    ``sync_gradients`` marks a window's last micro-step: the next forward starts a new window."""

    def __init__(self, model: torch.nn.Module, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.grads: list[torch.Tensor] = []
        self._window_done = False
        self.handle = model.register_forward_hook(self._on_output)

    def _on_output(self, module: Any, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensor = first_tensor(output)
        if tensor is None or not tensor.requires_grad:
            return
        if self._window_done:
            self.grads.clear()
            self._window_done = False
        tensor.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.grads.append(grad.detach())
        self._window_done = bool(self.accelerator.gradient_state.sync_gradients)

    def grad(self, micro_step: int) -> torch.Tensor | None:
        """The gradient at the output of micro-step ``micro_step`` of the step (None if none was seen)."""
        return self.grads[micro_step] if 0 <= micro_step < len(self.grads) else None

    def remove(self) -> None:
        self.handle.remove()
        self.grads.clear()
