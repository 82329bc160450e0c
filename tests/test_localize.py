"""Localisation of the first non-finite module: forward and backward, real models, real hooks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from replay_user_model import make_batch, make_model, video_mse  # noqa: E402

from vidstab.evidence.localize import NonFiniteLocator, locate_nonfinite, tensor_stats  # noqa: E402


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_hooks_with_kwargs) for m in model.modules())


def test_module_that_makes_inf_from_finite_inputs_is_named_first_forward():
    torch.manual_seed(0)
    model = make_model(blowup=1e39)
    batch = make_batch()
    result = locate_nonfinite(model, lambda: video_mse(model, batch))

    fwd = result["forward"]
    assert fwd["module"] == "blowup"
    assert fwd["type"] == "Blowup"
    assert fwd["inputs_nonfinite"] is False  # finite in, inf out: this module is the culprit
    assert fwd["origin"]["module"] == "blowup"
    (in_stats,) = fwd["inputs"].values()
    assert in_stats["nonfinite"] == 0 and in_stats["absmax"] < 100
    assert fwd["outputs"]["output"]["inf"] > 0
    assert result["loss_finite"] is False
    assert result["backward"] is not None and result["backward"]["output_nonfinite_in_forward"]
    assert _hook_count(model) == 0


def test_nonfinite_input_data_points_upstream_of_every_module():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch()
    batch["latents"][1, 0, 0, 0, 0] = float("nan")
    result = locate_nonfinite(model, lambda: video_mse(model, batch))
    fwd = result["forward"]
    assert fwd["module"] == "encoder"  # the first module to run
    assert fwd["inputs_nonfinite"] is True  # ... but its input was already NaN: the data
    assert fwd["origin"] is None
    assert fwd["inputs"]["args[0]"]["nan"] == 1


def test_backward_only_nonfinite_is_located_with_finite_forward():
    torch.manual_seed(0)
    model = make_model(sqrt=True)
    with torch.no_grad():  # make some activations exactly 0, where d sqrt(|x|)/dx is inf * 0 = nan
        model.encoder.weight.zero_()
        model.encoder.bias.zero_()
        model.t_proj.weight.zero_()
        model.t_proj.bias.zero_()
    batch = make_batch()
    result = locate_nonfinite(model, lambda: video_mse(model, batch))
    assert result["forward"] is None
    assert result["loss_finite"] is True
    bwd = result["backward"]
    assert bwd is not None
    assert bwd["output_nonfinite_in_forward"] is False
    assert bwd["after"] == "sqrt"  # the gradient broke in sqrt's backward
    assert result["nonfinite_grad_param_count"] > 0


def test_real_video_dit_with_gradient_checkpointing_finite_step_and_grads_restored():
    from vidstab.reference import model as model_mod
    torch.manual_seed(0)
    model = model_mod.VideoDiT(in_channels=4, hidden_size=24, num_layers=2, num_heads=2)
    with torch.no_grad():  # leave AdaLN-Zero's identity so every block really computes
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(std=0.05)
    model.enable_gradient_checkpointing()
    batch = make_batch()
    before = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = before[n].clone()

    def loss_fn():
        return ((model(batch["latents"], batch["timesteps"]) - batch["noise"]) ** 2).mean()

    result = locate_nonfinite(model, loss_fn)
    assert result["forward"] is None and result["backward"] is None and result["loss_finite"] is True
    assert isinstance(result["grad_norm"], float) and result["grad_norm"] > 0
    # The caller's gradients are untouched.
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n
    assert _hook_count(model) == 0


def test_real_video_dit_nan_latents_names_patch_embed_with_nan_inputs():
    from vidstab.reference import model as model_mod
    torch.manual_seed(0)
    model = model_mod.VideoDiT(in_channels=4, hidden_size=24, num_layers=1, num_heads=2)
    x = make_batch()["latents"]
    x[2, 1] = float("inf")
    result = locate_nonfinite(model, lambda: model(x, torch.tensor([1, 2, 3])).float().pow(2).mean())
    assert result["forward"]["module"] == "patch_embed"
    assert result["forward"]["inputs_nonfinite"] is True
    assert result["forward"]["inputs"]["args[0]"]["inf"] == 16 * 2


def test_hooks_removed_when_the_body_raises():
    model = make_model()
    with pytest.raises(RuntimeError, match="boom"):
        with NonFiniteLocator(model):
            assert _hook_count(model) > 0
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


def test_tensor_stats_ignores_nonfinite_values_in_ranges():
    t = torch.tensor([1.0, -3.0, float("nan"), float("inf")])
    s = tensor_stats(t)
    assert (s["min"], s["max"], s["absmax"], s["nonfinite"], s["nan"], s["inf"]) == (-3.0, 1.0, 3.0, 2, 1, 1)
    assert tensor_stats(torch.tensor([5, 7]))["nonfinite"] == 0
    assert tensor_stats(torch.full((2,), float("nan")))["absmax"] is None
