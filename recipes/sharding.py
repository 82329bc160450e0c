"""``recipes/train.py --fsdp``: shard the reference DiT per block with FSDP2, on GPU through Accelerate or on
CPU by hand, and say how its checkpoints are written.

Two launch forms give the same sharded model (one FSDP2 unit per ``VideoDiTBlock`` plus the root):

- GPU: ``accelerate launch --use_fsdp --fsdp_version 2 recipes/train.py --fsdp``. Accelerate's ``prepare``
  applies ``fully_shard``; this module only asks for per-block wrapping (transformer-based auto wrap on
  ``VideoDiTBlock``) when the launch did not choose a policy. Written to Accelerate 1.15's FSDP2 API
  (``FullyShardedDataParallelPlugin.fsdp_version/auto_wrap_policy/transformer_cls_names_to_wrap``); it has
  not been run here (no GPU in CI).
- CPU (tests, any ``accelerate launch --multi_gpu`` with ``ACCELERATE_USE_CPU=1``, or torchrun): Accelerate
  refuses FSDP on CPU, so the trainer applies ``fully_shard`` itself on a gloo mesh of all ranks and
  prepares only the optimizer, data loader and scheduler (DDP must not wrap a sharded model).

At world size 1 nothing is sharded (a 1-rank mesh adds nothing), but checkpoints stay sharded (DCP): a
2-process ``--fsdp`` checkpoint resumes in 1 process and back.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

BLOCK_CLASS = "VideoDiTBlock"


def accelerate_shards(accelerator: Accelerator) -> bool:
    """Whether Accelerate itself applies FSDP (``accelerate launch --use_fsdp``); only FSDP2 is accepted."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return False
    plugin = accelerator.state.fsdp_plugin
    if int(getattr(plugin, "fsdp_version", 1) or 1) != 2:
        raise SystemExit("--fsdp needs FSDP2: launch with `accelerate launch --use_fsdp --fsdp_version 2`")
    if plugin.auto_wrap_policy is None and not plugin.transformer_cls_names_to_wrap:
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        plugin.auto_wrap_policy = transformer_auto_wrap_policy
        plugin.transformer_cls_names_to_wrap = [BLOCK_CLASS]
    return True


def shard_model(accelerator: Accelerator, model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
    """Apply FSDP2 ``fully_shard`` per block and to the root on a mesh of all ranks (``fsdp`` on, more than
    one rank, and Accelerate not doing it itself). Call before building the optimizer: sharding replaces
    the parameters by DTensors."""
    if not fsdp or accelerator.num_processes == 1 or accelerate_shards(accelerator):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def prepare(accelerator: Accelerator, fsdp: bool, model, optimizer, dataloader, lr_scheduler):
    """``accelerator.prepare`` of the four, except a model this module sharded itself (DDP must not wrap it)."""
    if fsdp and accelerator.num_processes > 1 and not accelerate_shards(accelerator):
        optimizer, dataloader, lr_scheduler = accelerator.prepare(optimizer, dataloader, lr_scheduler)
        return model, optimizer, dataloader, lr_scheduler
    return accelerator.prepare(model, optimizer, dataloader, lr_scheduler)


def full_model(accelerator: Accelerator, model: torch.nn.Module, model_class: type) -> torch.nn.Module | None:
    """The model as one plain module for export and validation sampling, which run on the main process.

    Unsharded: the unwrapped model itself, on every rank. Sharded (FSDP2 DTensor parameters): every rank must
    call this, since gathering the full state dict is a collective (``get_model_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``: only rank 0 receives it, in host memory); the main process
    gets a fresh ``model_class.from_config`` copy holding those weights, the other ranks ``None``. A forward
    of the sharded model on the main process alone would wait forever for the other ranks' all-gathers.
    """
    unwrapped = accelerator.unwrap_model(model)
    from vidstab.signals import is_dtensor

    if getattr(model, "zero_optimization_partition_weights", lambda: False)():  # DeepSpeed ZeRO-3: partitioned
        return _gathered_zero3(accelerator, unwrapped, model_class)
    if not any(is_dtensor(p) for p in unwrapped.parameters()):
        return unwrapped
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(unwrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not accelerator.is_main_process:
        return None
    plain = model_class.from_config(unwrapped.config)
    plain.load_state_dict(state, strict=True)
    return plain.to(accelerator.device)


def _gathered_zero3(accelerator: Accelerator, module: torch.nn.Module, model_class: type) -> torch.nn.Module | None:
    """A ZeRO-3 module's full weights, gathered on every rank (a collective), copied into a fresh plain model on
    the main process (``None`` on the others)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        state = ({k: v.detach().clone() for k, v in module.state_dict().items()}
                 if accelerator.is_main_process else None)
    if state is None:
        return None
    plain = model_class.from_config(module.config)
    plain.load_state_dict(state, strict=True)
    return plain.to(accelerator.device)


def full_ema(accelerator: Accelerator, ema):
    """``ema`` (``diffusers.training_utils.EMAModel``) with plain full shadow weights, for export and
    validation sampling on the main process. Unsharded (or no EMA): ``ema`` itself, on every rank. Sharded
    (``--fsdp --use_ema``: the shadow weights are DTensors sharded like the parameters and updated on each
    rank's shard): every rank must call this (``full_tensor`` is an all-gather); the main process gets a new
    ``EMAModel`` holding the gathered weights, the other ranks ``None``."""
    from vidstab.signals import is_dtensor

    if ema is None or not any(is_dtensor(p) for p in ema.shadow_params):
        return ema
    full = [p.full_tensor() if is_dtensor(p) else p for p in ema.shadow_params]
    if not accelerator.is_main_process:
        return None
    from diffusers.training_utils import EMAModel

    gathered = EMAModel(full, decay=ema.decay)
    gathered.load_state_dict({**ema.state_dict(), "shadow_params": gathered.shadow_params})
    return gathered
