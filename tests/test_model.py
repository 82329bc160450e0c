"""Fast CPU tests of the reference VideoDiT (fp32)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vidstab.reference.model import Attention, VideoDiT, apply_rope, rope_tables

LAYOUTS = [
    ("full", "rope"),
    ("full", "sincos"),
    ("factorized", "rope"),
    ("factorized", "sincos"),
]


def _perturbed(model: VideoDiT, seed: int = 0, std: float = 0.05) -> VideoDiT:
    """Move every parameter off its init (AdaLN-Zero makes an untrained model trivially 0 / identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
    return model


def _inputs(b=2, c=4, f=3, h=8, w=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, c, f, h, w, generator=gen), torch.tensor([17, 803])[:b]


@pytest.mark.parametrize("attention_type,pos_embed", LAYOUTS)
def test_output_shape(attention_type, pos_embed):
    model = VideoDiT(attention_type=attention_type, pos_embed=pos_embed, out_channels=6)
    x, t = _inputs()
    y = model(x, t)
    assert isinstance(y, torch.Tensor)
    assert y.shape == (2, 6, 3, 8, 6)
    # another grid through the same model (positions come from the input shape), float timesteps
    y = _perturbed(model)(torch.randn(1, 4, 5, 4, 10), torch.tensor([0.25]))
    assert y.shape == (1, 6, 5, 4, 10) and torch.isfinite(y).all()


def test_patch_size_and_timestep_forms():
    model = _perturbed(VideoDiT(patch_size=(2, 2, 1)))
    x = torch.randn(2, 4, 4, 6, 3)
    assert model(x, torch.tensor([5, 5])).shape == x.shape
    torch.testing.assert_close(model(x, 5), model(x, torch.tensor([5.0, 5.0])))  # scalar broadcasts


@pytest.mark.parametrize("attention_type,pos_embed", LAYOUTS)
def test_adaln_zero_blocks_start_as_identity(attention_type, pos_embed):
    model = VideoDiT(attention_type=attention_type, pos_embed=pos_embed, num_layers=3)
    seen = []
    hooks = [
        block.register_forward_hook(lambda mod, args, out: seen.append((args[0].clone(), out.clone())))
        for block in model.blocks
    ]
    x, t = _inputs()
    y = model(x, t)
    for h in hooks:
        h.remove()
    assert len(seen) == 3
    for block_in, block_out in seen:
        assert torch.equal(block_in, block_out)
        assert block_in.abs().sum() > 0  # the tokens themselves are not trivially zero
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("attention_type,pos_embed", LAYOUTS)
def test_every_attention_goes_through_sdpa(monkeypatch, attention_type, pos_embed):
    model = _perturbed(VideoDiT(attention_type=attention_type, pos_embed=pos_embed, num_layers=3))
    x, t = _inputs()
    expected = model(x, t)

    real_sdpa = F.scaled_dot_product_attention
    calls = []

    def counting_sdpa(q, k, v, *args, **kwargs):
        calls.append((q.shape, k.shape, v.shape))
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    y = model(x, t)
    per_block = 2 if attention_type == "factorized" else 1
    assert len(calls) == 3 * per_block
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    # (batch, heads, tokens, head_dim) layout on a 3 x 4 x 3 patch grid
    if attention_type == "full":
        assert calls[0][0] == (2, 4, 36, 16)
    else:  # spatial: one sequence of 4 x 3 tokens per frame; temporal: one of 3 frames per spot
        assert calls[0][0] == (2 * 3, 4, 12, 16)
        assert calls[1][0] == (2 * 12, 4, 3, 16)


def test_factorized_attention_equals_masked_full_attention():
    torch.manual_seed(0)
    f, h, w = 3, 4, 5
    x = torch.randn(2, f * h * w, 32)
    rope = rope_tables((f, h, w), 8, "cpu")
    frame = torch.arange(f * h * w) // (h * w)
    spot = torch.arange(f * h * w) % (h * w)
    for layout, mask in [
        ("spatial", frame[:, None] == frame[None]),
        ("temporal", spot[:, None] == spot[None]),
    ]:
        attn = Attention(32, 4, layout, qk_norm=True, eps=1e-6)
        full = Attention(32, 4, "full", qk_norm=True, eps=1e-6)
        full.load_state_dict(attn.state_dict())
        real_sdpa = F.scaled_dot_product_attention
        try:
            F.scaled_dot_product_attention = lambda q, k, v: real_sdpa(q, k, v, attn_mask=mask)
            reference = full(x, (f, h, w), rope)
        finally:
            F.scaled_dot_product_attention = real_sdpa
        torch.testing.assert_close(attn(x, (f, h, w), rope), reference, rtol=1e-5, atol=1e-6)


def test_rope_depends_on_relative_position_only():
    torch.manual_seed(0)
    grid = (5, 6, 7)
    cos, sin = rope_tables(grid, 16, "cpu")
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def rotate(x, pos):
        i = (pos[0] * 6 + pos[1]) * 7 + pos[2]
        return apply_rope(x, cos[i : i + 1], sin[i : i + 1])

    def score(pos_q, pos_k):
        return (rotate(q, pos_q) * rotate(k, pos_k)).sum()

    torch.testing.assert_close(score((1, 2, 3), (0, 1, 1)), score((3, 4, 5), (2, 3, 3)))
    for moved in [(2, 3, 4), (2, 2, 3), (1, 3, 3)]:  # a different offset along t, h or w changes it
        assert not torch.allclose(score((3, 4, 5), moved), score((1, 2, 3), (0, 1, 1)), atol=1e-3)
    torch.testing.assert_close(rotate(q, (4, 5, 6)).norm(), q.norm())  # a rotation


@pytest.mark.parametrize("attention_type", ["full", "factorized"])
def test_save_pretrained_round_trip(tmp_path, attention_type):
    model = _perturbed(VideoDiT(attention_type=attention_type, pos_embed="sincos", patch_size=(1, 2, 1)))
    model.save_pretrained(tmp_path)
    loaded = VideoDiT.from_pretrained(tmp_path)
    public = lambda cfg: {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if not k.startswith("_")}
    assert public(loaded.config) == public(model.config)
    x, t = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t), model(x, t), rtol=0, atol=0)


@pytest.mark.parametrize("attention_type", ["full", "factorized"])
def test_gradient_checkpointing_same_gradients(attention_type):
    model = _perturbed(VideoDiT(attention_type=attention_type, num_layers=3))
    x, t = _inputs()

    def grads():
        model.zero_grad(set_to_none=True)
        model(x, t).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    model.enable_gradient_checkpointing()
    assert model.gradient_checkpointing and model.is_gradient_checkpointing
    calls = []
    real_func = model._gradient_checkpointing_func
    model._gradient_checkpointing_func = lambda *a: calls.append(1) or real_func(*a)
    checkpointed = grads()
    assert len(calls) == 3  # every block went through the checkpoint function
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    model.disable_gradient_checkpointing()
    assert not model.gradient_checkpointing


@pytest.mark.parametrize("attention_type,pos_embed", LAYOUTS)
def test_bf16_autocast_close_to_fp32(attention_type, pos_embed):
    model = _perturbed(VideoDiT(attention_type=attention_type, pos_embed=pos_embed))
    x, t = _inputs()
    reference = model(x, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, t)
    y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference, rtol=0.05, atol=0.05)
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name


def test_bf16_weights_take_fp32_latents_without_autocast():
    """What DeepSpeed bf16 does: the weights held in bf16, no autocast, the data loader's latents fp32."""
    model = _perturbed(VideoDiT())
    x, t = _inputs()
    reference = model(x, t)
    y = model.to(torch.bfloat16)(x, t)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference, rtol=0.1, atol=0.1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"hidden_size": 64, "num_heads": 5}, "divisible by num_heads"),
        ({"hidden_size": 40, "num_heads": 8}, "RoPE"),  # head dim 5: odd
        ({"hidden_size": 16, "num_heads": 4}, "RoPE"),  # head dim 4: too small for (t, h, w)
        ({"attention_type": "windowed"}, "attention_type"),
        ({"pos_embed": "learned"}, "pos_embed"),
        ({"patch_size": (1, 2)}, "patch_size"),
        ({"patch_size": (1, 0, 2)}, "patch_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"in_channels": 0}, "in_channels"),
        ({"mlp_ratio": 0}, "mlp_ratio"),
        ({"num_train_timesteps": 0}, "num_train_timesteps"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_config_raises_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VideoDiT(**kwargs)


def test_sincos_allows_head_dims_rope_cannot():
    model = VideoDiT(hidden_size=16, num_heads=4, pos_embed="sincos")  # head dim 4: too small to split over 3 axes
    out = model(torch.randn(1, 4, 2, 4, 4), torch.tensor([10]))
    assert out.shape == (1, 4, 2, 4, 4)
    with pytest.raises(ValueError):
        VideoDiT(hidden_size=16, num_heads=4, pos_embed="rope")


def test_bad_inputs_raise_clear_error():
    model = VideoDiT(patch_size=(2, 2, 2))
    with pytest.raises(ValueError, match="divisible by patch_size"):
        model(torch.randn(1, 4, 3, 8, 8), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"\[B, C, F, H, W\]"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([1]))
    with pytest.raises(ValueError, match="timestep"):
        model(torch.randn(2, 4, 2, 8, 8), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("attention_type", ["full", "factorized"])
def test_tiny_model_learns(attention_type):
    torch.manual_seed(0)
    model = VideoDiT(hidden_size=48, num_heads=4, num_layers=2, attention_type=attention_type)
    x, t = _inputs(seed=1)
    target = -0.5 * x + torch.roll(x, 1, dims=-1)  # a fixed, learnable map of the input
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = F.mse_loss(model(x, t), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_benchmark_quick_run_reports_every_model(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_model.py"
    spec = importlib.util.spec_from_file_location("bench_model", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_model", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = bench.main(["--quick", "--no_factorized"])
    micro = out["sizes"]["micro"]
    assert set(micro["models"]) == {"ours", "wan", "wan_no_xattn"}
    for row in micro["models"].values():
        assert row["ms_median"] > 0 and row["params"] > 0
    assert micro["ratios"]["time_vs_wan"] > 0  # the claim itself is the benchmark's business, not CI's
