"""Rollback policy: reload the last good checkpoint, back off the learning rate when the cause calls for
it, skip or replay data, and give up (with the exact replay command) when one incident keeps failing.

The policy follows docs/PRACTICES.md A4/A4a (roll back to the newest valid checkpoint, lower the LR, after a few
failures stop and reproduce the failing batch by hand) and PaLM's practice of *not* replaying the data
between the checkpoint and the failure by default: a batch that blew the run up once tends to do it again.
It is built for runs that last weeks (docs/ARCHITECTURE.md, "Recovery"):

- **The retry budget belongs to one incident**: a failure that recurs before the run gets past the previous
  failure point (plus ``incident_window`` steps, 0 by default) belongs to the same incident; ``max_retries``
  rollbacks are allowed for it. Once the run has passed it, the next failure starts a new incident with a
  full budget.
- **The LR back-off depends on the cause**: a divergence (spikes, non-finite weights, a run of skipped
  steps) multiplies the LR by ``lr_backoff``; an exception (a CUDA error, a flaky node) or bad input data
  does not: lowering the LR does not fix a broken node or a broken sample. A ``transient`` failure (one the
  in-job rerun did not reproduce: :mod:`vidstab.recovery.rerun`) never lowers the LR and never spends the retry
  budget of the incident it falls into; only ``max_retries`` of them in a row at one failure point abort.
- **A backed-off LR returns to the schedule gradually**: after the incident is over, every
  ``lr_restore_every`` steps without a skip or a rollback the multiplier is divided by ``lr_backoff``
  until it is 1 again.
- Every change (rollback, incident over, LR restored, state carried over, reset) is an event in the log.

The state (open incident, LR multiplier, history) is kept in ``OUTPUT_DIR/vidstab/recovery.json``
(written atomically by the main process), not in the checkpoint: loading an older checkpoint must not
reset it, and it must survive a restart. On a restart what is carried over is said (warning + a
``recovery`` event with ``action="carried_over"``); ``Recovery(..., reset=True)`` (the trainer's
``--reset_recovery``) forgets it, and a changed run config starts the open incident's budget afresh.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..files.atomic import write_json_atomic
from ..checkpoint import CheckpointError, CheckpointManager
from ..checkpoint.manager import UNVERIFIED_ADVICE
from ..evidence.capture import incident_step, list_incidents
from ..events import log_event
from ..form_advice import recovery_setting
from ..files.limits import read_json_file
from ..run.resume_check import ResumeCheck
from ..step_numbering import numbering_of, step_label, trajectory_fields

__all__ = ["RecoveryConfig", "Recovery", "RunAborted", "rollback_cause"]

logger = logging.getLogger("vidstab.recovery.policy")

STATE_FILE = os.path.join("vidstab", "recovery.json")
STATE_SCHEMA = 2
CAUSES = ("divergence", "exception", "data", "transient")


class RunAborted(RuntimeError):
    """Raised when one incident keeps failing after ``max_retries`` rollbacks, or nothing healthy is left
    to roll back to; the message says how to replay the failing batch."""


@dataclass
class RecoveryConfig:
    """How the run recovers from a rollback request."""

    max_retries: int = 3
    """Rollbacks allowed for one incident (counted across restarts); the next request raises :class:`RunAborted`."""
    lr_backoff: float = 0.5
    """Factor applied to the LR multiplier at each rollback whose cause is in ``lr_backoff_causes``."""
    lr_backoff_causes: tuple[str, ...] = ("divergence",)
    """Causes (``divergence``, ``exception``, ``data``; see :func:`rollback_cause`) that lower the LR."""
    incident_window: int = 0
    """A failure before the run gets this many steps past the latest failure point of the open incident
    belongs to it (and spends its budget); once the run is further than this past it, the incident is over.
    0: over as soon as the run has got past the failure point (the same failure again is the same incident,
    a failure further on is a new one)."""
    lr_restore_every: int = 200
    """After the incident is over, divide the multiplier by ``lr_backoff`` (up to 1) every this many steps
    without a skip or rollback. 0 keeps a backed-off LR for the rest of the run."""
    skip_data: bool = True
    """PaLM-style: keep the data iterator where the failure happened, so the batches between the checkpoint
    and the failure are skipped. False: rewind the data to the checkpoint's position and replay them."""
    own_checkpoints: str | None = None
    """Regular expression of the training script's *own* checkpoint folders in the run folder, group 1 the
    step (diffusers' examples: ``r"checkpoint-(\\d+)"``). On a rollback the main process deletes those newer
    than the rollback target: they hold the abandoned trajectory, and the script's own
    ``--resume_from_checkpoint latest`` (newest ``checkpoint-N``) must never pick one. None: leave them."""
    reset: bool = False
    """Forget the state carried over in ``recovery.json`` from an earlier launch (open incident, LR multiplier) at
    the start of this one; the history is kept. The attached form's way to ``Recovery(..., reset=True)``:
    ``attach(..., recovery=RecoveryConfig(reset=True))``. Not part of the run's configuration."""

    def __post_init__(self) -> None:
        bad = [c for c in self.lr_backoff_causes if c not in CAUSES]
        if bad:
            raise ValueError(f"RecoveryConfig.lr_backoff_causes: unknown cause(s) {bad}; known: {CAUSES}")
        if not 0.0 < self.lr_backoff <= 1.0:
            raise ValueError(f"RecoveryConfig.lr_backoff must be in (0, 1], not {self.lr_backoff}")
        if "transient" in self.lr_backoff_causes:
            raise ValueError("RecoveryConfig.lr_backoff_causes: a transient (not reproducible) failure never lowers the LR")
        if self.max_retries < 0 or self.incident_window < 0 or self.lr_restore_every < 0:
            raise ValueError("RecoveryConfig.max_retries, incident_window and lr_restore_every must be >= 0")
        self.lr_backoff_causes = tuple(self.lr_backoff_causes)
        if self.own_checkpoints is not None and re.compile(self.own_checkpoints).groups < 1:
            raise ValueError("RecoveryConfig.own_checkpoints needs a group for the step, e.g. r'checkpoint-(\\d+)'")


def rollback_cause(reason: Any, findings: Any = (), rerun: Any = None) -> str:
    """The cause of a rollback request: ``"transient"`` (the in-job rerun of the step did not reproduce it),
    ``"exception"`` (the step raised, or ran out of memory inside the optimizer step), ``"data"`` (the step that escalated had non-finite *inputs*: bad
    samples, not a sick model) or ``"divergence"`` (anything else).

    ``reason`` is ``StepResult.rollback`` (``"detector: message"``) or a Finding; ``findings`` the step's
    findings (``StepResult.findings``), when known; ``rerun`` the step's rerun verdict
    (``StepResult.rerun``, :class:`vidstab.recovery.rerun.RerunVerdict` or its dict), when there was one.
    """
    verdict = rerun.get("verdict") if isinstance(rerun, dict) else getattr(rerun, "verdict", None)
    if verdict == "transient":
        return "transient"
    detector = getattr(reason, "detector", None) or str(reason).split(":", 1)[0].strip()
    if detector in ("exception", "oom"):  # an optimizer step cut short by an OOM: the state, not the LR, is at fault
        return "exception"
    for f in findings or ():
        if getattr(f, "detector", None) == "nonfinite" and (getattr(f, "figures", None) or {}).get("input_nonfinite", 0) > 0:
            return "data"
    return "divergence"


class Recovery:
    """Performs rollbacks for a training loop; every rank must call :meth:`rollback` / :meth:`after_step`
    together (with the same arguments: they are built from the guard's lockstep ``StepResult``).

    Args:
        accelerator: the run's ``Accelerator``.
        ckpt: the run's :class:`~vidstab.checkpoint.CheckpointManager` (with everything registered).
        guard: the vidstab ``Guard`` (any object with ``lr_multiplier`` and ``set_lr_multiplier(m)``), the owner
            of the LR multiplier recovery backs off and restores; None to leave the LR alone.
        config: :class:`RecoveryConfig`.
        run_dir: the output dir (holds ``vidstab/recovery.json`` and the event logs).
        reset: forget the state carried over from an earlier launch (open incident, LR multiplier);
            the history is kept. Said in the log.
        config_hash: fingerprint of the run's configuration (default: ``ckpt.config_hash``). When it
            differs from the one stored with the state, the open incident's retry budget starts afresh
            (the LR multiplier is kept), and that is said.
        form: the form the run is in, for the advice messages give: ``"explicit"`` (this class used directly),
            ``"attached"`` (``vidstab.attach(..., rollback_every=N)``) or ``"trainer"`` (``recipes/train.py``).
    """

    def __init__(self, accelerator, ckpt: CheckpointManager, guard: Any = None, config: RecoveryConfig | None = None,
                 run_dir: str | None = None, *, reset: bool = False, config_hash: str | None = None,
                 form: str = "explicit") -> None:
        self.accelerator = accelerator
        self.form = form
        recovery_setting(form)  # an unknown form fails here, not in a message
        self.numbering = numbering_of(guard)  # the steps messages and events state (vidstab.step_numbering)
        self.ckpt = ckpt
        self.guard = guard
        self.config = config or RecoveryConfig()
        reset = reset or self.config.reset
        self.run_dir = os.path.abspath(run_dir or ckpt.output_dir)
        self.rank = accelerator.process_index
        self.config_hash = config_hash if config_hash is not None else getattr(ckpt, "config_hash", None)
        self.state: dict[str, Any] = self._fresh_state()
        self.carried_over: str | None = None
        """What this launch inherited from ``recovery.json`` (one sentence), or None."""
        self._guard_unheld_said = False  # the guard's missing registration, said once (_say_guard_not_rolled_back)
        # The multiplier recovery.json recorded (1 after a reset): newer than any checkpoint's, so it replaces the
        # loaded checkpoint's once, at the resume (see apply_carried_over).
        self._carried_multiplier: float | None = None
        # The first and latest skipped step of the current run of skips (the script's numbering): skips fewer than the
        # guard's health_window steps apart belong together (what the health gate itself treats as one trouble).
        self._skips: tuple[int, int] | None = None
        # The first and latest step of the current run of skips in a row: the failure a rollback or an abort is
        # about (its bundles, its replay command), apart from earlier trouble the incident took in.
        self._run: tuple[int, int] | None = None
        # Does a resume (or a rewinding rollback) replay what the original run did? (vidstab/run/resume_check.py)
        self.resume_check = ResumeCheck(self.run_dir, self.rank, accelerator.num_processes,
                                        complete=(lambda: guard.detectors) if hasattr(guard, "detectors") else None)
        loaded = self._read_state()
        if loaded is not None:
            self._take_over(loaded, reset)

    # ------------------------------------------------------------------ state
    def _fresh_state(self) -> dict[str, Any]:
        return {"schema": STATE_SCHEMA, "incident": None, "stable_since": 0,
                "rollbacks_total": 0, "history": [], "config_hash": self.config_hash,
                "recovery_config": _config_dict(self.config)}

    def _read_state(self) -> dict | None:
        path = os.path.join(self.run_dir, STATE_FILE)
        try:
            return checked_recovery_state(read_json_file(path, STATE_FILE))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            kept = ""
            if self.accelerator.is_main_process:  # the next save replaces the file: a copy keeps what was read
                with contextlib.suppress(OSError):
                    shutil.copyfile(path, path + ".unreadable")
                    kept = f" (kept as {path}.unreadable)"
            logger.warning("cannot read %s (%s); recovery state starts fresh%s", path, e, kept)
            return None

    def _take_over(self, d: dict, reset: bool) -> None:
        history = list(d.get("history") or [])
        incident = d.get("incident")
        if d.get("schema", 1) < 2 and history:  # schema 1: one run-wide count; treat it as one open incident
            incident = {"first_step": history[0].get("step", 0), "last_failure": history[-1].get("step", 0),
                        "retries": int(d.get("retries", len(history))), "cause": "divergence"}
        multiplier = float(d.get("lr_multiplier", 1.0) or 1.0)
        self.state.update(history=history, rollbacks_total=int(d.get("rollbacks_total", len(history))),
                          stable_since=int(d.get("stable_since", 0)))
        if reset:
            self.state.update(incident=None)
            self._carry_over(1.0)
            self._announce("reset", "recovery state reset as asked (reset=True): LR multiplier back to 1, "
                                    "no open incident", old_multiplier=multiplier, old_incident=incident)
            self._persist()
            return
        self.state.update(incident=incident)
        self._carry_over(multiplier)
        if multiplier == 1.0 and not incident:
            return
        parts = []
        if multiplier != 1.0:
            parts.append(f"LR multiplier x{multiplier:.4g}")
        changed = (d.get("config_hash") not in (None, self.config_hash) and self.config_hash is not None) or (
            d.get("recovery_config") not in (None, _config_dict(self.config)))
        if incident:
            last = step_of_failure(incident)
            if changed:
                parts.append(f"the incident from step {last} with its retry budget started "
                             f"afresh because the run's configuration changed ({incident['retries']} of "
                             f"{self.config.max_retries} rollbacks had been used)")
                incident = dict(incident, retries=0)
                self.state["incident"] = incident
            else:
                parts.append(f"an open incident (last failure at step {last}, "
                             f"{incident['retries']} of {self.config.max_retries} rollbacks used)")
        self.carried_over = (f"carried over from {STATE_FILE}: " + "; ".join(parts) +
                             f". To start fresh: {recovery_setting(self.form, reset=True)}")
        self._announce("carried_over", self.carried_over, lr_multiplier=multiplier, incident=incident,
                       config_changed=bool(changed))
        if changed:
            self._persist()

    @property
    def retries(self) -> int:
        """Rollbacks spent on the open incident (0 when none is open)."""
        inc = self.state.get("incident")
        return int(inc["retries"]) if inc else 0

    @property
    def rollbacks_total(self) -> int:
        """Rollbacks over the run's whole life (across restarts)."""
        return int(self.state.get("rollbacks_total", 0))

    @property
    def lr_multiplier(self) -> float:
        """The guard's LR multiplier in effect (1.0: on schedule, or no guard)."""
        return float(getattr(self.guard, "lr_multiplier", 1.0) or 1.0)

    def _set_lr_multiplier(self, multiplier: float) -> None:
        if self.guard is not None and hasattr(self.guard, "set_lr_multiplier"):
            self.guard.set_lr_multiplier(multiplier)

    def _carry_over(self, multiplier: float) -> None:
        self._carried_multiplier = multiplier
        self._set_lr_multiplier(multiplier)

    def apply_carried_over(self) -> None:
        """After the loop loaded a checkpoint itself: the LR multiplier recovery.json carried over from the last
        launch (newer than the checkpoint's) replaces the checkpoint's, once. :meth:`resume` and
        :meth:`check_resume` call it; later calls do nothing."""
        if self._carried_multiplier is not None:
            self._set_lr_multiplier(self._carried_multiplier)
            self._carried_multiplier = None

    def reset(self) -> None:
        """Forget the open incident and bring the LR back to the schedule now (every rank together)."""
        old = self.lr_multiplier
        self.state.update(incident=None)
        self._carry_over(1.0)  # now, and over a checkpoint loaded afterwards
        self._announce("reset", "recovery state reset: LR multiplier back to 1, no open incident", old_multiplier=old)
        self._persist()

    # ------------------------------------------------------------------ the loop's calls
    def resume(self, which: str = "latest") -> dict | None:
        """``ckpt.load(which)``, then the multiplier carried over in recovery.json replaces the checkpoint's (which
        is as of its save). Returns what ``load`` returns (None on a fresh run)."""
        state = self.ckpt.load(which)
        self.apply_carried_over()
        if state is not None:
            self.check_resume(int(state["_checkpoint"]["step"]))
        return state

    def check_resume(self, step: int) -> None:
        """After a checkpoint of ``step`` was loaded (:meth:`resume` calls it; call it after a load the loop
        makes itself): compare the first replayed steps with the original run's (:mod:`vidstab.run.resume_check`);
        :meth:`on_step` does it once they are logged, and a difference is a ``warn`` event. The carried-over LR
        multiplier replaces the checkpoint's (:meth:`apply_carried_over`)."""
        self.apply_carried_over()
        self.resume_check.begin(step, what="resume")

    def after_step(self, result: Any, step: int | None = None) -> dict | None:
        """Call after every ``guard.step`` that was not a micro-step. Rolls back when the guard asks for it
        (returns :meth:`rollback`'s state: continue the loop from ``state["step"]``), else keeps the books
        (incident over, gradual LR return) and returns None.

        ``step``: the loop's step count after this step (default ``result.step + 1``, which is the
        diffusers ``global_step`` after its increment and the guard's ``global_step``).
        """
        if getattr(result, "micro", False):
            return None
        step = int(result.step) + 1 if step is None else int(step)
        if getattr(result, "rollback", None) is not None:
            incident = result.incident
            return self.rollback(result.rollback, step, incident=str(incident) if incident else None,
                                 cause=rollback_cause(result.rollback, getattr(result, "findings", ()),
                                                      getattr(result, "rerun", None)))
        self.on_step(step, skipped=bool(getattr(result, "skipped", False)))
        return None

    def on_step(self, step: int, skipped: bool = False) -> None:
        """Book-keeping of a step that was not rolled back: close the incident once the run is past it, and
        bring a backed-off LR back towards the schedule after a stable stretch (each change is an event)."""
        st = self.state
        self.resume_check.after_step(step)
        if skipped:
            st["stable_since"] = step
            skipped_step = self.numbering.script(step - 1)  # the skipped step as the script numbers it
            self._skips = self._count_skip(skipped_step)
            self._run = (self._run[0], skipped_step) if self._run and skipped_step - self._run[1] == 1 else (
                skipped_step, skipped_step)
        inc = st.get("incident")
        changed = False
        if inc and step > inc["last_failure"] + self.config.incident_window:
            st["incident"] = None
            st["stable_since"] = max(st["stable_since"], step)
            past = f" by {self.config.incident_window} steps" if self.config.incident_window else ""
            self._announce("incident_over", f"the run got past the failure at {self._failure_label(inc)}{past}: "
                           "the next failure is a new incident with a full retry budget", step=self.numbering.script(step),
                           trajectory_step=step, incident=inc)
            changed = True
        every = self.config.lr_restore_every
        if (st.get("incident") is None and every > 0 and self.lr_multiplier < 1.0
                and step - st["stable_since"] >= every and self.config.lr_backoff < 1.0):
            old = self.lr_multiplier
            new = min(1.0, old / self.config.lr_backoff)
            new = 1.0 if new > 0.999999 else new
            st["stable_since"] = step
            self._set_lr_multiplier(new)
            self._announce("lr_restore", f"{every} stable steps: LR multiplier x{old:.4g} -> x{new:.4g}",
                           step=self.numbering.script(step), trajectory_step=step, old_multiplier=old, lr_multiplier=new)
            changed = True
        if changed:
            self._persist()

    def rollback(self, reason: Any, step: int, incident: str | os.PathLike | None = None, cause: str | None = None) -> dict:
        """Roll every rank back to the last good checkpoint.

        Args:
            reason: why (a detector message, or a Finding; stored as text).
            step: the loop's step count after the failing step (``result.step + 1``, as in
                :meth:`after_step`); messages name the failing step itself, as the event log does.
            incident: incident bundle folder of the failure (str or Path), for the replay command in
                :class:`RunAborted` (only bundles that exist are named: see :meth:`incident_bundles`).
            cause: ``"divergence"``, ``"exception"``, ``"data"`` or ``"transient"`` (default:
                :func:`rollback_cause` of ``reason``); only causes in ``lr_backoff_causes`` lower the LR; a
                transient failure does not spend the incident's retry budget.

        Returns:
            The loaded checkpoint's ``trainer_state`` plus ``"skip_data"`` (True: keep the data iterator
            where it is; False: rewind it to the checkpoint's data position, i.e. call the trainer's
            restore with this state), ``"rewind_data"`` (its negation), ``"_checkpoint"`` (which
            checkpoint was loaded) and ``"_recovery"`` (retries, lr_multiplier, cause).

        Raises:
            RunAborted: after ``max_retries`` rollbacks for one incident, or when there is no good
                checkpoint to go back to.
        """
        reason_text = getattr(reason, "message", None) or str(reason)
        if getattr(reason, "detector", None):
            reason_text = f"{reason.detector}: {reason_text}"
        incident = os.fspath(incident) if incident is not None else None
        cause = cause or rollback_cause(reason)
        if cause not in CAUSES:
            raise ValueError(f"rollback cause must be one of {CAUSES}, not {cause!r}")
        step = int(step)
        failed = step - 1  # the failing step of the trajectory (what recovery counts to get past the failure)
        failed_step = self.numbering.script(failed)  # and as the script numbers it (messages, events, bundles)
        where = self.numbering.label(failed_step)
        skips, self._skips = self._skips, None
        run, self._run = self._run, None
        first = (min(skips[0], failed_step) if skips and failed_step - skips[1] <= self._skip_gap()
                 else failed_step)  # the skips before it
        run_first = run[0] if run and failed_step - run[1] == 1 else failed_step  # this failure's own skips
        open_incident = self.state.get("incident")
        if open_incident and step > open_incident["last_failure"] + self.config.incident_window:
            open_incident = None  # the loop never reported the steps in between (no after_step): over anyway
        budget = "transient" if cause == "transient" else "retries"
        if open_incident and open_incident.get(budget, 0) >= self.config.max_retries:
            spent = (f"{open_incident['retries']} rollback(s)" if budget == "retries" else
                     f"{open_incident['transient']} rollback(s) for failures the rerun did not reproduce")
            what = (f"still failing after {spent} for the incident that began at step "
                    f"{open_incident['first_step']} (max_retries={self.config.max_retries}); last failure at {where}, "
                    f"cause {cause}: {reason_text}")
            # The script's own `latest` must not resume the failing trajectory either: keep only what is not newer
            # than vidstab's last healthy checkpoint.
            good = self.ckpt.last_good()  # its step as the script numbered it, as the script's own checkpoints are
            good_step = next((i.step for i in self.ckpt.list() if good and os.path.samefile(i.path, good)), None)
            discarded = self._discard_own_checkpoints(good_step) if good_step is not None else []
            log_event(self.run_dir, self.rank, "recovery", failed_step + 1, action="abort", message=what, cause=cause,
                      last_good_step=good_step, discarded_own_checkpoints=discarded, incident=incident,
                      failed_step=failed_step, trajectory_step=step)
            if discarded:
                what += f"; removed the script's own {', '.join(discarded)} (newer than the last good step {good_step})"
            what += (f". To allow more rollbacks per incident: "
                     f"{recovery_setting(self.form, max_retries=self.config.max_retries + 1)}")
            raise RunAborted(self._abort_message(what, incident, min(open_incident["first_step"], first),
                                                 failed_step, run_first))
        # Every rank decides from the same files before any rank changes a pointer (load synchronises them).
        choice = self._target(step)
        old_multiplier = self.lr_multiplier  # in effect at the failure
        try:
            state = self.ckpt.load(choice, resume_event=False, from_memory=True)  # logged below as a rollback
        except CheckpointError as e:
            why = str(e).replace(UNVERIFIED_ADVICE, "").rstrip(".")  # a launch's way out, not a running loop's
            raise RunAborted(self._abort_message(f"rollback after the failure at {where} impossible: {why}",
                                                 incident, first, failed_step, run_first)) from e
        if state is None:
            raise RunAborted(self._abort_message(
                f"rollback after the failure at {where} impossible: no healthy checkpoint yet ({reason_text})",
                incident, first, failed_step, run_first))
        backoff = self.config.lr_backoff if cause in self.config.lr_backoff_causes else 1.0
        self._carried_multiplier = None
        self._set_lr_multiplier(old_multiplier * backoff)  # the load brought back the checkpoint's
        multiplier = self.lr_multiplier
        info = state["_checkpoint"]
        self._say_guard_not_rolled_back(info["step"])
        target = int(info.get("trajectory_step", info["step"]))  # the trajectory's step the run goes back to
        # A restart before the next save should resume on this trajectory, not the abandoned one.
        self.ckpt.set_latest(info["path"])
        if choice != "last_good":  # the target that failed again is no rollback target any more
            self.ckpt.set_last_good(info["path"])
        discarded = self._discard_own_checkpoints(int(info["step"]))
        if open_incident:
            open_incident = dict(open_incident, last_failure=max(open_incident["last_failure"], step),
                                 first_step=min(open_incident["first_step"], first), last_failed_step=failed_step)
            open_incident[budget] = open_incident.get(budget, 0) + 1
        else:
            # first_step, last_failed_step: the incident's first and latest failing (or skipped) step, as the script
            # numbers them; last_failure: the trajectory's count after the latest failing step (the point the run
            # must get past).
            open_incident = {"first_step": first, "last_failure": step, "last_failed_step": failed_step,
                             "retries": int(budget == "retries"), "transient": int(budget == "transient"),
                             "cause": cause}
        self.state.update(incident=open_incident, stable_since=target, rollbacks_total=self.rollbacks_total + 1)
        # Skipping the data, the batches differ on purpose: only the world size and the LR are compared.
        self.resume_check.begin(target, what="rollback", same_data=not self.config.skip_data,
                                lr_ratio=multiplier / old_multiplier, until=self.numbering.trajectory(first))
        # The history counts the trajectory's steps (step: after the failure, to_step: the target's), as recovery does.
        self.state["history"].append({"time": time.time(), "step": step, "to_step": target,
                                      "checkpoint": info["path"], "reason": reason_text, "incident": incident,
                                      "cause": cause, "lr_multiplier": multiplier})
        self._persist()
        # to_step: the checkpoint's step as the script numbered it (its folder's name), its trajectory's beside it.
        log_event(self.run_dir, self.rank, "rollback", failed_step + 1, reason=reason_text, checkpoint=info["path"],
                  to_step=info["step"], **trajectory_fields(info["step"], target, key="to_trajectory_step"),
                  retries=self.retries, max_retries=self.config.max_retries, cause=cause,
                  lr_multiplier=multiplier, old_lr_multiplier=old_multiplier, skip_data=self.config.skip_data,
                  incident=incident, rollbacks_total=self.rollbacks_total, discarded_own_checkpoints=discarded,
                  failed_step=failed_step, incident_first_step=open_incident["first_step"],
                  transient=open_incident.get("transient", 0), source=info.get("source"),
                  restore_seconds=info.get("seconds"), trajectory_step=step)
        if self.accelerator.is_main_process and self.form != "attached":  # one line per rollback, not one per rank
            logger.warning("rollback %d/%d of the incident that began at step %d; failure at %s -> %s (%s), cause %s, "
                           "LR x%.4g%s, %s data: %s", self.retries, self.config.max_retries,
                           open_incident["first_step"], where, info["path"], step_label(info["step"], target), cause,
                           multiplier, "" if backoff != 1.0 else " (not lowered for this cause)",
                           "skipping" if self.config.skip_data else "replaying", reason_text)
        out = dict(state)
        out["skip_data"] = self.config.skip_data
        out["rewind_data"] = not self.config.skip_data
        out["_recovery"] = {"retries": self.retries, "lr_multiplier": multiplier, "cause": cause}
        return out

    # ------------------------------------------------------------------ helpers
    def _say_guard_not_rolled_back(self, to_step: int) -> None:
        """Once per run, on the main process: a guard the checkpoints do not hold did not go back with the weights
        (its step count, which numbers the events, and its statistics go on from the abandoned trajectory)."""
        holds = getattr(self.ckpt, "holds", None)
        if self.guard is None or self._guard_unheld_said or not callable(holds) or holds(self.guard):
            return
        self._guard_unheld_said = True
        if self.accelerator.is_main_process:
            logger.warning("vidstab: the guard is not registered with the CheckpointManager: this rollback to step %d "
                           "restored the weights but not the guard, whose step count (the events' step) and "
                           "statistics go on from the abandoned trajectory. Register it before the first save: "
                           "ckpt.register(\"vidstab\", guard)", int(to_step))

    def _target(self, step: int) -> str:
        """``"last_good"``, unless the last rollback went there and the run failed again before getting past
        that failure: then the healthy checkpoint before it (a target that is already bad, e.g. saved inside a
        slow divergence, would otherwise be retried until ``max_retries``)."""
        history = self.state["history"]
        good = self.ckpt.last_good()
        if not history or good is None:
            return "last_good"
        last = history[-1]  # in the trajectory's steps, as the checkpoints' trajectory_step
        good_info = next((i for i in self.ckpt.list() if os.path.samefile(i.path, good)), None)
        if good_info is None or good_info.trajectory_step != last["to_step"] or step > last["step"]:
            return "last_good"
        older = sorted((i for i in self.ckpt.list() if i.healthy and i.trajectory_step < good_info.trajectory_step),
                       key=lambda i: (i.trajectory_step, i.step))
        if not older:
            return "last_good"
        if self.accelerator.is_main_process:
            logger.warning("%s failed again before the run got past the failure it was rolled back for: "
                           "rolling back further, to %s", good_info.name, older[-1].name)
        return older[-1].path

    def _discard_own_checkpoints(self, target_step: int) -> list[str]:
        """Delete the script's own checkpoints newer than ``target_step`` (main process; see
        ``RecoveryConfig.own_checkpoints``). Returns their names (the same list on every rank)."""
        if not self.config.own_checkpoints:
            return []
        pattern = re.compile(self.config.own_checkpoints)
        try:
            names = sorted(os.listdir(self.run_dir))
        except OSError:
            return []
        newer = [n for n in names if (m := pattern.fullmatch(n)) and int(m.group(1)) > target_step]
        if self.accelerator.is_main_process:
            for n in newer:
                # Rename first: a kill mid-delete must not leave a half-deleted folder under a checkpoint name.
                trash = os.path.join(self.run_dir, f".vidstab-abandoned-{n}-{secrets.token_hex(4)}")
                try:
                    os.rename(os.path.join(self.run_dir, n), trash)
                except OSError as e:
                    logger.warning("could not remove %s of the abandoned trajectory: %s", n, e)
                    continue
                shutil.rmtree(trash, ignore_errors=True)
            if newer:
                logger.warning("rollback to step %d: removed the script's own %s (abandoned trajectory)",
                               target_step, ", ".join(newer))
        wait = getattr(self.accelerator, "wait_for_everyone", None)
        if callable(wait):
            wait()  # no rank goes on (and saves a checkpoint-N) before they are gone
        return newer

    def _skip_gap(self) -> int:
        return int(getattr(getattr(self.guard, "config", None), "health_window", 0) or 0)

    def _count_skip(self, skipped: int) -> tuple[int, int]:
        """The run of skips with ``skipped`` added: a new run when the last skip is more than the gap behind."""
        if self._skips is None or skipped - self._skips[1] > self._skip_gap():
            return skipped, skipped
        return self._skips[0], skipped

    def _announce(self, action: str, message: str, step: int | None = None, **fields: Any) -> None:
        if self.accelerator.is_main_process:
            logger.warning("vidstab recovery: %s", message)
        if step is None:
            step = int(getattr(self.guard, "step_count", 0) or 0)
        log_event(self.run_dir, self.rank, "recovery", step, action=action, message=message, **fields)

    def _failure_label(self, incident: dict) -> str:
        """The incident's latest failing step, as the script numbers it (with the trajectory's where they differ)."""
        step = step_of_failure(incident)
        return self.numbering.label(step, incident["last_failure"] - 1)

    def incident_bundles(self, first_step: int, last_step: int, incident: str | None = None) -> list[str]:
        """The incident bundles on disk whose step lies in ``[first_step, last_step]`` (the script's numbering),
        ``incident`` (this rank's bundle of the failure) first when it exists."""
        found = [str(p) for p in list_incidents(self.run_dir)
                 if (s := incident_step(p)) is not None and first_step <= s <= last_step]
        if incident is not None and os.path.isdir(incident):
            found = [incident] + [p for p in found if not os.path.samefile(p, incident)]
        return found

    def _abort_message(self, what: str, incident: str | None, first_step: int, last_step: int, run_first: int) -> str:
        """The abort's message: ``what``, then the replay command of the failure itself (its run of skips
        ``run_first``-``last_step``), never of earlier trouble the incident took in (``first_step`` on)."""
        bundles = self.incident_bundles(run_first, last_step, incident)
        earlier = self.incident_bundles(first_step, run_first - 1) if first_step < run_first else []
        if bundles:
            more = len(bundles) - 1 + len(earlier)
            more_text = f" (and {more} more bundle(s) of this incident: vidstab incidents {self.run_dir})" if more else ""
            how = f"Reproduce the failing batch with:\n  vidstab replay {bundles[0]}{more_text}"
        else:
            span = f"step {last_step}" if run_first == last_step else f"steps {run_first}-{last_step}"
            also = (f" ({len(earlier)} bundle(s) of earlier steps of this incident, not of this failure: vidstab "
                    f"incidents {self.run_dir})" if earlier else "")
            how = (f"No incident bundle was written for {span} (the findings that skipped them capture none: a "
                   f"learning rate or a divergence is not in one batch){also}. The evidence is in the event log:\n"
                   f"  vidstab events {self.run_dir} --kind skip --kind rollback --kind recovery")
        return f"vidstab: run aborted: {what}. {how}\nWhat to do next: docs/runbook.md, 'The run stopped'."

    def _persist(self) -> None:
        if not self.accelerator.is_main_process:
            return
        self.state["config_hash"] = self.config_hash
        self.state["recovery_config"] = _config_dict(self.config)
        # The owner's value as of this decision: a relaunch before the next checkpoint keeps the back-off.
        write_json_atomic(os.path.join(self.run_dir, STATE_FILE), dict(self.state, lr_multiplier=self.lr_multiplier))


def checked_recovery_state(d: Any) -> dict:
    """``recovery.json`` as read, every field the recovery takes over checked: a ``ValueError`` naming the first field
    that is not what :class:`Recovery` writes (the caller starts fresh, saying why)."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")

    def integer(field: str, value: Any, low: int = 0) -> None:
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= 2**53):
            raise ValueError(f"{field!r} is {str(value)[:60]!r}; expected an integer >= {low}")

    for field in ("schema", "rollbacks_total", "stable_since", "retries"):
        if field in d:
            integer(field, d[field])
    multiplier = d.get("lr_multiplier", 1.0)
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not math.isfinite(multiplier) \
            or multiplier <= 0:
        raise ValueError(f"'lr_multiplier' is {str(multiplier)[:60]!r}; expected a finite number > 0")
    history = d.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise ValueError(f"'history' is {str(history)[:60]!r}; expected a list of rollbacks (objects)")
    for h in history:
        integer("history.step", h.get("step", 0))
        integer("history.to_step", h.get("to_step", 0))
    incident = d.get("incident")
    if incident is not None:
        if not isinstance(incident, dict):
            raise ValueError(f"'incident' is {str(incident)[:60]!r}; expected an object or null")
        for field in ("first_step", "last_failure", "retries"):
            integer(f"incident.{field}", incident.get(field))
        integer("incident.transient", incident.get("transient", 0))
        integer("incident.last_failed_step", incident.get("last_failed_step", -1), low=-1)
    return d


def step_of_failure(incident: dict) -> int:
    """The incident's latest failing step as the script numbers it (a state written before it was kept: the
    trajectory's, which the explicit form's and the trainer's are)."""
    return int(incident.get("last_failed_step", incident["last_failure"] - 1))


def _config_dict(config: RecoveryConfig) -> dict:
    d = asdict(config)
    d.pop("reset", None)  # what this launch does with the carried-over state, not how the run recovers
    d["lr_backoff_causes"] = list(config.lr_backoff_causes)
    return d
