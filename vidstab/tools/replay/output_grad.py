"""The replay loss of a bundle that holds the gradient at the model's output (:mod:`vidstab.replay_record`)."""

from __future__ import annotations

import torch

from ...replay_record import OUTPUT_GRAD_KEY, first_tensor
from .base import ReplayError


def output_grad_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum(output x recorded output gradient)``: its backward gives the weights the gradients of the captured
    step's own backward. ``batch``: the model's inputs by ``forward`` parameter name, plus the gradient."""
    if OUTPUT_GRAD_KEY not in batch:
        raise ReplayError(f"the bundle holds no {OUTPUT_GRAD_KEY!r}: record a 'loss_fn' in the model spec instead")
    grad = batch[OUTPUT_GRAD_KEY]
    output = first_tensor(model(**{k: v for k, v in batch.items() if k != OUTPUT_GRAD_KEY}))
    if output is None:
        raise ReplayError("the model returned no tensor to take the recorded output gradient against")
    if output.shape != grad.shape:
        raise ReplayError(f"the model's output {tuple(output.shape)} does not match the recorded gradient {tuple(grad.shape)}")
    return (output.float() * grad.float()).sum()
