"""The health gate (which checkpoints are rollback targets): a skipped bad *input* sample with finite weights
is not evidence of a sick model; a non-finite loss on finite inputs is. Real Accelerate, 1 process."""

from __future__ import annotations

import torch
from accelerate import Accelerator

import vidstab
from vidstab import GuardConfig


def _run(tmp_path, poison: str) -> tuple[list[bool], list]:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    guard = vidstab.attach(acc, model, opt, config=GuardConfig.from_dict({"health_window": 10}), run_dir=tmp_path)
    health, results = [], []
    for i in range(8):
        x = torch.randn(4, 4)
        if i == 3 and poison == "input":
            x[0, 0] = float("nan")  # a broken sample (e.g. a bad VAE encode)
        loss = model(x).pow(2).mean()
        if i == 3 and poison == "loss":
            loss = loss * float("inf")  # finite inputs, non-finite loss: the model or the step is the problem
        guard.backward(loss, batch={"latents": x})
        results.append(guard.step(1.0))
        health.append(guard.healthy)
    return health, results


def test_a_skipped_bad_input_sample_keeps_checkpoints_healthy(tmp_path):
    health, results = _run(tmp_path / "input", "input")
    assert results[3].skipped and all(r.applied for i, r in enumerate(results) if i != 3)
    assert health == [True] * 8  # before the fix: False for health_window steps after the skip


def test_a_nonfinite_loss_on_finite_inputs_still_makes_them_unhealthy(tmp_path):
    health, results = _run(tmp_path / "loss", "loss")
    assert results[3].skipped
    assert health[:3] == [True] * 3 and health[3:] == [False] * 5
