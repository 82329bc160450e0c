"""One line guards an unmodified Accelerate loop: ``vidstab.attach(...)`` and nothing else changes.

Real Accelerate, one CPU process (the 2-process lockstep run is in test_guard_attach_ddp.py).
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import vidstab
from vidstab import GuardConfig, read_events


class TinyDenoiser(torch.nn.Module):
    def __init__(self, c: int = 4, hidden: int = 16) -> None:
        super().__init__()
        self.inp = torch.nn.Conv3d(c, hidden, 1)
        self.t = torch.nn.Linear(1, hidden)
        self.out = torch.nn.Conv3d(hidden, c, 1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h = self.inp(sample) + self.t(timestep.float()[:, None] / 1000.0)[:, :, None, None, None]
        return self.out(torch.nn.functional.silu(h))


def batches(n: int, nan_at: int = -1):
    g = torch.Generator().manual_seed(7)
    for i in range(n):
        latents = torch.randn(2, 4, 2, 4, 4, generator=g)
        noise = torch.randn(latents.shape, generator=g)
        t = torch.randint(0, 1000, (2,), generator=g)
        if i == nan_at:
            latents[1, 0, 0, 0, 0] = float("nan")
        yield latents, noise, t


def build(accum: int = 2, guard_dir=None, config: GuardConfig | None = None):
    """A user's setup; with ``guard_dir`` the ONE added line: ``vidstab.attach(...)``."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
    model = TinyDenoiser()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    guard = None
    if guard_dir is not None:
        guard = vidstab.attach(accelerator, model, optimizer, lr_scheduler, config=config, run_dir=guard_dir)
    return accelerator, model, optimizer, lr_scheduler, guard


def user_loop(accelerator, model, optimizer, lr_scheduler, n: int, nan_at: int = -1, clip: bool = True,
              on_step=None):
    """The user's own loop, never changed by these tests."""
    for i, (latents, noise, t) in enumerate(batches(n, nan_at)):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(latents + noise, t), noise)
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if on_step is not None:
            on_step(i)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_a_healthy_attached_loop_gives_bitwise_the_plain_weights(tmp_path):
    for clip in (True, False):  # without clip_grad_norm_ the guard measures the norm itself, once, unclipped
        acc, model, opt, sched, _ = build()
        user_loop(acc, model, opt, sched, 12, clip=clip)
        plain = weights(model)
        acc, model, opt, sched, guard = build(guard_dir=tmp_path / f"clip{clip}")
        user_loop(acc, model, opt, sched, 12, clip=clip)
        assert all(torch.equal(a, b) for a, b in zip(plain, weights(model)))
        assert guard.step_count == 6 and guard.skipped_total == 0
        metrics = read_events(tmp_path / f"clip{clip}", "metrics")
        assert [e["step"] for e in metrics] == list(range(6))
        assert all(e["grad_norm"] > 0 and math.isfinite(e["loss"]) and e["input_absmax"] > 0 for e in metrics)
        assert guard.last_result is not None and guard.last_result.applied


def test_a_nan_in_the_users_batch_is_skipped_with_the_scheduler_held(tmp_path):
    acc, model, opt, sched, guard = build(guard_dir=tmp_path)
    seen = {}

    def on_step(i):
        if i == 5:  # the end of optimizer step 2 (micro-steps 4, 5), whose micro-batch 4 holds a NaN
            seen["was_skipped"] = acc.optimizer_step_was_skipped
            seen["after"], seen["epoch_after"] = weights(model), sched.scheduler.last_epoch
            seen["grads"] = [p.grad for p in model.parameters()]
        if i == 3:
            seen["before"], seen["epoch_before"] = weights(model), sched.scheduler.last_epoch

    user_loop(acc, model, opt, sched, 10, nan_at=4, on_step=on_step)
    assert seen["was_skipped"] is True and seen["epoch_after"] == seen["epoch_before"]
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"]))
    assert all(g is None for g in seen["grads"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sched.scheduler.last_epoch == 4 and guard.skipped_total == 1 and guard.step_count == 5
    skips = read_events(tmp_path, "skip")
    assert [(e["step"], e["detector"], e["bad_ranks"]) for e in skips] == [(2, "nonfinite", [0])]
    assert "inputs on rank(s) [0]" in skips[0]["message"]  # the exact count of values: the incident bundle
    # The incident bundle holds the model's inputs of the bad micro-batch, named after forward's parameters.
    (incident,) = read_events(tmp_path, "incident")
    meta = json.loads((tmp_path / incident["path"] / "incident.json").read_text())
    assert meta["step"] == 2 and meta["micro_step"] == 0 and meta["detector"] == "nonfinite"
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / incident["path"] / "batch.safetensors"))
    assert set(saved) == {"sample", "timestep"} and torch.isnan(saved["sample"]).sum() == 1


def test_one_host_read_per_optimizer_step_none_per_micro_step(tmp_path):
    from test_guard_sync import TransferCounter

    acc, model, opt, sched, guard = build(accum=3, guard_dir=tmp_path)
    user_loop(acc, model, opt, sched, 3)  # warm up
    counter = TransferCounter()
    per_micro = []
    with counter:
        user_loop(acc, model, opt, sched, 12, on_step=lambda i: per_micro.append(counter.total()))
    deltas = [b - a for a, b in zip([0] + per_micro, per_micro)]
    # One read per optimizer step (one process: the host-known values stay on the host), none per micro-step.
    assert deltas == [0, 0, 1] * 4, counter.by_kind


def test_attach_is_idempotent_and_detach_restores_the_plain_loop(tmp_path):
    acc, model, opt, sched, guard = build(guard_dir=tmp_path)
    assert vidstab.attach(acc, model, opt, sched, run_dir=tmp_path) is guard
    wrapped = [(acc, "backward"), (acc, "clip_grad_norm_"), (opt, "step"), (sched, "step")]
    assert all(name in vars(obj) for obj, name in wrapped)  # the instances, not the classes
    assert "step" not in vars(type(opt)) or type(opt).step is not opt.step
    guard.detach()
    guard.detach()
    assert not any(name in vars(obj) for obj, name in wrapped)
    assert not model._forward_pre_hooks
    user_loop(acc, model, opt, sched, 4, nan_at=0)  # no guard any more: the NaN reaches the weights
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    again = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path)
    assert again is not guard and "step" in vars(opt)


def test_explicit_calls_still_work_after_attach_and_count_once(tmp_path):
    acc, model, opt, sched, guard = build(guard_dir=tmp_path)
    for i, (latents, noise, t) in enumerate(batches(6)):
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(latents + noise, t), noise)
            guard.backward(loss, batch={"latents": latents, "noise": noise, "timesteps": t}, sample_ids=[i, i])
            result = guard.step(1.0)
    assert result.applied and guard.step_count == 3 and sched.scheduler.last_epoch == 3
    assert [e["step"] for e in read_events(tmp_path, "metrics")] == [0, 1, 2]


def test_input_statistics_cover_every_floating_tensor_of_the_batch(tmp_path):
    """``input_keys`` defaults to every floating tensor: a batch of ``images`` is watched too."""
    acc, model, opt, sched, guard = build(accum=1, guard_dir=tmp_path)
    for i, (latents, noise, t) in enumerate(batches(3)):
        images = latents * 100.0
        if i == 2:
            images[0, 0, 0, 0, 0] = float("inf")
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(latents + noise, t), noise)
            guard.backward(loss, batch={"images": images, "timesteps": t})
            result = guard.step(1.0)
    metrics = read_events(tmp_path, "metrics")
    ref = float(next(iter(batches(1)))[0].abs().max()) * 100.0
    assert abs(metrics[0]["input_absmax"] - ref) < 1e-3 * ref and metrics[0]["input_nonfinite"] == 0
    assert result.skipped and result.findings[0].detector == "nonfinite" and metrics[2]["input_nonfinite"] == 1
    assert "inputs on rank(s) [0]" in result.findings[0].message


def test_nothing_but_the_verdict_runs_between_the_read_and_the_optimizer_step(tmp_path):
    """When the torch optimizer steps, this step's statistics, events and trackers have not run yet."""
    acc, model, opt, sched, guard = build(accum=1, guard_dir=tmp_path)
    inner = opt.optimizer
    original, seen = inner.step, []
    grad_spike = next(d for d in guard.detectors if d.name == "grad_spike")

    def observed_step(*a, **k):
        logged = [e["step"] for e in read_events(tmp_path, "metrics")]
        seen.append((guard.step_count, logged[-1] if logged else None, grad_spike.ema.count))
        return original(*a, **k)

    observed_step._wrapped_by_lr_sched = True  # it calls the scheduler-tracked original: no ordering warning
    inner.step = observed_step
    user_loop(acc, model, opt, sched, 4)
    inner.step = original
    # at step k: the metrics of step k-1 are the newest, and grad_spike has absorbed k steps, not k+1
    assert seen == [(0, None, 0), (1, 0, 1), (2, 1, 2), (3, 2, 3)]


def test_attach_forwards_every_guard_option_register_hooks_included(tmp_path):
    """``attach`` has Guard's own signature (declared once, on Guard) plus ``rollback_every`` and its ``recovery``
    (the in-place rollback is attach's, tests/test_auto_rollback.py) and every option reaches the guard."""
    attach_params = dict(inspect.signature(vidstab.attach).parameters)
    assert attach_params.pop("rollback_every").default is None
    assert attach_params.pop("recovery").default is None
    assert attach_params == dict(inspect.signature(vidstab.Guard).parameters)
    acc, model, opt, sched, _ = build()
    checkpoint_fn = lambda: "checkpoint-7"  # noqa: E731
    options = dict(config=GuardConfig(log_every=3), run_dir=tmp_path / "guard", model_spec={"factory": "m:f"}, seed=11,
                   checkpoint_fn=checkpoint_fn, register_hooks=False)
    # A new Guard option must be added here, so that this test covers it too.
    assert set(options) == set(inspect.signature(vidstab.Guard).parameters) - {"accelerator", "model", "optimizer",
                                                                               "lr_scheduler"}
    guard = vidstab.attach(acc, model, opt, sched, **options)
    assert (guard.config, guard.run_dir, guard.reporter.model_spec, guard.reporter.seed, guard.reporter.checkpoint_fn) == (
        options["config"], tmp_path / "guard", {"factory": "m:f"}, 11, checkpoint_fn)
    acc.save_state(str(tmp_path / "no_hooks"))
    assert (tmp_path / "no_hooks").is_dir() and not (tmp_path / "no_hooks" / "vidstab_guard.json").exists()
    guard.detach()
    guard = vidstab.attach(acc, model, opt, sched, run_dir=tmp_path / "guard")  # default: the hooks are registered
    acc.save_state(str(tmp_path / "hooks"))
    assert json.loads((tmp_path / "hooks" / "vidstab_guard.json").read_text())["step_count"] == 0
    guard.close()


def test_the_unmodified_loop_leaves_float_timesteps_out_of_the_input_statistics(tmp_path):
    """Flow-matching loops pass float timesteps (``[B]``, up to 1000) to the model: they are not data, and
    would otherwise be the inputs' absmax and RMS, hiding a drift of the latents."""
    acc, model, opt, sched, guard = build(accum=1, guard_dir=tmp_path)
    for latents, noise, t in batches(2):
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(latents + noise, t.float()), noise)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
    first = next(iter(batches(1)))
    metrics = read_events(tmp_path, "metrics")
    ref = float((first[0] + first[1]).abs().max())
    assert abs(metrics[0]["input_absmax"] - ref) < 1e-4 * ref  # the sample's, not the timesteps' (< 1000)
    assert metrics[0]["input_absmax"] < 50
