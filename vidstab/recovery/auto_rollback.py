"""Automatic rollback for an unmodified training loop (``vidstab.attach(..., rollback_every=N)``).

vidstab keeps its own rollback checkpoints of the model, the optimizer and the guard, every ``N`` optimizer
steps, in ``OUTPUT_DIR/vidstab/rollback/step_N`` (``N`` the loop's step, the trajectory's in the manifest beside it:
:mod:`vidstab.step_numbering`). When the guard asks for a rollback, they are loaded *in place*,
inside the loop's own ``optimizer.step()``: the weights, the optimizer's moments and the detectors'
statistics go back to the last healthy checkpoint, while the loop's step counter, the LR scheduler's
position, the random number generators and the data keep going. The steps since that checkpoint are lost
and their data skipped (PaLM), so the loop needs no code of its own for it: its ``global_step``, epoch
loop, own ``checkpoint-N`` saving and ``--resume_from_checkpoint`` stay as they are.

The retry budget, the LR back-off and the abort with the replay command are :class:`vidstab.Recovery`'s. An
abort ends the script: the main process prints the one message (with the replay command), every rank exits
with :data:`ABORT_EXIT_CODE` (:class:`RunAbortedExit`, a :class:`~vidstab.RunAborted` that is also a
``SystemExit``: no traceback on any rank, and a loop that catches ``RunAborted`` still can).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ..checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from ..checkpoint.full_state import rng_state, set_rng_state
from ..run.checkpoint_interval import auto_interval
from .lr import torch_scheduler
from .oom import OptimizerStateDiverged
from .policy import Recovery, RecoveryConfig, RunAborted
from .script_state import ScriptState, nonfinite_state
from ..signals import is_dtensor, local_tensor

logger = logging.getLogger(__name__)

ABORT_EXIT_CODE = 3
"""The exit code of a run the automatic rollback gave up on (as the reference trainer's ``recipes/train.py``)."""


class RunAbortedExit(RunAborted, SystemExit):
    """The attached form's abort: ends the script with :data:`ABORT_EXIT_CODE` and no traceback (``SystemExit``);
    ``except vidstab.RunAborted`` still catches it. ``str()`` is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = ABORT_EXIT_CODE

ROLLBACK_SUBDIR = "vidstab/rollback"
"""Where the rollback checkpoints live, under the run folder (apart from ``checkpoint-N`` folders)."""


class AutoRollback:
    """Rollback checkpoints on their own interval and in-place rollbacks for the guard of an unmodified loop.

    Built by :func:`vidstab.attach` when ``rollback_every`` is given; the guard calls :meth:`after_step` once
    per optimizer step of the user's loop, after the step was applied or skipped.

    Args:
        guard: the attached :class:`~vidstab.Guard`.
        every: save a rollback checkpoint every this many optimizer steps (and on the first step of a launch);
            ``"auto"``: at the interval the run's goodput ledger calls for (:mod:`vidstab.run.checkpoint_interval`).
        recovery: the retry budget, LR back-off and what counts as one incident (:class:`~vidstab.RecoveryConfig`).
        keep: rollback checkpoints kept (the newest healthy one is kept apart from these).
        memory_budget_bytes: ``CheckpointConfig.rollback_memory_budget_bytes`` of the rollback checkpoints.
    """

    def __init__(self, guard: Any, every: int | str, recovery: RecoveryConfig | None = None, keep: int = 2,
                 memory_budget_bytes: int | None = None) -> None:
        acc = guard.accelerator
        self.interval = auto_interval(acc, guard.run_dir, guard_config=guard.config) if every == "auto" else None
        if self.interval is None and (isinstance(every, (bool, float, str)) or int(every) < 1):
            raise ValueError(f"rollback_every must be a number of optimizer steps >= 1 or \"auto\", not {every!r}")
        self.guard = guard
        self.every = every if self.interval is not None else int(every)
        config = CheckpointConfig(subdir=ROLLBACK_SUBDIR, keep=keep, rollback_memory_budget_bytes=memory_budget_bytes)
        self.ckpt = CheckpointManager(acc, str(guard.run_dir), config)
        # The scheduler, the loop's counters and the data are not rolled back: only what the step changed, and what
        # the script itself checkpoints (register_for_checkpointing objects; its save/load-state hooks: ScriptState).
        for name, obj in (("model", guard.model), ("optimizer", guard.optimizer), ("vidstab", guard)):
            self.ckpt.register(name, obj)
        for i, obj in enumerate(getattr(acc, "_custom_objects", [])):
            self.ckpt.register(f"custom_{i}", obj)
        self.script_state = ScriptState(acc, guard.run_dir, own_hooks=guard.own_state_hooks)
        why = self.script_state.unrestorable()
        if why is not None:
            self._say(f"vidstab: rollback_every={self.every}: {why}", "warn", guard.global_step, detector="rollback_every")
        caveat = guard.engine.save_state_caveat()
        if caveat is not None:
            self._say(f"vidstab: rollback_every={self.every}: {caveat} (vidstab's in-place rollbacks are unaffected; "
                      "a load_state of such a folder is refused)", "warn", guard.global_step,
                      detector="rollback_every")
        self.recovery = Recovery(acc, self.ckpt, guard, recovery or RecoveryConfig(), form="attached")
        self._saved_this_launch = False
        if guard.checkpoint_fn is None:  # incident bundles name the checkpoint their replay starts from
            guard.checkpoint_fn = self.ckpt.latest_path_str

    @property
    def steps_lost(self) -> int:
        """Optimizer steps the in-place rollbacks undid: the loop's count minus the trajectory's."""
        return self.guard.numbering.lost

    def after_step(self) -> None:
        """Roll back in place when the step asked for it, else keep the books and save on the interval."""
        guard = self.guard
        result = guard.last_result
        if result is None or result.micro:
            return
        step = guard.global_step  # the loop's count of optimizer steps, this one included
        # Recovery counts the trajectory's steps: after an in-place rollback the loop's count goes on, but the run must
        # get past the failure point again before the incident is over. The checkpoints carry both numbers.
        trajectory = self.guard.numbering.trajectory(step)
        if result.rollback is not None:
            self._roll_back(result, step, trajectory)
            return
        if not self._saved_this_launch:
            self.recovery.apply_carried_over()  # over the multiplier of the checkpoint the loop resumed from
        self.recovery.on_step(trajectory, skipped=bool(result.skipped))
        due = self.interval.due(trajectory) if self.interval is not None else trajectory % self.every == 0
        if due or not self._saved_this_launch:
            self._saved_this_launch = True
            try:
                path = self.ckpt.save(step, healthy=guard.healthy, trajectory_step=trajectory)
            except CheckpointError as e:  # every rank learns it together; the older rollback targets stay
                self._say(f"vidstab: {guard.numbering.label(result.step)}: the rollback checkpoint of "
                          f"{guard.numbering.label(step)} was not written ({e}); a rollback goes to an older one, the "
                          f"next interval tries again", "warn", result.step, detector="rollback_every", figures={},
                          bad_ranks=[])
                return
            self.script_state.save(path, keep=[i.path for i in self.ckpt.list()])
            if self.interval is not None:
                self.interval.saved(guard.events, step, trajectory)

    def _roll_back(self, result: Any, step: int, trajectory: int) -> None:
        """Load the last healthy rollback checkpoint into the model, optimizer and guard; everything else goes on."""
        guard, optimizer = self.guard, self.guard.optimizer
        scheduler = torch_scheduler(guard.lr_scheduler)
        lrs = [g["lr"] for g in optimizer.param_groups]  # the schedule's: the guard restored them at the skip
        bases = list(getattr(scheduler, "base_lrs", None) or [])
        rng = rng_state()
        # Loads in place, backs the LR off for a divergence, or raises RunAborted once the budget is spent.
        try:
            state = self.recovery.after_step(result, trajectory)
            if state is not None:  # the script's own hooks wrote files (its EMA): only they can restore them
                self.script_state.load(state["_checkpoint"]["path"])
        except RunAborted as e:  # its message states the steps as the script numbers them (guard.numbering)
            raise self._abort(str(e), step) from None
        except OSError as e:
            raise self._abort(f"vidstab: run aborted: the rollback after {self.guard.numbering.label(result.step)} "
                              f"could not be carried out: {e}", step) from None
        guard.global_step = step  # the loop's counter goes on: the lost steps are not taken again
        if state is not None:
            if guard.console is not None:  # the failing step as numbered before this rollback
                guard.console.rolled_back(result.step, state)
            self.guard.numbering.lost += trajectory - int(state["_checkpoint"]["trajectory_step"])
        set_rng_state(rng)
        # The optimizer's LRs came back from the checkpoint, at the schedule's position of then: the schedule
        # goes on from where it is now, on the base LRs the rollback restored (with its back-off).
        new_bases = list(getattr(scheduler, "base_lrs", None) or [])
        for i, group in enumerate(optimizer.param_groups):
            if i < len(lrs):
                factor = new_bases[i] / bases[i] if i < len(bases) and i < len(new_bases) and bases[i] else 1.0
                group["lr"] = lrs[i] * factor
        if scheduler is not None and hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]

    def _say(self, message: str, kind: str, step: int, main_only: bool = True, **fields: Any) -> None:
        """One line on the main process's console (``main_only``), and an event in this rank's log."""
        self.guard.events.log(kind, step, message=message, **fields)
        if self.guard.accelerator.is_main_process or not main_only:
            print(message, file=sys.stderr, flush=True)

    def _abort(self, message: str, step: int, reason: str = "aborted", main_only: bool = True) -> RunAbortedExit:
        """The end of a run recovery gave up on: the last rollback checkpoint finished, then :func:`abort_run`."""
        self._finish_writing()
        return abort_run(self.guard, message, step, reason, main_only)

    def _finish_writing(self) -> None:
        error = self.ckpt.join_writer()
        if error is not None:
            logger.warning("the last rollback checkpoint was not written: %s", error)

    def close(self) -> None:
        """Let this rank's writer finish the last rollback checkpoint (its exchange with the other ranks is a
        collective: a process that exits in the middle of one is aborted). No collective of its own: at the
        end of a script the main process may still be saving or validating. Non-finite weights or EMA on this
        rank end the run with :data:`ABORT_EXIT_CODE` instead of a finished run's exit code 0."""
        self._finish_writing()
        bad = nonfinite_at_end(self.guard, self.script_state.emas())
        if bad:
            raise self._abort(f"vidstab: the run ends with non-finite {' and '.join(bad)} on rank "
                              f"{self.guard.rank}: do not use what it exported; the last healthy rollback checkpoint "
                              f"is {self.ckpt.last_good()}", self.guard.global_step, reason="nonfinite_state",
                              main_only=False)


class RollbackNotKept:
    """The attached form without ``rollback_every``: a rollback verdict has no checkpoint to go back to and can
    only skip its step. That is the answer while steps still get through; the run stops with
    :data:`ABORT_EXIT_CODE` instead of skipping forever when ``max_requests`` rollbacks in a row are asked for with
    no applied step between them, and at :meth:`close` when the weights or an EMA vidstab can see are non-finite
    (never a NaN model exported with exit code 0). A rollback the script's own :class:`~vidstab.Recovery` makes
    (the guard's step count goes back) starts the count again.

    Built by :func:`vidstab.attach` without ``rollback_every``; the guard calls :meth:`after_step` once per judged
    step of the loop and :meth:`close` from :meth:`~vidstab.Guard.close`.
    """

    def __init__(self, guard: Any, emas: list[Any], max_requests: int = RecoveryConfig.max_retries) -> None:
        self.guard, self.emas, self.max_requests = guard, emas, max_requests
        self.requests: list[tuple[int, str]] = []
        """``(step, cause)`` of the rollbacks asked for since the last applied step."""

    def after_step(self, result: Any) -> None:
        """Count the step's rollback request, or start again after an applied step; stop when skipping has not
        helped. An optimizer that ran out of memory part-way (some weights or ranks updated) stops at once."""
        if result is None or result.micro:
            return
        if result.rollback is None:
            if result.applied:
                self.requests.clear()
            return
        label = self.guard.numbering.label
        diverged = next((f for f in result.findings if f.figures.get("optimizer_oom")), None)
        if diverged is not None:  # skipping is no answer: the ranks' states are no longer one step
            raise OptimizerStateDiverged(
                f"vidstab: {label(result.step)}: {diverged.message}, but this guard keeps no rollback checkpoints: "
                f"stopping here. Resume from your last checkpoint; attach(..., rollback_every=N) rolls back in place")
        if self.requests and result.step <= self.requests[-1][0]:  # the script's own Recovery rolled back
            self.requests.clear()
        self.requests.append((int(result.step), str(result.rollback)))
        if len(self.requests) >= self.max_requests:
            raise abort_run(
                self.guard, f"vidstab: run aborted at {label(result.step)}: {len(self.requests)} rollbacks asked for in "
                f"a row since {label(self.requests[0][0])}, with no step applied between them (the last: "
                f"{result.rollback}), and this guard keeps no rollback checkpoints, so each only skipped its step. "
                f"Resume from your last checkpoint; attach(..., rollback_every=N) rolls back in place",
                int(result.step), reason="rollback_not_kept")

    def close(self) -> None:
        """Non-finite weights or EMA on this rank end the run with :data:`ABORT_EXIT_CODE`, not exit code 0."""
        bad = nonfinite_at_end(self.guard, self.emas)
        if bad:
            raise abort_run(self.guard, f"vidstab: the run ends with non-finite {' and '.join(bad)} on rank "
                            f"{self.guard.rank}: do not use what it exported. Resume from your last checkpoint; "
                            f"attach(..., rollback_every=N) rolls back in place", self.guard.global_step,
                            reason="nonfinite_state", main_only=False)


def abort_run(guard: Any, message: str, step: int, reason: str, main_only: bool = True) -> RunAbortedExit:
    """The end of an attached run: ``stop`` logged with the exit code, the message printed once (main process;
    ``main_only=False``: by this rank, which alone knows), returned as the :class:`RunAbortedExit` to raise."""
    guard.events.log("stop", step, message=message, reason=reason, exit_code=ABORT_EXIT_CODE)
    if guard.accelerator.is_main_process or not main_only:
        print(message, file=sys.stderr, flush=True)
    guard.events.flush()
    return RunAbortedExit(message)


def nonfinite_at_end(guard: Any, emas: list[Any]) -> list[str]:
    """What is non-finite on this rank at the end of the run: ``"weights"`` and/or ``"EMA"``."""
    params = [local_tensor(p) if is_dtensor(p) else p for p in guard.control.probe.all_params]
    return nonfinite_state(params, emas)
