"""The reference objective and the fault-injection grammar: the pieces every drill and replay rely on."""

import pytest
import torch

from vidstab.faults import Fault, FaultInjector, InjectedFault
from vidstab.reference.objective import PREDICTION_TYPES, DiffusionObjective, ObjectiveConfig, replay_loss, step_generator


@pytest.mark.parametrize("prediction_type", PREDICTION_TYPES)
def test_draws_are_a_pure_function_of_seed_step_micro_and_rank(prediction_type):
    objective = DiffusionObjective(ObjectiveConfig(prediction_type=prediction_type))
    latents = torch.randn(3, 4, 3, 4, 4)
    a = objective.sample(latents, step_generator(7, 12, 1, 0))
    b = objective.sample(latents, step_generator(7, 12, 1, 0))
    c = objective.sample(latents, step_generator(7, 12, 1, 1))
    assert torch.equal(a["noise"], b["noise"]) and torch.equal(a["timesteps"], b["timesteps"])
    assert not torch.equal(a["noise"], c["noise"])
    noisy, target = objective.inputs_and_target(latents, a["noise"], a["timesteps"])
    assert noisy.shape == target.shape == latents.shape


def test_loss_is_fp32_per_sample_and_replayable():
    model = torch.nn.Identity()
    model.forward = lambda x, t: x.to(torch.bfloat16)  # a model whose output is low precision
    latents = torch.randn(2, 4, 1, 2, 2)
    objective = DiffusionObjective()
    draws = objective.sample(latents, step_generator(0, 0, 0, 0))
    loss = objective.per_sample_loss(model, latents, draws["noise"], draws["timesteps"])
    assert loss.dtype == torch.float32 and loss.shape == (2,)
    again = replay_loss(model, {"latents": latents, **draws}, **objective.to_dict())
    assert torch.equal(loss, again)


def test_unknown_prediction_type_is_rejected():
    with pytest.raises(ValueError, match="prediction_type"):
        ObjectiveConfig(prediction_type="x0")


def test_fault_grammar_and_clear_errors():
    assert Fault.parse("nan_batch@20:1") == Fault("nan_batch", 20, 1)
    assert Fault.parse("lr_spike@5=30").arg == "30"
    for bad, msg in [("nan_bach@3", "unknown kind"), ("nan_batch", "KIND@STEP"), ("lr_spike@3=x", "numeric"), ("inf_module@3", "module name")]:
        with pytest.raises(ValueError, match=msg):
            Fault.parse(bad)


def test_faults_fire_once_on_their_rank_only():
    latents = torch.zeros(2, 1, 2, 1, 1)
    on_rank1 = FaultInjector(["nan_batch@3:1"], rank=1)
    on_rank0 = FaultInjector(["nan_batch@3:1"], rank=0)
    assert on_rank0.corrupt_batch(3, latents)[1] is None
    bad, kind = on_rank1.corrupt_batch(3, latents)
    assert kind == "nan_batch" and torch.isnan(bad).all() and torch.isfinite(latents).all()
    assert on_rank1.corrupt_batch(3, latents)[1] is None  # fired once
    with pytest.raises(InjectedFault):
        FaultInjector(["exception@2"], rank=0).maybe_raise(2)


def test_lr_faults_survive_scheduler_steps_until_rollback():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    faults = FaultInjector(["lr_ramp@1=2"], rank=0)
    lrs = []
    for step in range(4):
        faults.adjust_lr(step, optimizer, scheduler)
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.2, 0.4, 0.8])
    faults.on_rollback()
    assert faults.adjust_lr(4, optimizer, scheduler) is None


def test_module_fault_makes_that_module_nonfinite_and_unhooks():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    faults = FaultInjector(["inf_module@0=1"], rank=0)
    with faults.module_fault(0, model) as name:
        assert name == "1" and not torch.isfinite(model(torch.ones(1, 2))).all()
    assert torch.isfinite(model(torch.ones(1, 2))).all()
