"""DeepSpeed ZeRO (stages 1, 2, 3) under Accelerate: the guard decides before the engine updates.

Under Accelerate, ``accelerator.backward(loss)`` runs ``engine.backward`` and then ``engine.step()`` itself, so
the guard cannot judge a step the way it does under DDP (``optimizer.step()`` is a no-op there). This module
gives the guard a narrow interface to the engine instead (:class:`EngineStep`):

- :meth:`EngineStep.backward`: ``engine.backward`` without the step Accelerate would chain to it;
- :meth:`EngineStep.pre_step_norm`: the global gradient norm before the step, on every rank (a collective):
  what the ZeRO optimizer itself computes inside its step (stages 1/2: ``scaled_global_norm()`` over the loss
  scale; stage 3: ``combine_grad_norm_groups(_get_norm_groups())``);
- :meth:`EngineStep.apply`: ``engine.step()``, the ZeRO optimizer reading that same norm instead of computing
  it again;
- :meth:`EngineStep.skip`: ``engine.step()`` with the norm reading +inf, which sends DeepSpeed down its own
  overflow path on every rank: nothing is updated, gradients are dropped, ``skipped_steps`` grows, the LR
  scheduler is held and Accelerate's ``optimizer_step_was_skipped`` is true.

:class:`ZeroPartitions` reads and writes each rank's fp32 master partitions and their optimizer state as plain
tensors (the checkpoint backend :mod:`vidstab.checkpoint.deepspeed_backend` stores them as safetensors) and
rebuilds the module weights from them.

These are DeepSpeed internals, not public API: :func:`check_supported` refuses any DeepSpeed version other
than those in :data:`TESTED_VERSIONS`, and every set-up the tests do not cover (fp16, CPU/NVMe offload, MoE,
the pipeline engine, stage 0), each with the reason. Nothing here imports DeepSpeed unless the run uses it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["TESTED_VERSIONS", "DeepSpeedUnsupported", "EngineStep", "ZeroPartitions", "accelerator_kwargs_handlers",
           "check_supported", "engine_of", "is_deepspeed", "skip_shm_op_build"]

TESTED_VERSIONS = ("0.19.8",)
"""DeepSpeed versions whose internals (pre-step norm, overflow path, partitions) the tests cover."""

SHM_OP = "deepspeed_shm_comm"


class DeepSpeedUnsupported(RuntimeError):
    """A DeepSpeed set-up vidstab does not serve (untested): the message says why and what to use."""


def is_deepspeed(accelerator: Any) -> bool:
    """Whether ``accelerator`` trains through a DeepSpeed engine (read without importing DeepSpeed)."""
    kind = getattr(accelerator, "distributed_type", "")
    return str(getattr(kind, "value", kind)).upper() == "DEEPSPEED"


def skip_shm_op_build() -> None:
    """Tell DeepSpeed its C++ shared-memory collective op cannot be built here, so its process group starts
    without compiling it (minutes on a CPU; a build killed midway leaves a lock file that hangs every later
    run). DeepSpeed then does every collective through torch.distributed (gloo on CPU), as it does wherever
    the op is unavailable. Call it before the ``Accelerator`` is built (the process group is made there)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # the check DeepSpeed's build_shm_op() makes first


def accelerator_kwargs_handlers(use_deepspeed: bool | None = None) -> list:
    """The ``kwargs_handlers`` a DeepSpeed run on CPU needs, to pass to ``Accelerator(...)``: the gloo process
    group (without it Accelerate counts one process) and no shared-memory op build (:func:`skip_shm_op_build`).
    Empty for any other run. ``use_deepspeed``: default from ``accelerate launch --use_deepspeed``'s
    environment (``ACCELERATE_USE_DEEPSPEED``)."""
    if use_deepspeed is None:
        use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")
    if not use_deepspeed or torch.cuda.is_available():
        return []
    from accelerate.utils import InitProcessGroupKwargs

    skip_shm_op_build()
    return [InitProcessGroupKwargs(backend="gloo")]


def engine_of(accelerator: Any, model: Any = None) -> Any:
    """The DeepSpeed engine: ``model`` when it is one (``accelerator.prepare`` returns it), else the
    accelerator's."""
    if model is not None and hasattr(model, "zero_optimization_stage"):
        return model
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is None:
        raise DeepSpeedUnsupported("no DeepSpeed engine: call accelerator.prepare(model, optimizer, ...) first")
    return wrapped.engine


def check_supported(engine: Any) -> None:
    """Refuse, with the reason, what vidstab has not tested under DeepSpeed (raises :class:`DeepSpeedUnsupported`)."""
    import deepspeed

    if deepspeed.__version__ not in TESTED_VERSIONS:
        raise DeepSpeedUnsupported(
            f"vidstab under DeepSpeed reads engine internals (the pre-step gradient norm, the overflow path, the "
            f"ZeRO partitions) that are tested with deepspeed {', '.join(TESTED_VERSIONS)} only; this is "
            f"deepspeed {deepspeed.__version__}. Install the tested version: pip install -e \".[deepspeed]\" in your "
            f"vidstab clone (the distribution vidstab-train; PyPI's 'vidstab' is another package)")
    why = None
    if type(engine).__name__ == "PipelineEngine" or hasattr(engine, "train_batch") and hasattr(engine, "num_stages"):
        why = ("DeepSpeed's pipeline engine is not supported: its train_batch() runs forward, backward and step "
               "in one call, with no point between the gradients and the update for the guard to decide")
    elif engine.fp16_enabled():
        why = ("fp16 under DeepSpeed is not supported (untested: DeepSpeed refuses fp16 on CPU, where vidstab's "
               "tests run). On a GPU use bf16 ('mixed_precision: bf16'); with fp16 DeepSpeed's dynamic loss scaler "
               "would take vidstab's skip for an overflow and lower the loss scale")
    elif engine.zero_optimization_stage() not in (1, 2, 3):
        why = (f"ZeRO stage {engine.zero_optimization_stage()} is not supported: use stage 1, 2 or 3 "
               "(--zero_stage), or plain DDP instead of stage 0")
    elif _offloaded(engine.zero_offload_optimizer()) or _offloaded(engine.zero_offload_param()):
        why = ("ZeRO CPU/NVMe offload is not supported (untested: the optimizer state and the master weights "
               "then live in offload buffers vidstab neither checkpoints nor measures); remove offload_optimizer/"
               "offload_param from the DeepSpeed config")
    elif getattr(engine, "has_moe_layers", False):
        why = ("DeepSpeed MoE layers are not supported (untested: expert-parallel gradients and partitions); "
               "train the MoE model with FSDP2 or DDP")
    elif getattr(engine, "lr_scheduler", None) is not None:
        why = ("an LR scheduler from the DeepSpeed config is not supported (untested: the engine steps it and "
               "would overwrite the LR back-off of a rollback); pass a torch LR scheduler to accelerator.prepare "
               "instead (Accelerate steps it with the optimizer and holds it after a skipped step)")
    elif not getattr(engine.optimizer, "compute_grad_norm", True):
        why = "the ZeRO optimizer was built without computing the gradient norm (compute_grad_norm=False)"
    if why:
        raise DeepSpeedUnsupported(why)


def _offloaded(offload: Any) -> bool:
    """Whether a ZeRO offload config sends something to the CPU or NVMe (its device is not ``none``)."""
    device = getattr(offload, "device", None)
    return offload is not None and str(getattr(device, "value", device)).lower() not in ("none", "")


class EngineStep:
    """The guard's way into one DeepSpeed engine's optimizer step (module docstring). Built at attach."""

    def __init__(self, accelerator: Any, engine: Any) -> None:
        check_supported(engine)
        self.accelerator = accelerator
        self.engine = engine
        self.zero = engine.optimizer  # DeepSpeedZeroOptimizer (stages 1/2) or DeepSpeedZeroOptimizer_Stage3
        self.stage = int(engine.zero_optimization_stage())
        clip = float(engine.gradient_clipping() or 0.0)
        self.max_grad_norm = clip if clip > 0 else None
        """DeepSpeed clips to this (its ``gradient_clipping``); None: no clipping."""
        self._scaled_norm: torch.Tensor | None = None  # the pre-step norm, as the ZeRO optimizer computes it

    def master_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 master weights: views of the real elements of its partitions (no padding), disjoint
        across ranks."""
        return ZeroPartitions(self.engine).real()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """What ``accelerator.backward`` does under DeepSpeed, without the ``engine.step()`` it chains to it."""
        self.engine.set_gradient_accumulation_boundary(is_boundary=self.accelerator.sync_gradients)
        self.engine.backward(loss, **kwargs)

    @torch.no_grad()
    def pre_step_norm(self) -> torch.Tensor:
        """The global gradient L2 norm of the step about to be taken (unscaled), the same on every rank: a
        collective over the data-parallel group, so every rank calls it. Kept for :meth:`apply`."""
        zero = self.zero
        if self.stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            scaled = combine_grad_norm_groups(zero._get_norm_groups())
        else:
            scaled = zero.scaled_global_norm()
        self._scaled_norm = scaled
        return (scaled / float(zero.loss_scale)).float().reshape(())

    def apply(self) -> None:
        """``engine.step()``: the update, clipped by DeepSpeed to its ``gradient_clipping``, the LR scheduler
        stepped by the engine. The ZeRO optimizer reads the norm :meth:`pre_step_norm` took."""
        norm = self._scaled_norm
        if norm is None:
            norm = self.pre_step_norm() * float(self.zero.loss_scale)
        self._step_reading(norm, force_check=False)

    def skip(self) -> None:
        """``engine.step()`` down DeepSpeed's own overflow path, on every rank alike (see module docstring)."""
        self._step_reading(torch.tensor(float("inf")), force_check=True)

    def _step_reading(self, scaled_norm: torch.Tensor, force_check: bool) -> None:
        """One ``engine.step()`` whose ZeRO optimizer reads ``scaled_norm`` as the global gradient norm."""
        zero, self._scaled_norm = self.zero, None
        if self.stage == 3:
            patch = ("_get_norm_groups", lambda: [scaled_norm])
        else:
            patch = ("scaled_global_norm", lambda norm_type=2: scaled_norm)
        setattr(zero, *patch)  # on the instance, for this one step
        # Stages 1/2 in bf16 treat an infinite norm as overflow only when check_grad_overflow is on.
        check = getattr(zero, "check_grad_overflow", None)
        if force_check and check is False:
            zero.check_grad_overflow = True
        try:
            self.engine.step()
        finally:
            delattr(zero, patch[0])
            if force_check and check is False:
                zero.check_grad_overflow = False

    def oom_stop(self, step: int, rank: int, exc: BaseException) -> RuntimeError:
        """The error that ends a process whose ``engine.step()`` ran out of memory: the engine updates this rank's
        partition and then gathers every rank's, so neither whether the ranks still hold one step nor a skip or
        rollback in lockstep can be had (a peer may be waiting inside the engine's gather)."""
        from ..recovery.oom import OptimizerStateDiverged

        wider = "more processes or ZeRO-3" if self.stage < 3 else "more processes"
        return OptimizerStateDiverged(
            f"vidstab: step {step}, rank {rank}: out of memory inside DeepSpeed's engine.step() (ZeRO-{self.stage}): "
            f"{str(exc)[:200]}. DeepSpeed updates the partitions and gathers them from every rank inside its engine, "
            f"so vidstab can neither tell whether the ranks still hold one step nor skip or roll back in lockstep: "
            f"stopping this process. Resume from your last checkpoint (accelerate launch --max_restarts N restarts "
            f"the job on its own; your script's resume, e.g. --resume_from_checkpoint latest, reloads it). If it "
            f"recurs, the optimizer step does not fit: partition it over {wider}")

    @property
    def skipped(self) -> bool:
        """Whether the engine's last step went down the overflow path (DeepSpeed's own reading)."""
        return bool(getattr(self.zero, "overflow", False))


class ZeroPartitions:
    """Each rank's ZeRO fp32 master partitions and their optimizer state, as plain tensors.

    ``state()`` -> ``(tensors, structure)``: ``fp32.{g}`` (the flat partition of group ``g``) and
    ``state.{g}.{key}`` (its optimizer state, e.g. Adam's ``exp_avg``); ``structure`` holds the layout (stage,
    world size, numels) and the non-tensor values (param-group hyper-parameters). ``load(tensors, structure)``
    writes them back in place and rebuilds the module weights from the fp32 partitions, as DeepSpeed's own
    checkpoint load does (a collective at every stage: every rank calls it)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zero = engine.optimizer
        self.stage = int(engine.zero_optimization_stage())
        self.fp32: list[torch.Tensor] = list(self.zero.fp32_partitioned_groups_flat if self.stage == 3
                                             else self.zero.single_partition_of_fp32_groups)

    def real(self) -> list[torch.Tensor]:
        """Views of this rank's fp32 partitions that hold weights, without the padding that aligns each partition
        to the world size. At ZeRO-3 every parameter's partition is padded and the padding is never written
        (``torch.empty``: any bits, NaN included), so a norm or a finiteness check reads these views only."""
        zero = self.zero
        if self.stage != 3:  # one flat partition per group, its alignment padding at the end
            return [t.narrow(0, 0, t.numel() - int(pad)) for t, pad in zip(self.fp32, zero.groups_padding)]
        import torch.distributed as dist

        views: list[torch.Tensor] = []
        for flat, params, group in zip(self.fp32, zero.fp16_groups, zero.sub_group_process_groups):
            rank = dist.get_rank(group=group)
            offset, start, length = 0, 0, 0  # the current run of real elements: [start, start + length)
            for p in params:
                size = int(p.partition_numel())
                real = max(0, min(size, int(p.ds_numel) - rank * size))  # the rank's slice of the flat parameter
                if real and offset == start + length:
                    length += real
                else:
                    if length:
                        views.append(flat.narrow(0, start, length))
                    start, length = offset, real
                offset += size
            if length:
                views.append(flat.narrow(0, start, length))
        return views

    def layout(self) -> dict:
        import torch.distributed as dist

        return {"stage": self.stage, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "numels": [int(t.numel()) for t in self.fp32], "dtypes": [str(t.dtype) for t in self.fp32]}

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        base = self.zero.optimizer  # the user's torch optimizer, stepping the fp32 partitions
        tensors: dict[str, torch.Tensor] = {}
        values: list[dict] = []
        for g, p in enumerate(self.fp32):
            tensors[f"fp32.{g}"] = p.detach()
            kept = {}
            for key, v in base.state.get(p, {}).items():
                if torch.is_tensor(v):
                    tensors[f"state.{g}.{key}"] = v.detach()
                else:
                    kept[key] = v
            values.append(kept)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in base.param_groups]
        structure = {**self.layout(), "state_values": values, "param_groups": groups,
                     "engine": {k: int(getattr(self.engine, k, 0)) for k in
                                ("global_steps", "global_samples", "skipped_steps", "micro_steps")}}
        return tensors, structure

    def check(self, ckpt: str, structure: dict, tensors: dict[str, torch.Tensor] | None) -> str | None:
        """Why this rank cannot load ``structure``/``tensors`` (None: it can)."""
        here = self.layout()
        if structure.get("world_size") != here["world_size"]:
            return (f"{ckpt} holds DeepSpeed ZeRO partitions of {structure.get('world_size')} processes; this run has "
                    f"{here['world_size']}. A DeepSpeed checkpoint of vidstab resumes on the same number of "
                    f"processes only: relaunch with --num_processes {structure.get('world_size')}")
        if structure.get("stage") != here["stage"]:
            return (f"{ckpt} was written at ZeRO stage {structure.get('stage')}; this run uses stage {here['stage']}: "
                    f"relaunch with --zero_stage {structure.get('stage')}")
        if structure.get("numels") != here["numels"] or structure.get("dtypes") != here["dtypes"]:
            return (f"{ckpt}: the ZeRO partitions ({structure.get('numels')}, {structure.get('dtypes')}) do not fit "
                    f"this model's ({here['numels']}, {here['dtypes']}): another model or optimizer grouping")
        if tensors is not None:
            for g, p in enumerate(self.fp32):
                t = tensors.get(f"fp32.{g}")
                if t is None or t.shape != p.shape or t.dtype != p.dtype:
                    return f"{ckpt}: partition fp32.{g} is missing or has another shape/dtype"
            for name, t in tensors.items():  # the optimizer's moments live beside their partition, in its dtype
                group = name.split(".")[1] if name.startswith("state.") else ""
                p = self.fp32[int(group)] if group.isdigit() and int(group) < len(self.fp32) else None
                if p is not None and t.dim() and (t.shape != p.shape or t.dtype != p.dtype):
                    return (f"{ckpt}: optimizer state {name} is {t.dtype} {tuple(t.shape)}, its partition fp32.{group} "
                            f"is {p.dtype} {tuple(p.shape)}: written by another run or altered; not loaded")
        return None

    @torch.no_grad()
    def full_weights(self, main: bool) -> dict[str, torch.Tensor] | None:
        """The module's full state dict (its training dtype) on the main process (``main``), None elsewhere. At
        ZeRO-3 the parameters are gathered from the partitions: a collective, every rank calls it."""
        module = self.engine.module
        if self.stage != 3:
            return {k: v.detach().clone() for k, v in module.state_dict().items()} if main else None
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()} if main else None

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], structure: dict) -> None:
        base = self.zero.optimizer
        for group, saved in zip(base.param_groups, structure["param_groups"]):
            group.update(saved)
        for g, p in enumerate(self.fp32):
            p.data.copy_(tensors[f"fp32.{g}"])
            state: dict = {}
            prefix = f"state.{g}."
            old = base.state.get(p, {})
            for name, t in tensors.items():
                if name.startswith(prefix):
                    key = name[len(prefix):]
                    cur = old.get(key)
                    if torch.is_tensor(cur) and cur.shape == t.shape and cur.dtype == t.dtype:
                        state[key] = cur.copy_(t)
                    else:
                        state[key] = t.clone()
            state.update(structure["state_values"][g])
            if state:
                base.state[p] = state
            else:
                base.state.pop(p, None)  # saved before the first step: a fresh engine's state
        for k, v in structure.get("engine", {}).items():
            setattr(self.engine, k, int(v))
        self.rebuild_weights()

    @torch.no_grad()
    def rebuild_weights(self) -> None:
        """The module weights from the fp32 partitions, on every rank (DeepSpeed's own steps of a load)."""
        zero = self.zero
        if self.stage == 3:
            zero.checkpoint_event_prologue()  # partition every parameter
            for g in range(len(self.fp32)):
                zero._reassign_or_swap_out_partitioned_parameters(g)  # fp32 -> the low-precision flat -> params
            zero.checkpoint_event_epilogue()  # gather the persistent parameters again
        else:
            zero.update_lp_params()  # fp32 -> this rank's bit16 partition, then all-gather the groups
        zero.zero_grad(set_to_none=True)
        if hasattr(zero, "overflow"):
            zero.overflow = False
