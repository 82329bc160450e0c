"""Fault injection for drills, demos and tests: ``--inject_fault KIND@STEP[:RANK][=ARG]``.

A stability tool that has never seen a fault is untested. These faults reproduce, on purpose and at a
chosen optimizer step, the failures the seeds describe:

==============  ==========================================================================================
``nan_batch``   the micro-batch's latents become NaN (bad data: the first thing to triage, docs/PRACTICES.md B4)
``inf_latent``  one latent value becomes +inf (an extreme VAE latent)
``big_latent``  the first sample's latents are scaled by 1e4 (``=FACTOR``): finite but extreme, like an
                unclamped VAE encoding of a bad clip
``const_batch`` every clip of the micro-batch becomes constant frames (its first frame repeated)
``lr_spike``    the learning rate is multiplied by 1000 (``=FACTOR`` to choose) from that step until the
                optimizer/scheduler state is reloaded (a rollback clears it, as it would a bad schedule)
``lr_ramp``     the learning rate is multiplied by 1.3 (``=FACTOR``) at every step from that step on, until a
                rollback: a slowly diverging schedule, the exponential grad-norm growth of docs/PRACTICES.md A2
``lr_base``     the scheduler's own base LRs are multiplied by 100 (``=FACTOR``) from that step on, for good:
                re-applied whenever a reload (a rollback) or a hold puts them back, as a bug in the schedule's
                code would (the held schedule restores the LR for one step, the bug writes it again)
``lr_bug``      the learning rate written x1000 into the optimizer (``=FACTOR``, or ``=FACTORxSTEPS`` for that
                many steps from that step on, e.g. ``lr_bug@9=1e4x3``): a bug in the loop's code; the
                schedule itself is untouched, so the bug ends by itself (and at a rollback)
``grad_spike``  the step's loss, hence its gradients, x1000 (``=FACTOR``) on its first micro-batch: a gradient
                spike on healthy data
``exception``   a ``RuntimeError`` is raised inside the step (before the forward)
``inf_module``  the named module's forward output becomes +inf (``=blocks.0.attn``): a structure fault. It
                stays in the model from that step on (as a real overflowing layer would), and incident
                bundles record it in their model spec, so ``vidstab replay`` rebuilds the faulty model
``flaky_activation`` one activation of the named module's output (``=blocks.0``; default: the model's first
                module with parameters) becomes NaN on the first forward pass of that step only, on that
                rank: a transient hardware fault (a bit flip) that a rerun of the step does not reproduce
``hang``        the rank blocks forever before it fetches the step's data (a data loader or file system that
                never returns); its peers then wait in their next collective. The watchdog ends it
``kill``        the rank SIGKILLs itself after the step's backward, before the guard's gather (a lost
                process or node: no last words, its peers see the connection close)
``kill_in_save`` the rank SIGKILLs itself inside the checkpoint save of that step, once its own files
                (its DCP shards, its RNG state) are written and before the ranks agree on the save: the
                half-written ``.tmp-*`` folder must never be loaded (needs a save at that step)
``kill_worker`` the rank's data-loader worker SIGKILLs itself as it loads the first sample after the rank
                reached that step (the kernel's out-of-memory killer ending a worker; needs loader workers)
``slow``        from that step on the rank's forward/backward takes ``=FACTOR`` (default 3) times as long
                (a throttled or faulty GPU, a straggler): it sleeps ``FACTOR - 1`` times its fastest measured
                compute (the fastest: a measurement that includes waiting for a slow peer would compound)
==============  ==========================================================================================

Out-of-memory drills (:mod:`vidstab.recovery.oom`; the trainer's forward calls :meth:`FaultInjector.maybe_oom`):

===================  =====================================================================================
``oom``              a ``torch.OutOfMemoryError`` is raised in that rank's forward, once
``oom_batch_above``  ``=N``: from that step on, every forward of more than N samples raises one, on that rank
                     (every rank without ``:RANK``): a device with a fixed memory budget
``oom_in_step``      one is raised inside ``optimizer.step()`` (:meth:`FaultInjector.arm_optimizer_step`), once:
                     ``=before`` (default) before any weight or state is touched, ``=partway`` after the first
                     half of each parameter group's weights were updated
===================  =====================================================================================

Without ``:RANK`` a fault fires on every rank. Each fault fires once per process: a real transient fault
does not recur after a rollback, and an injected one should not turn every retry into the same failure.
For the same reason no fault but ``slow`` (a slow device stays slow) fires again in a torch-elastic restart
of the job (``restart_count > 0``).
:func:`validate_faults` refuses faults that can never fire (a rank the run does not have, a step past its
end) with an error that names the flag.
"""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .recovery.lr import scale_lrs

FAULT_KINDS = ("nan_batch", "inf_latent", "big_latent", "const_batch", "lr_spike", "lr_ramp", "exception", "inf_module",
               "flaky_activation", "hang", "kill", "kill_in_save", "slow")
# A fault on the scheduler itself, kept apart from the kinds above (vidstab/faults.py's LR block).
FAULT_KINDS += ("lr_base",)
FAULT_KINDS += ("oom", "oom_batch_above", "oom_in_step")  # the out-of-memory drills
FAULT_KINDS += ("kill_worker",)  # host memory: a data-loader worker killed
FAULT_KINDS += ("lr_bug", "grad_spike")  # the conformance drills' LR bug for a few steps and gradient spike
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?(?:=(?P<arg>.+))?$")


class InjectedFault(RuntimeError):
    """The ``exception`` fault: a RuntimeError like a real one raised inside a training step."""


@dataclass
class Fault:
    """One fault to inject."""

    kind: str
    """One of ``FAULT_KINDS``."""
    step: int
    """Optimizer step (0-based, as in the event log) at which it fires."""
    rank: int | None = None
    """Process rank it fires on; ``None`` fires on every rank."""
    arg: str | None = None
    """Kind-specific argument: the LR factor for ``lr_spike``, the module name for ``inf_module``."""
    fired: bool = field(default=False, compare=False)
    """Set once it has fired; faults fire once per process."""

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """Parse ``KIND@STEP[:RANK][=ARG]``, with an error that shows the expected form."""
        match = _SPEC.match(spec.strip())
        if not match:
            raise ValueError(f"--inject_fault {spec!r}: expected KIND@STEP[:RANK][=ARG], e.g. nan_batch@20:1")
        kind = match["kind"]
        if kind not in FAULT_KINDS:
            raise ValueError(f"--inject_fault {spec!r}: unknown kind {kind!r}; choose from {', '.join(FAULT_KINDS)}")
        arg = match["arg"]
        if kind in ("lr_spike", "lr_ramp", "big_latent", "slow") and arg is not None:
            try:
                factor = float(arg)
            except ValueError:
                raise ValueError(f"--inject_fault {spec!r}: {kind} takes a numeric factor, got {arg!r}") from None
            if kind == "slow" and not factor >= 1.0:
                raise ValueError(f"--inject_fault {spec!r}: slow takes a factor >= 1 (how many times slower), got {arg!r}")
        if kind == "grad_spike" and arg is not None and not _is_number(arg):
            raise ValueError(f"--inject_fault {spec!r}: grad_spike takes a numeric factor, got {arg!r}")
        if kind == "lr_bug" and arg is not None and _lr_bug_arg(arg) is None:
            raise ValueError(f"--inject_fault {spec!r}: lr_bug takes =FACTOR or =FACTORxSTEPS (e.g. lr_bug@9=1e4x3: "
                             f"x1e4 for 3 steps), got {arg!r}")
        if kind == "lr_base" and arg is not None and not _is_number(arg):
            raise ValueError(f"--inject_fault {spec!r}: lr_base takes a numeric factor, got {arg!r}")
        if kind in ("hang", "kill", "kill_in_save", "kill_worker") and arg is not None:
            raise ValueError(f"--inject_fault {spec!r}: {kind} takes no =ARG; write {kind}@STEP[:RANK]")
        if kind == "oom_batch_above" and not (arg or "").isdigit():
            raise ValueError(f"--inject_fault {spec!r}: oom_batch_above needs the largest micro-batch that fits, "
                             f"e.g. oom_batch_above@5=2")
        if kind == "oom" and arg is not None:
            raise ValueError(f"--inject_fault {spec!r}: oom takes no =ARG; write oom@STEP[:RANK]")
        if kind == "oom_in_step" and arg not in (None, "before", "partway"):
            raise ValueError(f"--inject_fault {spec!r}: oom_in_step takes =before or =partway, got {arg!r}")
        if kind == "inf_module" and not arg:
            raise ValueError(f"--inject_fault {spec!r}: inf_module needs a module name, e.g. inf_module@5=blocks.0.attn")
        return cls(kind=kind, step=int(match["step"]), rank=None if match["rank"] is None else int(match["rank"]), arg=arg)

    def due(self, step: int, rank: int) -> bool:
        return not self.fired and step == self.step and (self.rank is None or self.rank == rank)


class FaultInjector:
    """Holds the faults of a run and applies them at the right step and rank."""

    def __init__(self, specs: list[str] | None, rank: int, restart_count: int = 0) -> None:
        self.faults = [Fault.parse(s) for s in (specs or [])]
        self.rank = rank
        self._ramp = 1.0  # per-step LR factor of an active lr_ramp
        self._lr_base: tuple[int, float] | None = None  # (step, factor) of a fired lr_base fault
        self._lr_base_written: list[float] | None = None  # the scheduler's base LRs as the fault last left them
        self._lr_bug: tuple[int, int, float] | None = None  # (first step, steps, factor) of a fired lr_bug
        self._slow = 1.0  # compute-time factor of an active slow fault
        self._fastest = float("inf")  # fastest compute seen, the base of the slow fault's pause
        self._worker_drill: WorkerKillDrill | None = None
        if restart_count > 0:  # the job was restarted: the drill has been done, do not repeat it forever
            for fault in self.faults:
                fault.fired = fault.kind != "slow"  # a slow device stays slow after a restart

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _take(self, kind: str, step: int) -> Fault | None:
        for fault in self.faults:
            if fault.kind == kind and fault.due(step, self.rank):
                fault.fired = True
                return fault
        return None

    def corrupt_batch(self, step: int, latents: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """Return latents with a data fault applied when due (a copy; the data set is untouched) and its kind."""
        if self._take("nan_batch", step):
            return torch.full_like(latents, float("nan")), "nan_batch"
        if self._take("inf_latent", step):
            latents = latents.clone()
            latents.view(-1)[0] = float("inf")
            return latents, "inf_latent"
        fault = self._take("big_latent", step)
        if fault is not None:
            latents = latents.clone()
            latents[0] *= float(fault.arg) if fault.arg else 1e4
            return latents, "big_latent"
        if self._take("const_batch", step):
            # latents are [B, C, T, H, W]: repeat the first latent frame over time
            return latents[:, :, :1].expand_as(latents).contiguous(), "const_batch"
        return latents, None

    def maybe_raise(self, step: int) -> None:
        """Raise the ``exception`` fault when due."""
        if self._take("exception", step):
            raise InjectedFault(f"injected fault: RuntimeError at step {step} on rank {self.rank}")

    def maybe_oom(self, step: int, samples: int) -> None:
        """Raise the ``oom`` fault when due, or ``oom_batch_above`` for a forward of more than its N samples."""
        if self._take("oom", step):
            raise torch.OutOfMemoryError(f"injected fault: out of memory at step {step} on rank {self.rank}")
        for fault in self.faults:
            if (fault.kind == "oom_batch_above" and step >= fault.step and fault.rank in (None, self.rank)
                    and samples > int(fault.arg)):  # a memory budget, like a slow device, stays
                raise torch.OutOfMemoryError(f"injected fault: out of memory: a forward of {samples} samples, over "
                                             f"the budget of {fault.arg} (step {step}, rank {self.rank})")

    def arm_optimizer_step(self, optimizer: object, step_of: Callable[[], int]) -> object | None:
        """The ``oom_in_step`` drill: a step pre-hook on ``optimizer`` (torch's, inside Accelerate's wrapper and
        DeepSpeed's ZeRO optimizer) that raises an OOM when due at ``step_of()``; ``=partway`` first updates the
        first half of each parameter group (a real partial step). Returns the hook's handle, or None when no such
        fault is planned."""
        if not any(f.kind == "oom_in_step" for f in self.faults):
            return None
        inner = optimizer
        while hasattr(inner, "optimizer"):
            inner = inner.optimizer

        def raise_in_step(opt: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
            step = step_of()
            fault = self._take("oom_in_step", step)
            if fault is None:
                return
            if fault.arg == "partway":  # the step's first half, for real (the fault has fired: no recursion)
                groups = [g["params"] for g in opt.param_groups]
                try:
                    for g in opt.param_groups:
                        g["params"] = g["params"][:max(1, len(g["params"]) // 2)]
                    opt.step()
                finally:
                    for g, params in zip(opt.param_groups, groups):
                        g["params"] = params
            raise torch.OutOfMemoryError(f"injected fault: out of memory inside optimizer.step() "
                                         f"({fault.arg or 'before'}; step {step}, rank {self.rank})")

        return inner.register_step_pre_hook(raise_in_step)

    def adjust_lr(self, step: int, optimizer: torch.optim.Optimizer, lr_scheduler: object | None) -> float | None:
        """Apply ``lr_spike`` (once), ``lr_ramp`` or ``lr_bug`` (every step while active); return the factor applied.

        The scheduler's base LRs are scaled too (:func:`vidstab.recovery.lr.scale_lrs`), so the change survives
        ``lr_scheduler.step()`` the way a wrong schedule would, until a rollback reloads the optimizer and
        scheduler state.
        """
        factor = 1.0
        spike = self._take("lr_spike", step)
        if spike is not None:
            factor *= float(spike.arg) if spike.arg else 1000.0
        ramp = self._take("lr_ramp", step)
        if ramp is not None:
            self._ramp = float(ramp.arg) if ramp.arg else 1.3
        factor *= self._ramp
        factor *= self._lr_base_factor(step, lr_scheduler)
        if factor != 1.0:
            # as_scheduled=False: like a bug writing the LR, the scheduler's last LR still says what it set.
            scale_lrs(optimizer, factor, lr_scheduler, as_scheduled=False)
            self._lr_base_written = _base_lrs(lr_scheduler) if self._lr_base is not None else None
        factor *= self._write_lr_bug(step, optimizer, lr_scheduler)
        return None if factor == 1.0 else factor

    def _lr_base_factor(self, step: int, lr_scheduler: object | None) -> float:
        """The ``lr_base`` factor to apply now: at its step, and again whenever the scheduler's base LRs are no
        longer what the fault last wrote (a reload by a rollback, a resume, or the guard's back-off)."""
        fault = self._take("lr_base", step)
        if fault is not None:
            self._lr_base = (fault.step, float(fault.arg) if fault.arg else 100.0)
            return self._lr_base[1]
        if self._lr_base is None or step < self._lr_base[0] or _base_lrs(lr_scheduler) == self._lr_base_written:
            return 1.0
        return self._lr_base[1]

    def _write_lr_bug(self, step: int, optimizer: torch.optim.Optimizer, lr_scheduler: object | None) -> float:
        """The ``lr_bug`` fault: while due, write the scheduled LR times its factor into ``optimizer``'s param
        groups (the scheduler untouched: its next step, or the guard's hold of a skipped one, puts the LR back);
        return the factor written (1.0: none)."""
        fault = self._take("lr_bug", step)
        if fault is not None:
            self._lr_bug = (step, *_lr_bug_arg(fault.arg or "1000"))
        if self._lr_bug is None or not self._lr_bug[0] <= step < self._lr_bug[0] + self._lr_bug[1]:
            return 1.0
        factor = self._lr_bug[2]
        scheduled = lr_scheduler.get_last_lr() if lr_scheduler is not None else [g["lr"] for g in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, scheduled):
            group["lr"] = lr * factor
        return factor

    def loss_factor(self, step: int) -> float:
        """The ``grad_spike`` fault: the factor to multiply this micro-batch's loss by (1.0 when not due)."""
        fault = self._take("grad_spike", step)
        return 1.0 if fault is None else float(fault.arg or 1000.0)

    def maybe_hang(self, step: int) -> None:
        """The ``hang`` fault: block this thread forever (only the watchdog or a signal ends the process)."""
        if self._take("hang", step):
            while True:
                time.sleep(3600)

    def maybe_kill(self, step: int) -> None:
        """The ``kill`` fault: SIGKILL this process, as a lost node or the out-of-memory killer would."""
        if self._take("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def worker_drill(self, dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
        """``dataset`` wrapped for this rank's ``kill_worker`` fault (as it is without one): the loader's workers
        get it, and the fault fires in one of them."""
        for fault in self.faults:
            if fault.kind == "kill_worker" and not fault.fired and fault.rank in (None, self.rank):
                fault.fired = True  # it fires in a worker; this process only tells the workers its step
                self._worker_drill = WorkerKillDrill(dataset, fault.step)
                return self._worker_drill
        return dataset

    def reached(self, step: int) -> None:
        """The rank is at ``step``: said to a ``kill_worker`` drill's workers (other processes)."""
        if self._worker_drill is not None:
            self._worker_drill.reached[0] = step

    def maybe_kill_in_save(self, step: int) -> None:
        """The ``kill_in_save`` fault (:attr:`vidstab.checkpoint.CheckpointManager.after_files_written`):
        SIGKILL this process in the middle of the checkpoint save of ``step``."""
        if self._take("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def slow_down(self, step: int, compute_s: float) -> float:
        """The ``slow`` fault: from its step on, sleep ``(FACTOR - 1) x`` the fastest ``compute_s`` seen; return the pause.

        The fastest, not this one: under DDP ``compute_s`` includes waiting for peers in the gradient all-reduce,
        and two slow ranks each sleeping a multiple of the other's sleep would slow down without bound.
        """
        self._fastest = min(self._fastest, max(compute_s, 0.0))
        fault = self._take("slow", step)
        if fault is not None:
            self._slow = float(fault.arg) if fault.arg else 3.0
        if self._slow == 1.0:
            return 0.0
        pause = (self._slow - 1.0) * self._fastest
        time.sleep(pause)
        return pause

    def on_rollback(self) -> None:
        """A rollback reloads the LR state; an ``lr_ramp`` (or ``lr_bug``) stops like a fixed schedule bug would."""
        self._ramp = 1.0
        self._lr_bug = None

    @contextmanager
    def module_fault(self, step: int, model: torch.nn.Module) -> Iterator[str | None]:
        """While due, make the named module's forward output +inf (a hook, removed on exit); a due
        ``flaky_activation`` corrupts one activation of the step's first forward pass only."""
        flaky = self._take("flaky_activation", step)
        fault = self._take("inf_module", step)
        handles = ([add_flaky_activation(model, flaky.arg)] if flaky is not None else []) + (
            [add_module_fault(model, fault.arg)] if fault is not None else [])
        try:
            yield fault.arg if fault is not None else (flaky.arg if flaky is not None else None)
        finally:
            for handle in handles:
                handle.remove()

    def model_spec(self, spec: dict) -> dict:
        """The model spec to record in incident bundles: wrapped so a replay rebuilds an ``inf_module`` fault."""
        names = [f.arg for f in self.faults if f.kind == "inf_module" and (f.rank is None or f.rank == self.rank)]
        if not names:
            return spec
        inner = {k: v for k, v in spec.items() if k in ("class", "config", "factory", "kwargs")}
        outer = {k: v for k, v in spec.items() if k not in inner}
        return {"factory": "vidstab.faults:model_with_module_fault", "kwargs": {"model": inner, "module": names[0]}, **outer}


class WorkerKillDrill(torch.utils.data.Dataset):
    """The ``kill_worker`` fault: ``dataset``, whose loader worker SIGKILLs itself as it loads a sample once the
    rank has reached ``step`` (in memory shared with the workers, which are other processes)."""

    def __init__(self, dataset: torch.utils.data.Dataset, step: int) -> None:
        self.dataset, self.step = dataset, step
        self.reached = torch.full((1,), -1, dtype=torch.long).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> object:
        if torch.utils.data.get_worker_info() is not None and int(self.reached[0]) >= self.step:
            time.sleep(3.0)  # the loop is back waiting in the loader's next() when the worker's SIGCHLD reaches it
            os.kill(os.getpid(), signal.SIGKILL)
        return self.dataset[index]

    def __getattr__(self, name: str) -> object:  # sample_id and the rest: the data set's own
        if name == "dataset":  # not set yet (unpickling in a worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _lr_bug_arg(arg: str) -> tuple[int, float] | None:
    """``FACTOR[xSTEPS]`` -> (steps, factor), or None when it is not that."""
    factor, _, steps = arg.partition("x")
    if not _is_number(factor) or not (steps or "1").isdigit() or int(steps or "1") < 1:
        return None
    return int(steps or "1"), float(factor)


def _base_lrs(lr_scheduler: object | None) -> list[float] | None:
    from .recovery.lr import torch_scheduler

    return list(getattr(torch_scheduler(lr_scheduler), "base_lrs", None) or []) or None


def validate_faults(specs: list[str] | None, world_size: int, max_steps: int, flag: str = "--inject_fault") -> None:
    """Refuse faults that can never fire in this run: a rank outside ``0..world_size-1``, a step ``>= max_steps``.

    Raises ``ValueError`` naming the flag and the spec (a drill that silently does nothing proves nothing).
    """
    for spec in specs or []:
        fault = Fault.parse(spec)
        if fault.rank is not None and not 0 <= fault.rank < world_size:
            raise ValueError(f"{flag} {spec!r}: rank {fault.rank} does not exist in a run of {world_size} process"
                             f"{'es' if world_size != 1 else ''} (ranks 0..{world_size - 1}); it would never fire")
        if fault.step >= max_steps:
            raise ValueError(f"{flag} {spec!r}: step {fault.step} is past the end of the run (steps 0..{max_steps - 1} "
                             f"with --max_train_steps {max_steps}); it would never fire")


def _make_inf(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
    return output * float("inf")


def add_module_fault(model: torch.nn.Module, name: str) -> torch.utils.hooks.RemovableHandle:
    """Make ``model.<name>``'s forward output +inf until the returned handle is removed."""
    modules = dict(model.named_modules())
    if name not in modules:
        raise ValueError(f"inf_module fault: no module named {name!r}; e.g. {list(modules)[1:6]}")
    return modules[name].register_forward_hook(_make_inf)


def add_flaky_activation(model: torch.nn.Module, name: str | None = None) -> torch.utils.hooks.RemovableHandle:
    """Make one element of ``model.<name>``'s next forward output NaN, once (the hook removes itself): a
    transient fault. ``name`` None: the first module that holds parameters of its own."""
    modules = dict(model.named_modules())
    if name is None:
        name = next(n for n, m in modules.items() if n and any(True for _ in m.parameters(recurse=False)))
    if name not in modules:
        raise ValueError(f"flaky_activation fault: no module named {name!r}; e.g. {list(modules)[1:6]}")
    handle = None

    def corrupt_once(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        handle.remove()
        out = output.clone()
        out.view(-1)[0] = float("nan")
        return out

    handle = modules[name].register_forward_hook(corrupt_once)
    return handle


def model_with_module_fault(model: dict, module: str) -> torch.nn.Module:
    """Replay factory: rebuild the model from its spec with the ``inf_module`` fault built in."""
    from .tools.replay import build_model

    rebuilt = build_model(model)
    add_module_fault(rebuilt, module)
    return rebuilt
