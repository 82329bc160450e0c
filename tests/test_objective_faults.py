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


def test_flow_matching_sigmas_are_the_shifted_schedulers_and_weighting_is_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    latents = torch.randn(512, 1, 1, 1, 1)
    mean_sigma = {}
    for shift in (1.0, 3.0):
        objective = DiffusionObjective(ObjectiveConfig(prediction_type="flow_matching", flow_shift=shift, weighting_scheme="none"))
        t = objective.sample(latents, step_generator(0, 0, 0, 0))["timesteps"]
        table = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift).sigmas
        sigmas = objective.sigmas(t)
        # every training sigma is one the sampler also visits, shifted the same way
        assert (sigmas[:, None] - table.float()[None]).abs().min(dim=1).values.max() < 1e-6
        mean_sigma[shift] = float(sigmas.mean())
    assert mean_sigma[3.0] > mean_sigma[1.0] + 0.1  # shift > 1 trains more at high noise (Wan, SD3)

    model = torch.nn.Identity()
    model.forward = lambda x, t: x
    plain = DiffusionObjective(ObjectiveConfig(prediction_type="flow_matching", weighting_scheme="none"))
    weighted = DiffusionObjective(ObjectiveConfig(prediction_type="flow_matching", weighting_scheme="sigma_sqrt"))
    latents = torch.randn(4, 2, 1, 2, 2)
    draws = plain.sample(latents, step_generator(1, 2, 0, 0))
    a = plain.per_sample_loss(model, latents, draws["noise"], draws["timesteps"])
    b = weighted.per_sample_loss(model, latents, draws["noise"], draws["timesteps"])
    assert torch.allclose(b, a * compute_loss_weighting_for_sd3("sigma_sqrt", plain.sigmas(draws["timesteps"])))
    with pytest.raises(ValueError, match="weighting_scheme"):
        ObjectiveConfig(weighting_scheme="uniform")


def test_draws_are_made_on_the_latents_device():
    objective = DiffusionObjective()
    with pytest.raises(ValueError, match="generator is on cpu but the latents are on meta"):
        objective.sample(torch.empty(2, 4, 1, 2, 2, device="meta"), step_generator(0, 0, 0, 0))
    draws = objective.sample(torch.zeros(2, 4, 1, 2, 2), step_generator(0, 0, 0, 0, device="cpu"))
    assert draws["noise"].device.type == draws["timesteps"].device.type == "cpu"


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


def test_lr_base_fault_multiplies_the_schedules_base_lrs_for_good_even_after_a_reload():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    before = scheduler.state_dict(), optimizer.state_dict()  # a checkpoint taken before the fault's step
    faults = FaultInjector(["lr_base@2=10"], rank=0)
    lrs = []
    for step in range(5):
        if step == 4:  # a rollback reloads the scheduler: the bug is in the code, it writes the base LRs again
            scheduler.load_state_dict(before[0])
            optimizer.load_state_dict(before[1])
            faults.on_rollback()
        faults.adjust_lr(step, optimizer, scheduler)
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.1, 0.1, 1.0, 1.0, 1.0])  # x10 once at step 2, not compounded; again after the reload
    assert scheduler.base_lrs == pytest.approx([1.0])
    assert FaultInjector(["lr_base@9=10"], rank=0).adjust_lr(3, optimizer, scheduler) is None  # not before its step
    with pytest.raises(ValueError, match="numeric"):
        Fault.parse("lr_base@3=x")


def test_module_fault_makes_that_module_nonfinite_and_unhooks():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    faults = FaultInjector(["inf_module@0=1"], rank=0)
    with faults.module_fault(0, model) as name:
        assert name == "1" and not torch.isfinite(model(torch.ones(1, 2))).all()
    assert torch.isfinite(model(torch.ones(1, 2))).all()


def test_an_lr_bug_writes_the_scheduled_lr_times_its_factor_for_its_steps_and_a_grad_spike_scales_one_loss():
    assert Fault.parse("lr_bug@9=1e4x3").arg == "1e4x3" and Fault.parse("grad_spike@6:1=1e3").rank == 1
    for bad in ("lr_bug@9=x3", "lr_bug@9=1e4x0", "lr_bug@9=1e4xy"):
        with pytest.raises(ValueError, match="FACTORxSTEPS"):
            Fault.parse(bad)
    with pytest.raises(ValueError, match="numeric"):
        Fault.parse("grad_spike@3=big")
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    faults = FaultInjector(["lr_bug@1=100x2"], rank=0)
    lrs = []
    for step in range(4):
        faults.adjust_lr(step, optimizer, scheduler)
        lrs.append(optimizer.param_groups[0]["lr"])
        if step != 1:  # step 1 held (a skipped step): the bug writes the same scheduled LR again, not compounded
            scheduler.step()
    assert lrs == pytest.approx([0.1, 0.1 / 2 * 100, 0.1 / 2 * 100, 0.1 / 3])  # over after its 2 steps
    assert scheduler.base_lrs == pytest.approx([0.1])  # the schedule itself untouched
    spike = FaultInjector(["grad_spike@2=1e3"], rank=0)
    assert [spike.loss_factor(s) for s in (1, 2, 2, 3)] == [1.0, 1e3, 1.0, 1.0]  # its step's first micro-batch
