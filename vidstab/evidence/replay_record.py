"""What ``vidstab replay`` needs to rebuild an incident without code from the user, recorded at attach.

For a diffusers model (a ``ConfigMixin`` with ``from_config``: UNets, transformers, VAEs), :func:`model_spec_of`
records its class and config, so a replay rebuilds it the way ``from_config`` does, and for one holding PEFT
adapters (LoRA) also the adapters and where its base came from (:mod:`vidstab.evidence.adapter_record`). The loss is
not needed either: :class:`OutputGradients` keeps, for each micro-step of the optimizer step, the gradient
that reached the model's output -- where the backward started from. An incident bundle stores it beside the model's
inputs (:data:`OUTPUT_GRAD_KEY`), and the replay's loss (:data:`OUTPUT_GRAD_LOSS`) is ``sum(output x that
gradient)``, whose gradients with respect to the weights are the step's own. A user's ``model_spec`` (a
factory, a loss function) takes precedence over all of this.

The same record lets the in-job rerun (:mod:`vidstab.recovery.rerun`) re-run a skipped step of the attached form with no
replay function: :meth:`OutputGradients.rerun_batch` gives a micro-step's inputs with its output gradient, and
:func:`output_grad_loss` is the loss both the rerun and ``vidstab replay`` run.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch

OUTPUT_GRAD_KEY = "vidstab_output_grad"
"""The bundle's tensor holding the gradient at the model's output (the rest are the model's inputs)."""
OUTPUT_GRAD_LOSS = "vidstab.tools.replay.output_grad:output_grad_loss"
"""The replay loss for bundles that hold :data:`OUTPUT_GRAD_KEY`."""


def model_spec_of(model: torch.nn.Module) -> dict | None:
    """``{"class", "config", "loss_fn"}`` for a diffusers ``ConfigMixin`` model, plus ``"peft"`` for one holding
    PEFT adapters (:mod:`vidstab.evidence.adapter_record`); None for any other model, and for adapters it cannot record."""
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


def output_grad_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum(output x recorded output gradient)``: its backward gives the weights the gradients of the captured
    step's own backward. ``batch``: the model's inputs by ``forward`` parameter name, plus the gradient."""
    if OUTPUT_GRAD_KEY not in batch:
        raise ValueError(f"the bundle holds no {OUTPUT_GRAD_KEY!r}: record a 'loss_fn' in the model spec instead")
    grad = batch[OUTPUT_GRAD_KEY]
    output = first_tensor(model(**{k: v for k, v in batch.items() if k != OUTPUT_GRAD_KEY}))
    if output is None:
        raise ValueError("the model returned no tensor to take the recorded output gradient against")
    if output.shape != grad.shape:
        raise ValueError(f"the model's output {tuple(output.shape)} does not match the recorded gradient {tuple(grad.shape)}")
    return (output.float() * grad.float()).sum()


def _per_sample(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flags`` ([B]) shaped to broadcast over ``like`` ([B, ...])."""
    return flags.view((-1,) + (1,) * (like.dim() - 1))


class OutputGradients:
    """The gradient at the model's output of each micro-step of the current optimizer step (references, no
    copies), through a forward hook on the model and a tensor hook on its output; with it the micro-step's
    output and its inputs (``name_inputs((args, kwargs))``: the tensors by ``forward`` parameter name), what
    the in-job rerun runs. ``accelerator``'s ``sync_gradients`` marks a window's last micro-step: the next
    forward starts a new window."""

    def __init__(self, model: torch.nn.Module, accelerator: Any,
                 name_inputs: Callable[[tuple[tuple, dict]], dict[str, torch.Tensor]]) -> None:
        self.accelerator, self.name_inputs = accelerator, name_inputs
        self.grads: list[torch.Tensor] = []
        self.steps: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []  # each micro-step's output and inputs
        self._window_done = False
        self.handle = model.register_forward_hook(self._on_output, with_kwargs=True)

    def _on_output(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensor = first_tensor(output)
        if tensor is None or not tensor.requires_grad:
            return
        if self._window_done:
            self.grads.clear()
            self.steps.clear()
            self._window_done = False
        seen = (tensor.detach(), self.name_inputs((args, kwargs)))
        tensor.register_hook(lambda grad: self._on_grad(grad, seen))

    def _on_grad(self, grad: torch.Tensor, seen: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        self.grads.append(grad.detach())
        self.steps.append(seen)
        self._window_done = bool(self.accelerator.gradient_state.sync_gradients)

    def grad(self, micro_step: int) -> torch.Tensor | None:
        """The gradient at the output of micro-step ``micro_step`` of the step (None if none was seen)."""
        return self.grads[micro_step] if 0 <= micro_step < len(self.grads) else None

    def rerun_batch(self, micro_step: int) -> tuple[dict, torch.Tensor] | None:
        """What re-running micro-step ``micro_step`` on the same weights takes without the user's loss: its
        inputs plus the output gradient (:func:`output_grad_loss`), and the first run's value of that loss (0-d)
        to compare the rerun's with. A sample whose first output was non-finite gets a zero gradient: its
        recorded one came from the non-finite output, so only the rerun's forward tells whether it recurs (a
        non-finite output times zero is still non-finite). None when nothing usable was recorded."""
        grad = self.grad(micro_step)
        if grad is None or micro_step >= len(self.steps) or grad.shape != self.steps[micro_step][0].shape:
            return None
        output, inputs = self.steps[micro_step]
        shape = grad.shape
        out, grad = (output.reshape(1), grad.reshape(1)) if output.dim() == 0 else (output, grad)
        first_bad = _per_sample(~torch.isfinite(out.reshape(out.shape[0], -1)).all(dim=1), out)
        grad = torch.where(first_bad, torch.zeros_like(grad), grad)
        first = (torch.where(first_bad, torch.zeros_like(out), out).float() * grad.float()).sum()
        return {**inputs, OUTPUT_GRAD_KEY: grad.reshape(shape)}, first

    def remove(self) -> None:
        self.handle.remove()
        self.grads.clear()
        self.steps.clear()
