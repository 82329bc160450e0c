"""The weights' and the last update's sums of squares (vidstab/guard/param_probe.py) against the plain
per-tensor arithmetic, in the precisions users train in, without touching autograd. The weights' sum is exact;
the update's is estimated from a sample of about one element in 16 (small tensors whole)."""

from __future__ import annotations

import math

import pytest
import torch

from vidstab.guard.param_probe import UPDATE_SAMPLE_STRIDE, WHOLE_UP_TO, ParamProbe


def _model(dtype: torch.dtype, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 4)).to(dtype)
    model.empty = torch.nn.Parameter(torch.zeros(0, dtype=dtype))  # an empty tensor is left out
    return model


def _reference(tensors) -> float:
    return math.fsum(float(t.detach().double().square().sum()) for t in tensors)


def _copies(before) -> list[torch.Tensor]:
    return [c for _, per_tensor, per_run in before for c in (*per_tensor, *per_run)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sums_match_the_per_tensor_arithmetic_across_an_adam_step(dtype):
    """A dense update (AdamW moves every element): the estimate is within a few percent, the weights exact."""
    model = _model(dtype, width=2048)
    model.transposed = torch.nn.Parameter(torch.randn(600, 500, dtype=dtype).t())  # not contiguous
    params = list(model.parameters())
    probe = ParamProbe(params)
    before = probe.snapshot()
    truth_before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    model(torch.randn(8, 16, dtype=dtype)).square().mean().backward()
    model.transposed.grad = torch.randn_like(model.transposed)
    optimizer.step()  # the snapshot must be a copy: a view would read no change
    shared = {p.untyped_storage().data_ptr() for p in params}
    assert all(c.untyped_storage().data_ptr() not in shared for c in _copies(before))
    total = sum(p.numel() for p in params)
    assert sum(c.numel() for c in _copies(before)) <= total / UPDATE_SAMPLE_STRIDE + WHOLE_UP_TO * len(params)
    param_sq, update_sq = probe.sums(before)
    assert param_sq.dtype == update_sq.dtype == torch.float32 and param_sq.ndim == update_sq.ndim == 0
    want_param = _reference(params)
    want_update = _reference([b - p.detach() for b, p in zip(truth_before, params)])
    # float32 norms of bfloat16 weights: the old bfloat16 norms kept about three digits
    assert float(param_sq) == pytest.approx(want_param, rel=1e-5 if dtype != torch.bfloat16 else 2e-3)
    assert float(update_sq) == pytest.approx(want_update, rel=0.03)
    alone, none = probe.sums(None)
    assert none is None and float(alone) == float(param_sq)


def test_small_tensors_are_measured_exactly():
    """Tensors of at most WHOLE_UP_TO elements are copied whole: their update is exact, any update pattern."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (1, 7, WHOLE_UP_TO)]
    probe = ParamProbe(params)
    before = probe.snapshot()
    truth_before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
        p.grad[-1] = 3.0  # one element moves
    torch.optim.SGD(params, lr=0.5).step()
    _, update_sq = probe.sums(before)
    assert float(update_sq) == pytest.approx(_reference([b - p.detach() for b, p in zip(truth_before, params)]), rel=1e-6)


def test_a_replaced_storage_is_followed():
    """``p.data = ...`` (a load that replaces the tensor, FSDP1's flat views): the next measurement reads the new one."""
    p = torch.nn.Parameter(torch.ones(1000))
    probe = ParamProbe([p])
    assert float(probe.sums(None)[0]) == pytest.approx(1000.0)
    p.data = torch.full((1000,), 2.0)
    before = probe.snapshot()
    p.data.add_(1.0)
    param_sq, update_sq = probe.sums(before)
    assert float(param_sq) == pytest.approx(9000.0) and float(update_sq) == pytest.approx(1000.0)


def test_measuring_leaves_autograd_as_it_was():
    model = _model(torch.float32)
    probe = ParamProbe(list(model.parameters()))
    with torch.enable_grad():
        snap = probe.snapshot()
        copies = _copies(snap)
        sums = probe.sums(snap)
        assert torch.is_grad_enabled()
    assert all(t.grad_fn is None and not t.requires_grad for t in (*copies, *sums))
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
    truth_before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    torch.optim.SGD(params, lr=0.25).step()
    param_sq, update_sq = probe.sums(before)
    assert float(param_sq) == pytest.approx(_reference(params), rel=2e-3)
    assert float(update_sq) == pytest.approx(_reference([b - p.detach() for b, p in zip(truth_before, params)]), rel=2e-3)


def test_many_small_tensors_are_measured_in_runs():
    """Hundreds of small tensors (a UNet's norms and biases): measured as flat runs, the estimate as close."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100 + i % 7)) for i in range(500)]
    probe = ParamProbe(params)
    assert len(probe._plan()[0].runs) >= 2 and not probe._plan()[0].tensors  # several runs, nothing per tensor
    before = probe.snapshot()
    truth_before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(params, lr=1e-2).step()
    param_sq, update_sq = probe.sums(before)
    assert float(param_sq) == pytest.approx(_reference(params), rel=1e-5)
    assert float(update_sq) == pytest.approx(_reference([b - p.detach() for b, p in zip(truth_before, params)]), rel=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_estimate_is_its_sample_definition_to_rounding(dtype):
    """Every run's update from one element in UPDATE_SAMPLE_STRIDE of its concatenation (runs of at most WHOLE_UP_TO
    elements whole), weighted by its size over its sample's; large tensors from their own samples: the probe's sums
    (norms added in one op per dtype) are that definition, taken in float64, to float32 rounding."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in [5, 40, 300, 2000, 70] * 40 + [50_000]]
    probe = ParamProbe(params)
    (group,) = probe._plan()
    assert len(group.runs) >= 8 and len(group.tensors) == 1
    before_runs = [torch.cat(run).double() for run in group.runs]
    before_large = group.tensors[0].double().clone()
    before = probe.snapshot()
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.SGD(params, lr=0.1).step()  # update sizes that differ from tensor to tensor
    param_sq, update_sq = probe.sums(before)

    def sampled(delta: torch.Tensor) -> float:
        sample = delta if delta.numel() <= WHOLE_UP_TO else delta[::UPDATE_SAMPLE_STRIDE]
        return float(sample.square().sum()) * delta.numel() / sample.numel()

    want = math.fsum(sampled(torch.cat(run).double() - b) for run, b in zip(group.runs, before_runs))
    want += sampled(group.tensors[0].double() - before_large)
    # float32 sums of many elements: a few units in the sixth digit; a bfloat16 difference rounds to bfloat16
    assert float(param_sq) == pytest.approx(_reference(params), rel=1e-5)
    assert float(update_sq) == pytest.approx(want, rel=1e-5 if dtype != torch.bfloat16 else 2e-3)
