"""The weights' and the last update's sums of squares (vidstab/guard/param_probe.py) against the plain
per-tensor arithmetic, in the precisions users train in, without touching autograd."""

from __future__ import annotations

import math

import pytest
import torch

from vidstab.guard.param_probe import ParamProbe


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)
    model.empty = torch.nn.Parameter(torch.zeros(0, dtype=dtype))  # an empty tensor is left out
    return model


def _reference(tensors) -> float:
    return math.fsum(float(t.double().square().sum()) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sums_match_the_per_tensor_arithmetic_across_an_optimizer_step(dtype):
    model = _model(dtype)
    model.transposed = torch.nn.Parameter(torch.randn(6, 5, dtype=dtype).t())  # not contiguous
    params = list(model.parameters())
    probe = ParamProbe(params)
    before = probe.snapshot()
    truth_before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    model(torch.randn(8, 16, dtype=dtype)).square().mean().backward()
    model.transposed.grad = torch.ones_like(model.transposed)
    optimizer.step()  # the snapshot must be a copy: a view would read no change
    shared = {p.untyped_storage().data_ptr() for p in params}
    assert all(b.untyped_storage().data_ptr() not in shared for b in before)  # a copy, not a view
    param_sq, update_sq = probe.sums(before)
    assert param_sq.dtype == update_sq.dtype == torch.float32 and param_sq.ndim == update_sq.ndim == 0
    want_param = _reference(params)
    want_update = _reference([b - p.detach() for b, p in zip(truth_before, params)])
    # float32 norms of bfloat16 weights: the old bfloat16 norms kept about three digits
    tol = 1e-6 if dtype != torch.bfloat16 else 2e-3
    assert float(param_sq) == pytest.approx(want_param, rel=tol)
    assert float(update_sq) == pytest.approx(want_update, rel=tol)
    alone, none = probe.sums(None)
    assert none is None and float(alone) == pytest.approx(want_param, rel=tol)


def test_measuring_leaves_autograd_as_it_was():
    model = _model(torch.float32)
    probe = ParamProbe(list(model.parameters()))
    with torch.enable_grad():
        snap = probe.snapshot()
        sums = probe.sums(snap)
        assert torch.is_grad_enabled()
    assert all(t.grad_fn is None and not t.requires_grad for t in (*snap, *sums))
    with torch.no_grad():
        probe.sums(None)
        assert not torch.is_grad_enabled()


def test_no_trainable_parameters_measure_zero():
    probe = ParamProbe([torch.nn.Parameter(torch.zeros(0))])
    param_sq, update_sq = probe.sums(probe.snapshot())
    assert float(param_sq) == 0.0 and float(update_sq) == 0.0


def test_a_lazy_module_is_measured_once_it_has_run():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    probe = ParamProbe(list(model.parameters()))  # what the guard does when it attaches, before any forward
    model(torch.randn(4, 5))
    param_sq, _ = probe.sums(None)
    assert float(param_sq) == pytest.approx(_reference(model.parameters()), rel=1e-6)


def test_a_model_of_mixed_precisions_is_measured():
    """float32 and bfloat16 weights in one model: both sums in float32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2).to(torch.bfloat16))
    params = list(model.parameters())
    probe = ParamProbe(params)
    before = probe.snapshot()
    assert len(before) == len(params)
    truth_before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    torch.optim.SGD(params, lr=0.25).step()
    param_sq, update_sq = probe.sums(before)
    assert float(param_sq) == pytest.approx(_reference(params), rel=2e-3)
    assert float(update_sq) == pytest.approx(_reference([b - p.detach() for b, p in zip(truth_before, params)]), rel=2e-3)
