"""Rollback policy: reload the last good checkpoint, back off the learning rate, skip or replay data,
and give up (with the exact replay command) after a bounded number of retries.

The policy follows the seed's advice (roll back to the newest valid checkpoint, multiply the LR by 0.5
each time, after a few failures stop and reproduce the failing batch by hand) and PaLM's practice of
*not* replaying the data between the checkpoint and the failure by default: a batch that blew the run
up once tends to do it again.

The retry count and the cumulative LR multiplier are kept in ``OUTPUT_DIR/vidstab/recovery.json``
(written atomically by the main process), not in the checkpoint: loading the checkpoint must not reset
the count, and the count must survive a restart of the job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from .atomic import write_json_atomic
from .events import log_event
from .checkpoint import CheckpointError, CheckpointManager

__all__ = ["RecoveryConfig", "Recovery", "RunAborted"]

logger = logging.getLogger("vidstab.recovery")

STATE_FILE = os.path.join("vidstab", "recovery.json")


class RunAborted(RuntimeError):
    """Raised when the run keeps failing after ``max_retries`` rollbacks; the message says how to replay
    the failing batch."""


@dataclass
class RecoveryConfig:
    """How the run recovers from a rollback request."""

    max_retries: int = 3
    """Rollbacks allowed in one run (counted across restarts); the next request raises :class:`RunAborted`."""
    lr_backoff: float = 0.5
    """Factor applied to the LR multiplier at each rollback (cumulative: 0.5, 0.25, ...)."""
    skip_data: bool = True
    """PaLM-style: keep the data iterator where the failure happened, so the batches between the checkpoint
    and the failure are skipped. False: rewind the data to the checkpoint's position and replay them."""


class Recovery:
    """Performs rollbacks for the trainer; every rank must call :meth:`rollback` together.

    Args:
        accelerator: the run's ``Accelerator``.
        ckpt: the run's :class:`~vidstab.checkpoint.CheckpointManager` (with everything registered).
        guard: object with ``scale_lr(factor)``, ``lr_multiplier`` and ``reapply_lr_multiplier()``
            (the vidstab ``Guard``); None to leave the LR alone.
        config: :class:`RecoveryConfig`.
        run_dir: the output dir (holds ``vidstab/recovery.json`` and the event logs).
    """

    def __init__(self, accelerator, ckpt: CheckpointManager, guard: Any = None, config: RecoveryConfig | None = None,
                 run_dir: str | None = None) -> None:
        self.accelerator = accelerator
        self.ckpt = ckpt
        self.guard = guard
        self.config = config or RecoveryConfig()
        self.run_dir = os.path.abspath(run_dir or ckpt.output_dir)
        self.state: dict[str, Any] = {"retries": 0, "lr_multiplier": 1.0, "history": []}
        try:
            with open(os.path.join(self.run_dir, STATE_FILE), "rb") as fh:
                self.state.update(json.loads(fh.read()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            logger.warning("cannot read %s (%s); retry count starts at 0", STATE_FILE, e)

    @property
    def retries(self) -> int:
        """Rollbacks performed so far in this run (across restarts)."""
        return int(self.state["retries"])

    def rollback(self, reason: Any, step: int, incident: str | None = None) -> dict:
        """Roll every rank back to the last good checkpoint.

        Args:
            reason: why (a detector message, or a Finding; stored as text).
            step: the step at which the failure was detected.
            incident: incident bundle folder of the failure, for the replay command in :class:`RunAborted`.

        Returns:
            The loaded checkpoint's ``trainer_state`` plus ``"skip_data"`` (True: keep the data iterator
            where it is; False: rewind it to the checkpoint's data position, i.e. call the trainer's
            restore with this state), ``"rewind_data"`` (its negation), ``"_checkpoint"`` (which
            checkpoint was loaded) and ``"_recovery"`` (retries, lr_multiplier).

        Raises:
            RunAborted: after ``max_retries`` rollbacks, or when there is no good checkpoint to go back to.
        """
        reason_text = getattr(reason, "message", None) or str(reason)
        if self.retries >= self.config.max_retries:
            raise RunAborted(self._abort_message(
                f"still failing after {self.retries} rollback(s) (max_retries={self.config.max_retries}); "
                f"last failure at step {step}: {reason_text}", incident))
        m_before = float(getattr(self.guard, "lr_multiplier", self.state.get("lr_multiplier", 1.0)) or 1.0)
        # Every rank decides from the same files before any rank changes a pointer (load synchronises them).
        target = self._target(step)
        try:
            state = self.ckpt.load(target, resume_event=False)  # logged below as a rollback
        except CheckpointError as e:
            raise RunAborted(self._abort_message(f"rollback at step {step} impossible: {e}", incident)) from e
        if state is None:
            raise RunAborted(self._abort_message(
                f"rollback at step {step} impossible: no healthy checkpoint yet ({reason_text})", incident))
        target = m_before * self.config.lr_backoff
        if self.guard is not None and hasattr(self.guard, "scale_lr"):
            # The load restored the guard's multiplier as of the checkpoint; make the optimizer consistent
            # with it first, then scale to the cumulative back-off.
            if hasattr(self.guard, "reapply_lr_multiplier"):
                self.guard.reapply_lr_multiplier()
            m_loaded = float(getattr(self.guard, "lr_multiplier", 1.0) or 1.0)
            self.guard.scale_lr(target / m_loaded)
        # A restart before the next save should resume on this trajectory, not the abandoned one.
        self.ckpt.set_latest(state["_checkpoint"]["path"])
        if target != "last_good":  # the target that failed again is no rollback target any more
            self.ckpt.set_last_good(state["_checkpoint"]["path"])
        info = state["_checkpoint"]
        self.state["retries"] = self.retries + 1
        self.state["lr_multiplier"] = target
        self.state["history"].append({"time": time.time(), "step": int(step), "to_step": info["step"],
                                      "checkpoint": info["path"], "reason": reason_text, "incident": incident,
                                      "lr_multiplier": target})
        self._persist()
        log_event(self.run_dir, self.accelerator.process_index, "rollback", int(step), reason=reason_text,
                   checkpoint=info["path"], to_step=info["step"], retries=self.retries, lr_multiplier=target,
                   skip_data=self.config.skip_data, incident=incident)
        logger.warning("rollback %d/%d at step %d -> %s (step %d), LR x%.4g, %s data: %s", self.retries,
                       self.config.max_retries, step, info["path"], info["step"], target,
                       "skipping" if self.config.skip_data else "replaying", reason_text)
        out = dict(state)
        out["skip_data"] = self.config.skip_data
        out["rewind_data"] = not self.config.skip_data
        out["_recovery"] = {"retries": self.retries, "lr_multiplier": target}
        return out

    def _target(self, step: int) -> str:
        """``"last_good"``, unless the last rollback went there and the run failed again before getting past
        that failure: then the healthy checkpoint before it (a target that is already bad, e.g. saved inside a
        slow divergence, would otherwise be retried until ``max_retries``)."""
        history = self.state["history"]
        good = self.ckpt.last_good()
        if not history or good is None:
            return "last_good"
        last = history[-1]
        good_step = next((i.step for i in self.ckpt.list() if os.path.samefile(i.path, good)), None)
        if good_step != last["to_step"] or step > last["step"]:
            return "last_good"
        older = [i for i in self.ckpt.list() if i.healthy and i.step < good_step]
        if not older:
            return "last_good"
        logger.warning("step_%06d failed again before step %d: rolling back further, to %s", good_step, last["step"],
                       older[-1].name)
        return older[-1].path

    def _abort_message(self, what: str, incident: str | None) -> str:
        bundle = incident or os.path.join(self.run_dir, "vidstab", "incidents", "<incident bundle dir>")
        return (f"vidstab: run aborted: {what}. Reproduce the failing batch with:\n"
                f"  python scripts/replay.py {bundle}")

    def _persist(self) -> None:
        if not self.accelerator.is_main_process:
            return
        write_json_atomic(os.path.join(self.run_dir, STATE_FILE), self.state)
