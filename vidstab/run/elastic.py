"""In-job restart awareness: is this process a torch-elastic restart, and why did the previous attempt end?

``accelerate launch --max_restarts N`` and ``torchrun --max_restarts N`` run the script under torch elastic's
agent, which restarts every worker of the group when any worker exits non-zero (a SIGKILLed rank, a rank
the :mod:`vidstab.run.watchdog` ended, an uncaught exception) -- up to N times. The agent tells each new worker
which attempt it is in its environment (``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
``TORCHELASTIC_RUN_ID``; see the torchrun documentation, "Environment Variables"). vidstab writes no
supervisor of its own: it reads that, resumes from the latest valid checkpoint without being told
(``recipes/train.py``), and reconstructs the cause of the restart from the previous attempt's last words in
the per-rank event logs (a ``hang`` event from the watchdog, a ``crash`` event from the trainer, or nothing
at all: the rank was killed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..events import events_dir, iter_event_file
from .watchdog import PHASES

__all__ = ["LaunchInfo", "previous_attempt", "shared_store_warning"]

PROCESS_START = time.time()
"""When this process imported vidstab.run.elastic: events written before it belong to an earlier attempt."""

DEFAULT_RUN_ID = "none"
"""torchrun's default ``--rdzv_id``, which ``accelerate launch`` keeps: every job launched without one shares it."""
LAUNCH_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PET_STANDALONE=1"
"""The environment of the documented launch (docs/faults.md): a fresh store per round, and this job's own rendezvous."""

# Events that end an attempt, in the order of precedence used to name the cause.
LAST_WORDS = ("hang", "crash", "stop")


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher says about this process."""

    restart_count: int = 0
    """Worker-group restarts so far (0 on the first attempt)."""
    max_restarts: int = 0
    """Restarts the launcher allows (``--max_restarts``)."""
    run_id: str | None = None
    """The elastic run id (``--rdzv_id``), when under torch elastic."""
    elastic: bool = False
    """True when the process was started by a torch-elastic agent."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "LaunchInfo":
        """Read ``TORCHELASTIC_*`` from the environment (``os.environ`` by default); a bad value is a clear error."""
        env = os.environ if environ is None else environ

        def count(name: str) -> int:
            raw = env.get(name, "0")
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
            if value < 0:
                raise ValueError(f"environment variable {name}={raw!r} must be >= 0")
            return value

        elastic = "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env
        return cls(restart_count=count("TORCHELASTIC_RESTART_COUNT"), max_restarts=count("TORCHELASTIC_MAX_RESTARTS"),
                   run_id=env.get("TORCHELASTIC_RUN_ID"), elastic=elastic)

    @property
    def is_restart(self) -> bool:
        """True in every attempt after the first."""
        return self.restart_count > 0


class LaunchMismatch(RuntimeError):
    """The launcher started more processes than the ``Accelerator`` joined (each would train alone)."""


def check_world_size(num_processes: int, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`LaunchMismatch` when the launcher's ``WORLD_SIZE`` is larger than ``num_processes``.

    Measured here: ``torchrun --nproc_per_node 2`` on a machine without a GPU and without
    ``ACCELERATE_USE_CPU=1`` gives each process an ``Accelerator`` of ONE process, so two independent runs
    train the same model into the same folder (vidstab's folder lock then refused the second with "in use by
    another trainer", which names the symptom, not the launch). This names the launch."""
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE")
    try:
        launched = int(raw) if raw is not None else 0
    except ValueError:
        raise LaunchMismatch(f"environment variable WORLD_SIZE={raw!r} is not an integer") from None
    if launched > num_processes:
        raise LaunchMismatch(
            f"the launcher started WORLD_SIZE={launched} processes, but the Accelerator of this one runs "
            f"{num_processes}: each process would train alone, into the same output folder. Without GPUs, "
            f"Accelerate joins CPU processes only with ACCELERATE_USE_CPU=1 (ACCELERATE_USE_CPU=1 torchrun "
            f"--nproc_per_node {launched} ..., or ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            f"--num_processes {launched} ...); with GPUs, check that every process sees one.")


def _last_attempt_events(path: Path, before: float) -> list[dict]:
    """The events of the last attempt written before ``before`` (from its last ``start`` event on)."""
    rows: list[dict] = []
    for rec in iter_event_file(path):
        t = rec.get("time")
        if isinstance(t, (int, float)) and t >= before:
            break
        if rec.get("kind") == "start":
            rows = []
        rows.append(rec)
    return rows


def previous_attempt(run_dir: str | Path, before: float | None = None) -> dict:
    """Why the previous attempt of the run in ``run_dir`` ended, from each rank's event log.

    Returns ``{"cause": ..., "ranks": {rank: {...}}}`` where ``cause`` is ``hang`` (the watchdog ended a rank),
    ``killed`` (a rank left no last words: SIGKILL, out-of-memory killer, a lost node), ``exception`` (a rank
    logged a ``crash``), ``stopped`` (every rank stopped on its own, e.g. after SIGTERM) or ``unknown`` (no
    event log). A ``hang`` anywhere names the cause, since its peers fail after it in their collectives; else
    a silent rank does, for the same reason. ``ranks`` holds each rank's last step and last words.
    """
    before = PROCESS_START if before is None else before
    ranks: dict[int, dict] = {}
    for path in sorted(events_dir(run_dir).glob("events-rank*.jsonl")):
        try:
            rank = int(path.stem.removeprefix("events-rank"))
        except ValueError:
            continue
        rows = _last_attempt_events(path, before)
        if not rows:
            continue
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        words = next((r for r in reversed(rows) if r.get("kind") in LAST_WORDS), None)
        info: dict = {"last_step": max(steps) if steps else None, "last_words": words["kind"] if words else None,
                      "last_time": rows[-1].get("time") if words is None else words.get("time")}
        if words is not None:
            info.update({k: words[k] for k in ("phase", "error", "reason", "exit_code") if k in words})
        ranks[rank] = info
    if not ranks:
        return {"cause": "unknown", "ranks": {}}
    said = [info["last_words"] for info in ranks.values()]
    if "hang" in said:
        cause = "hang"
    elif None in said:
        cause = "killed"
    elif "crash" in said:
        cause = "exception"
    else:
        cause = "stopped"
    words = {"hang": "hang", "killed": None, "exception": "crash", "stopped": "stop"}[cause]
    named = [r for r, info in ranks.items() if info["last_words"] == words]
    if cause == "hang":
        named = _least_progress(named, ranks)
    # Earliest first: a hung rank stops beating before the peers that then wait for it in a collective.
    culprits = sorted(named,
                      key=lambda r: (ranks[r]["last_time"] if isinstance(ranks[r]["last_time"], (int, float)) else 0.0, r))
    return {"cause": cause, "culprit_ranks": culprits, "ranks": ranks}


def _least_progress(hung: list[int], ranks: dict[int, dict]) -> list[int]:
    """Of the ranks the watchdog ended, those that got least far (step, then phase of the step): ranks run
    their collectives in lockstep, so a rank further along was waiting for one behind it, not hung itself.
    Ranks at the same point (or in phases that cannot be ordered) are all named."""
    order = {p: i for i, p in enumerate(PHASES)}
    phases_known = all(ranks[r].get("phase") in order for r in hung)

    def progress(r: int) -> tuple:
        step = ranks[r]["last_step"] if isinstance(ranks[r]["last_step"], int) else -1
        return (step, order[ranks[r]["phase"]]) if phases_known else (step,)

    least = min((progress(r) for r in hung), default=None)
    return [r for r in hung if progress(r) == least]


def shared_store_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """A warning when restarts may fail to re-form the process group, or may be lost to another job, else None.

    Under torch elastic's static rendezvous (``--master_port``, the default of ``accelerate launch``) or a
    shared c10d store, a restarted worker can read a peer address left in the store by the previous attempt
    and fail with ``Connection refused`` (pytorch/pytorch#135712). Measured here (torch 2.13, gloo, 2 processes,
    both ranks exiting at once as after a hang): 7 of 13 restarts failed under static rendezvous or a shared
    c10d store, 0 of 5 with a fresh store per round: ``--rdzv_backend c10d`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

    On one machine, ``accelerate launch --rdzv_backend c10d`` passes its port as ``--master_port``, which torch
    ignores for c10d: every such job meets at torch's default endpoint (``localhost:29400``) under the default
    id ``none`` (the agent tells its workers ``TORCHELASTIC_RUN_ID=none``). Two jobs at once then share one
    rendezvous: a restarting job can lose its round to the other, wait, and end with torch's
    ``AttributeError: 'NoneType' object has no attribute 'is_failed'`` when the other job's launcher closes the
    rendezvous on exit. ``PET_STANDALONE=1`` (torchrun's ``--standalone``) gives each job its own store and id.
    """
    env = os.environ if environ is None else environ
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return ("restarts are enabled but workers share the launcher's store, so a restarted group may read the previous "
                "attempt's addresses (pytorch/pytorch#135712); launch with --rdzv_backend c10d and "
                f"{LAUNCH_ENV} (docs/faults.md: 'Launching a run that survives faults')")
    if env.get("TORCHELASTIC_RUN_ID") == DEFAULT_RUN_ID and env.get("GROUP_WORLD_SIZE", "1") == "1":
        return ("restarts are enabled but this job's rendezvous is torch's machine-wide default (localhost:29400, id "
                f"'{DEFAULT_RUN_ID}'): another job launched the same way on this machine joins it, and a restart can then "
                "be lost to that job (torch ends this launcher with \"'NoneType' object has no attribute 'is_failed'\"); "
                f"launch with {LAUNCH_ENV} (docs/faults.md: 'Launching a run that survives faults'). A job ended that way "
                "resumes when launched again with --resume_from_checkpoint latest")
    return None
