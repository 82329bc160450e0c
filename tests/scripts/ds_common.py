"""Shared by the DeepSpeed test scripts (tests/scripts/deepspeed_*.py): one tiny ZeRO engine through Accelerate
on CPU, its deterministic batches, and a bitwise view of everything an optimizer step can change."""

from __future__ import annotations

import hashlib

import torch
from accelerate import Accelerator, DeepSpeedPlugin

from vidstab.engines.deepspeed_support import ZeroPartitions, accelerator_kwargs_handlers


def build(stage: int, precision: str, accum: int, lr: float = 1e-2, zero_extra: dict | None = None,
          ds_scheduler: bool = False, hidden: int = 32, micro_batch: int = 4, prepare: bool = True):
    """(accelerator, engine, optimizer, lr_scheduler, dtype): a 2-layer MLP (``hidden`` wide: odd for partitions
    with padding), AdamW, a decaying LambdaLR (or ``ds_scheduler``: DeepSpeed's WarmupLR from its config);
    ``zero_extra``: more zero_optimization settings. ``prepare=False``: the model, optimizer and scheduler as the
    script's own ``accelerator.prepare`` takes them."""
    # Several engines, one after the other, in one launch: a fresh Accelerate state for each (the process group stays).
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=accum, gradient_clipping=1.0)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    plugin.deepspeed_config["zero_optimization"].update(zero_extra or {})
    if ds_scheduler:
        plugin.deepspeed_config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=precision, gradient_accumulation_steps=accum,
                              kwargs_handlers=accelerator_kwargs_handlers(use_deepspeed=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    if ds_scheduler:
        from accelerate.utils import DummyScheduler

        lr_scheduler = DummyScheduler(optimizer)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if not prepare:
        return accelerator, model, optimizer, lr_scheduler, dtype
    engine, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    return accelerator, engine, optimizer, lr_scheduler, dtype


def batch(index: int, micro: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * index + 10 * micro + rank)
    x = torch.randn(4, 8, generator=g)
    return x.to(dtype), (x[:, :4] * 2 - 1).float()


def user_step(accelerator, model, optimizer, lr_scheduler, loss):
    """The attached form's loop body as users write it; returns the guard's decision (``guard.last_result``)."""
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    return getattr(optimizer, "_vidstab_guard").last_result


def state_copy(engine) -> dict[str, torch.Tensor]:
    """Every tensor a step can change on this rank: fp32 partitions, optimizer moments, module weights (local)."""
    tensors, _ = ZeroPartitions(engine).state()
    out = {k: v.detach().clone() for k, v in tensors.items()}
    for n, p in engine.module.named_parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p
        out["module." + n] = local.detach().clone()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def digest(engine) -> str:
    h = hashlib.sha256()
    for k, v in sorted(state_copy(engine).items()):
        h.update(k.encode())
        h.update(v.float().numpy().tobytes() if v.dtype == torch.bfloat16 else v.numpy().tobytes())
    return h.hexdigest()
