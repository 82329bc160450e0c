"""What the training script itself checkpoints, for the attached form: its save/load-state hooks and its EMAs.

A diffusers script saves and loads its EMA (and any custom state) through ``accelerator.register_save_state_pre_hook``
/ ``register_load_state_pre_hook``; ``accelerator.save_state`` calls them with its folder. An in-place rollback
(``attach(..., rollback_every=N)``) must restore the same: :class:`ScriptState` calls the script's hooks (not
vidstab's own) beside each rollback checkpoint, with a folder of vidstab's (``vidstab/rollback-script-state/<the
checkpoint's folder name>``), and the load hooks with it at a rollback, as ``save_state``/``load_state`` would.

The EMAs vidstab can see (diffusers' ``EMAModel``, or anything with ``shadow_params`` and ``step``, registered with
``accelerator.register_for_checkpointing`` or held by the script's hooks) do not take a skipped step:
:func:`hold_emas` makes ``ema.step(...)`` a no-op right after an optimizer step vidstab skipped (the weights did not
change, and the EMA's own step count must not move either). At the end of the run :func:`nonfinite_state` names
non-finite weights or EMA, so that such a run does not end with exit code 0.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Iterable

import torch

logger = logging.getLogger(__name__)

SCRIPT_STATE_SUBDIR = os.path.join("vidstab", "rollback-script-state")
"""Where the script's own hooks write beside each rollback checkpoint, one folder per checkpoint folder name."""


def _hooks(accelerator: Any, kind: str, own: Iterable[Callable]) -> list[Callable]:
    """The hooks the script registered on ``accelerator`` (``kind``: ``save`` or ``load``), not vidstab's ``own``."""
    registered = getattr(accelerator, f"_{kind}_model_state_pre_hook", None) or {}
    own = list(own)
    return [h for h in registered.values() if not any(h == o for o in own)]


def is_ema(obj: Any) -> bool:
    """Whether ``obj`` looks like an EMA of weights (diffusers' ``EMAModel``: ``shadow_params`` and ``step``)."""
    return hasattr(obj, "shadow_params") and callable(getattr(obj, "step", None))


def _closure_objects(fn: Callable) -> list[Any]:
    """The objects a function's closure holds (a hook defined inside the script's ``main`` holds its EMA)."""
    cells = getattr(getattr(fn, "__func__", fn), "__closure__", None) or ()
    found = []
    for cell in cells:
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell: a variable not assigned yet
            continue
    return found


class ScriptState:
    """The script's save/load-state hooks, called beside vidstab's rollback checkpoints (module docstring).

    Args:
        accelerator: the run's ``Accelerator``.
        run_dir: the output folder.
        own_hooks: vidstab's own hooks on the accelerator (the guard's), left out.
    """

    def __init__(self, accelerator: Any, run_dir: str | os.PathLike, own_hooks: Iterable[Callable] = ()) -> None:
        self.accelerator = accelerator
        self.root = os.path.join(os.fspath(run_dir), SCRIPT_STATE_SUBDIR)
        self.own_hooks = list(own_hooks)

    def save_hooks(self) -> list[Callable]:
        return _hooks(self.accelerator, "save", self.own_hooks)

    def load_hooks(self) -> list[Callable]:
        return _hooks(self.accelerator, "load", self.own_hooks)

    def emas(self) -> list[Any]:
        """The EMAs vidstab can see: registered for checkpointing, or held by the script's hooks."""
        seen: list[Any] = []
        candidates = list(getattr(self.accelerator, "_custom_objects", []))
        for hook in self.save_hooks() + self.load_hooks():
            candidates += _closure_objects(hook)
        for obj in candidates:
            if is_ema(obj) and not any(obj is s for s in seen):
                seen.append(obj)
        return seen

    def unrestorable(self) -> str | None:
        """Why a rollback could not restore what the script's own checkpoints hold (None: it can)."""
        saves, loads = self.save_hooks(), self.load_hooks()
        if saves and not loads:
            return ("the script registers a save-state hook (accelerator.register_save_state_pre_hook) but no "
                    "load-state hook: what it saves (an EMA, custom state) cannot be restored by a rollback. Register "
                    "the matching accelerator.register_load_state_pre_hook, or the EMA with "
                    "accelerator.register_for_checkpointing(ema)")
        return None

    def folder(self, checkpoint_path: str) -> str:
        return os.path.join(self.root, os.path.basename(os.fspath(checkpoint_path).rstrip(os.sep)))

    def _models(self) -> list[Any]:
        """``accelerator._models`` as ``save_state``/``load_state`` hand them to the hooks."""
        return list(getattr(self.accelerator, "_models", []))

    def save(self, checkpoint_path: str, keep: Iterable[str] = ()) -> None:
        """Call the script's save hooks with this checkpoint's folder of script state (every rank, together: the
        hooks decide which rank writes, as under ``save_state``). ``keep``: the checkpoint folders still on disk;
        the script state of any other is deleted."""
        hooks = self.save_hooks()
        if not hooks:
            return
        acc = self.accelerator
        final = self.folder(checkpoint_path)
        tmp = os.path.join(self.root, f".tmp-{os.path.basename(final)}")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        acc.wait_for_everyone()
        distributed = str(getattr(acc, "distributed_type", "")).upper()
        plain = not any(k in distributed for k in ("DEEPSPEED", "FSDP", "MEGATRON"))
        weights = [acc.get_state_dict(m, unwrap=False) for m in self._models()] if plain else []
        for hook in hooks:
            hook(self._models(), weights, tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            wanted = {os.path.basename(os.fspath(k).rstrip(os.sep)) for k in keep} | {os.path.basename(final)}
            for name in os.listdir(self.root):
                if name not in wanted and not name.startswith(".tmp-"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        acc.wait_for_everyone()

    def load(self, checkpoint_path: str) -> None:
        """Call the script's load hooks with the script state saved beside this checkpoint (every rank)."""
        hooks = self.load_hooks()
        if not hooks:
            return
        folder = self.folder(checkpoint_path)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"the script's own state (its save-state hooks: the EMA, custom state) of "
                                    f"{checkpoint_path} is not in {folder}")
        distributed = str(getattr(self.accelerator, "distributed_type", "")).upper()
        models = self._models() if not any(k in distributed for k in ("DEEPSPEED", "FSDP", "MEGATRON")) else []
        for hook in hooks:
            hook(models, folder)


def hold_emas(guard: Any) -> list[Any]:
    """``ema.step(...)`` of every EMA vidstab can see (:meth:`ScriptState.emas`) does nothing right after an
    optimizer step the guard skipped: the weights did not change, and the EMA's own step count (its warm-up decay)
    must not move either. An in-place rollback's step counts as taken: the EMA then absorbs the weights the
    rollback restored. The instances are patched with the loop's patches (``guard.detach()`` undoes them).
    Returns the EMAs held."""
    emas = ScriptState(guard.accelerator, guard.run_dir, guard.own_state_hooks).emas()
    for ema in emas:
        guard.patches._patch(ema, "step", _held_step(guard, ema.step))
    return emas


def _held_step(guard: Any, original: Callable) -> Callable:
    def step(*args: Any, **kwargs: Any) -> Any:
        result = guard.last_result
        if result is not None and not result.micro and result.skipped and result.rollback is None:
            return None
        return original(*args, **kwargs)
    return step


@torch.no_grad()
def nonfinite_state(params: Iterable[torch.Tensor], emas: Iterable[Any]) -> list[str]:
    """What is non-finite on this rank: ``"weights"`` and/or ``"EMA"`` (local tensors: shards where sharded)."""
    found = []
    if not all(bool(torch.isfinite(p.detach()).all()) for p in params if p.numel()):
        found.append("weights")
    shadows = [t for ema in emas for t in (getattr(ema, "shadow_params", None) or []) if torch.is_tensor(t)]
    if not all(bool(torch.isfinite(t).all()) for t in shadows if t.numel()):
        found.append("EMA")
    return found
