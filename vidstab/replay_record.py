"""What ``vidstab replay`` needs to rebuild an incident without code from the user, recorded at attach.

For a diffusers model (a ``ConfigMixin`` with ``from_config``: UNets, transformers, VAEs), :func:`model_spec_of`
records its class and config, so a replay rebuilds it the way ``from_config`` does, and for one holding PEFT
adapters (LoRA) also the adapters and where its base came from (:mod:`vidstab.adapter_record`). The loss is
not needed either: :class:`OutputGradients` keeps, for each micro-step of the optimizer step, the gradient
that reached the model's output -- where the backward started from. An incident bundle stores it beside the model's
inputs (:data:`OUTPUT_GRAD_KEY`), and the replay's loss (:data:`OUTPUT_GRAD_LOSS`) is ``sum(output x that
gradient)``, whose gradients with respect to the weights are the step's own. A user's ``model_spec`` (a
factory, a loss function) takes precedence over all of this.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

OUTPUT_GRAD_KEY = "vidstab_output_grad"
"""The bundle's tensor holding the gradient at the model's output (the rest are the model's inputs)."""
OUTPUT_GRAD_LOSS = "vidstab.tools.replay.output_grad:output_grad_loss"
"""The replay loss for bundles that hold :data:`OUTPUT_GRAD_KEY`."""


def model_spec_of(model: torch.nn.Module) -> dict | None:
    """``{"class", "config", "loss_fn"}`` for a diffusers ``ConfigMixin`` model, plus ``"peft"`` for one holding
    PEFT adapters (:mod:`vidstab.adapter_record`); None for any other model, and for adapters it cannot record."""
    config = getattr(model, "config", None)
    cls = type(model)
    if config is None or not callable(getattr(cls, "from_config", None)) or not hasattr(config, "items"):
        return None
    spec = {"class": f"{cls.__module__}:{cls.__qualname__}", "config": plain_json(dict(config.items())),
            "loss_fn": OUTPUT_GRAD_LOSS}
    if getattr(model, "peft_config", None):
        from .adapter_record import adapter_spec_of

        spec["peft"] = adapter_spec_of(model)
        if spec["peft"] is None:  # a replay would rebuild it without its adapters
            return None
    return spec


def plain_json(value: Any) -> Any:
    """JSON values (enums by value, tuples as lists, sets as sorted lists, anything else not JSON as its ``str``)."""
    if isinstance(value, enum.Enum):
        return plain_json(value.value)
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((plain_json(v) for v in value), key=str)
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
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
