"""Name the first module whose forward output, and the first whose gradient, became non-finite.

A NaN loss says *that* something broke, not *where*. :class:`NonFiniteLocator` hooks every submodule
of a model for one forward + backward pass and records, in execution order:

* **forward**: the first module whose output held a non-finite value, with statistics of its inputs
  and whether those inputs were already non-finite. If they were, the culprit is upstream (the data,
  or functional code between modules), and ``origin`` names the first module that turned *finite*
  inputs into a non-finite output -- the module (or the parent whose own code) created the value.
* **backward**: the first module, in backward execution order, whose output gradient held a
  non-finite value, and whether its forward output was already non-finite (then the backward NaN is
  only the forward one propagating).

Why tensor hooks for the backward and not ``register_full_backward_hook``: full backward hooks wrap a
module's inputs and outputs in an extra autograd function, which breaks in-place ops on outputs and
views, and interacts badly with activation checkpointing. A ``Tensor.register_hook`` on each output
changes nothing in the graph; it fires when that output's gradient is complete, which is exactly
"backward execution order". It works with ``F.scaled_dot_product_attention`` (no module to hook
inside, the enclosing module is named) and with both reentrant and non-reentrant checkpointing
(forward hooks fire again on recomputation; only the first finding is kept).

Cost: every check is a host sync per module, so this is strictly on demand -- the guard calls
:func:`locate_nonfinite` on the first non-finite incident or when opted in, never every step.
Call it on the unwrapped module (``accelerator.unwrap_model(model)``): a backward through a DDP wrapper
outside the training step would start an all-reduce on one rank only.
"""

from __future__ import annotations

import math
from dataclasses import is_dataclass, fields
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["NonFiniteLocator", "locate_nonfinite", "tensor_stats", "iter_tensors"]


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Statistics of one tensor, safe for JSON and for tensors holding NaN/Inf.

    ``min/max/absmax/mean/std`` are over the *finite* values (``None`` when there are none), so one NaN
    does not hide the range of the rest; ``nonfinite`` counts NaN and +-Inf (``nan``/``inf`` split them).
    Integer and bool tensors are always finite.
    """
    t = t.detach()
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "numel": t.numel()}
    if t.numel() == 0:
        out.update(min=None, max=None, absmax=None, mean=None, std=None, nonfinite=0, nan=0, inf=0)
        return out
    # Complex values (e.g. rotary tables) are described by their magnitudes; integers go to float64 exactly
    # (up to 2**53), low-precision floats to float32 (no finite value is lost, and half the memory of float64).
    x = t.abs() if t.is_complex() else t
    x = x.to(torch.float32 if x.is_floating_point() and x.dtype != torch.float64 else torch.float64)
    if t.is_floating_point() or t.is_complex():
        finite = torch.isfinite(x)
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        x = x[finite]
    else:
        n_nan = n_inf = 0
        x = x.flatten()
    out.update(nonfinite=n_nan + n_inf, nan=n_nan, inf=n_inf)
    if x.numel() == 0:
        out.update(min=None, max=None, absmax=None, mean=None, std=None)
        return out
    x64 = x.double()  # accumulate in float64: fp32 sums of big activations overflow themselves
    out.update(
        min=float(x64.min()),
        max=float(x64.max()),
        absmax=float(x64.abs().max()),
        mean=float(x64.mean()),
        std=float(x64.std(unbiased=False)) if x64.numel() > 1 else 0.0,
    )
    for k in ("min", "max", "absmax", "mean", "std"):
        # A float64 of finite fp32 values can still overflow in mean/std of huge values.
        if not math.isfinite(out[k]):
            out[k] = str(out[k])
    return out


def iter_tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in nested tuples/lists/dicts/dataclasses.

    Names read like Python access paths: ``args[0]``, ``kwargs.timestep``, ``output[1][0]``.
    diffusers' ``BaseOutput`` is an ``OrderedDict`` and is handled as a dict.
    """
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}[{i}]")
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from iter_tensors(getattr(obj, f.name), f"{prefix}.{f.name}")


def _has_nonfinite(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return False
    return not bool(torch.isfinite(t.detach()).all())


class NonFiniteLocator:
    """Context manager hooking every submodule of ``model`` to find where values became non-finite.

    Example::

        with NonFiniteLocator(model) as loc:
            loss = loss_fn(model, batch)
            loss.backward()
        print(loc.forward, loc.backward)   # dicts or None

    Attributes (filled while the context is active, kept after it exits):
        forward: the first module, in forward execution order, whose output held a non-finite value
            (``None`` when every output was finite). Keys: ``module`` (qualified name, ``""`` is the
            root), ``type``, ``call_index`` (position in execution order), ``inputs_nonfinite`` (were
            its inputs already non-finite: then the culprit is upstream), ``inputs`` (stats per input
            tensor), ``outputs`` (stats per output tensor), ``nonfinite_params`` (its own non-finite
            parameters), ``origin`` (see below).
        origin: the first module whose inputs were all finite but whose output was not: the module
            that created the non-finite value (``None`` if the model's own inputs were non-finite).
            Also stored in ``forward["origin"]``.
        backward: the first module, in backward execution order, whose output gradient held a
            non-finite value (``None`` when all were finite). Keys: ``module``, ``type``, ``grad``
            (stats per output gradient), ``output_nonfinite_in_forward`` (the forward output was already
            non-finite: the backward NaN just propagates it), ``order`` (position among the gradient
            hooks that fired), ``after`` (the module whose finite output gradient arrived just before:
            the gradient became non-finite in the backward between the two -- usually in ``after``'s
            own backward; ``None`` if it was the first gradient).

    All hooks are removed on exit, also when the body raises.
    """

    def __init__(self, model: nn.Module, *, check_backward: bool = True) -> None:
        """Args:
        model: the module to hook (every submodule from ``named_modules()``, root included).
        check_backward: also hook output gradients (off for forward-only localisation).
        """
        self.model = model
        self.check_backward = check_backward
        self.forward: dict[str, Any] | None = None
        self.origin: dict[str, Any] | None = None
        self.backward: dict[str, Any] | None = None
        self._handles: list[Any] = []
        self._calls = 0
        self._grad_calls = 0
        self._last_finite_grad: str | None = None
        # Module names whose forward output was non-finite, to tell a propagating backward NaN apart.
        self._nonfinite_outputs: set[str] = set()

    # -- context manager ---------------------------------------------------------------------------

    def __enter__(self) -> "NonFiniteLocator":
        try:
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_hook(self._make_forward_hook(name), with_kwargs=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook this locator registered (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks -------------------------------------------------------------------------------------

    def _make_forward_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self._calls += 1
            outputs = list(iter_tensors(output, "output"))
            out_bad = any(_has_nonfinite(t) for _, t in outputs)
            if out_bad:
                self._nonfinite_outputs.add(name)
                if self.forward is None or self.origin is None:
                    inputs = list(iter_tensors(args, "args")) + list(iter_tensors(kwargs, "kwargs"))
                    in_bad = any(_has_nonfinite(t) for _, t in inputs)
                    record = {
                        "module": name,
                        "type": type(module).__name__,
                        "call_index": self._calls,
                        "inputs_nonfinite": in_bad,
                        "inputs": {n: tensor_stats(t) for n, t in inputs},
                        "outputs": {n: tensor_stats(t) for n, t in outputs},
                        # Non-finite weights (e.g. after a bad update) make finite inputs non-finite too.
                        "nonfinite_params": [
                            pn for pn, p in module.named_parameters(recurse=False) if _has_nonfinite(p)
                        ],
                    }
                    if self.forward is None:
                        self.forward = dict(record, origin=None)
                    if self.origin is None and not in_bad:
                        self.origin = record
                        self.forward["origin"] = {k: record[k] for k in ("module", "type", "call_index")}
            if self.check_backward and self.backward is None and torch.is_grad_enabled():
                for out_name, t in outputs:
                    if t.requires_grad:
                        t.register_hook(self._make_grad_hook(name, type(module).__name__, out_name))

        return hook

    def _make_grad_hook(self, name: str, type_name: str, out_name: str) -> Callable:
        def grad_hook(grad: torch.Tensor) -> None:
            self._grad_calls += 1
            if self.backward is None and grad is not None and _has_nonfinite(grad):
                self.backward = {
                    "module": name,
                    "type": type_name,
                    "order": self._grad_calls,
                    "grad": {out_name: tensor_stats(grad)},
                    "output_nonfinite_in_forward": name in self._nonfinite_outputs,
                    # The gradient turned non-finite in the backward of the code between this module's
                    # output and the outputs of the module whose finite gradient arrived just before:
                    # usually that module's own backward (exact for a chain; a hint with branches).
                    "after": self._last_finite_grad,
                }
            elif grad is not None and self.backward is None:
                self._last_finite_grad = name
            # Returning None leaves the gradient untouched.

        return grad_hook


def _grad_summary(model: nn.Module) -> tuple[float, list[str], int]:
    """Global L2 norm of the parameters' gradients, names of non-finite ones, count of params with grads."""
    sq = 0.0
    bad: list[str] = []
    n = 0
    for pname, p in model.named_parameters():
        if p.grad is None:
            continue
        n += 1
        g = p.grad.detach()
        if _has_nonfinite(g):
            bad.append(pname)
        sq += float(g.double().pow(2).sum())
    return (math.sqrt(sq) if math.isfinite(sq) else float("nan")), bad, n


def locate_nonfinite(
    model: nn.Module,
    fn: Callable[[], torch.Tensor],
    *,
    backward: bool = True,
    keep_grads: bool = False,
) -> dict[str, Any]:
    """Run ``loss = fn()`` and ``loss.sum().backward()`` under a :class:`NonFiniteLocator`.

    Args:
        model: the module ``fn`` runs (unwrapped: see the module docstring).
        fn: computes the loss (any shape; summed for the backward) from ``model``.
        backward: also run the backward pass and locate the first non-finite gradient.
        keep_grads: keep the gradients this call computes in ``param.grad``. By default the caller's
            gradients are stashed before and restored after, so calling this from a training step has
            no side effect on the step's gradients.

    Returns:
        ``{"forward": dict | None, "backward": dict | None, "loss_finite": bool, "loss": float | str,
        "grad_norm": float | None, "nonfinite_grad_params": [names] (first 20), "nonfinite_grad_param_count": int}``.
        ``forward``/``backward`` are :class:`NonFiniteLocator`'s records; ``grad_norm`` is the global
        L2 norm of the gradients this call computed (``None`` without backward).
    """
    stash = {}
    if backward and not keep_grads:
        for p in model.parameters():
            stash[p] = p.grad
            p.grad = None
    try:
        with NonFiniteLocator(model, check_backward=backward) as loc:
            loss = fn()
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"locate_nonfinite: fn() must return a Tensor, got {type(loss).__name__}")
            loss_finite = not _has_nonfinite(loss)
            loss_value = float(loss.detach().double().mean())
            if backward and loss.requires_grad:
                loss.sum().backward()
        result: dict[str, Any] = {
            "forward": loc.forward,
            "backward": loc.backward,
            "loss_finite": loss_finite,
            "loss": loss_value if math.isfinite(loss_value) else str(loss_value),
            "grad_norm": None,
            "nonfinite_grad_params": [],
            "nonfinite_grad_param_count": 0,
        }
        if backward:
            norm, bad, _ = _grad_summary(model)
            result["grad_norm"] = norm if math.isfinite(norm) else str(norm)
            result["nonfinite_grad_params"] = bad[:20]
            result["nonfinite_grad_param_count"] = len(bad)
        return result
    finally:
        for p, g in stash.items():
            p.grad = g
