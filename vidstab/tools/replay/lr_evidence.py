"""What learning rate the run should have had, to judge the one it recorded.

The most common fault behind a blow-up is an LR far beyond anything the schedule produces (a bug writing
``optimizer.param_groups[i]["lr"]``, a wrong unit, a scheduler misconfigured). One bad update is enough, and
a ``LambdaLR``-style scheduler writes the right LR back at its next step, so the bundle of the failure that
follows may record a normal LR. The evidence therefore comes from three places:

- the bundle's ``lr`` (the LR of the failing step);
- the run's event log: the ``lr`` of every step between the checkpoint and the incident (``metrics`` events
  of the bundle's rank; the latest pass over a step wins after a rollback);
- the checkpoint's own state: the scheduler's ``base_lrs`` and ``_last_lr`` (``scheduler.json``), the
  optimizer's ``lr``/``initial_lr`` (``optimizer.json``), vidstab's ``lr_multiplier`` (``vidstab.json``).

All of it is plain JSON (docs/ARCHITECTURE.md, "Checkpoints" and "Event log"); nothing is imported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...evidence.capture import json_float
from ...events import events_dir, iter_event_file
from ...files.limits import read_json_file

#: An LR more than this many times every LR the checkpoint's schedule and optimizer hold is an outlier.
LR_OUTLIER_FACTOR = 10.0


def _read_json(path: Path) -> Any:
    try:
        return read_json_file(path)
    except (OSError, ValueError):
        return None


def _positive(values: Any) -> list[float]:
    out = []
    for v in values if isinstance(values, list) else [values]:
        f = json_float(v)
        if f is not None and math.isfinite(f) and f > 0:
            out.append(f)
    return out


def checkpoint_lrs(ckpt_dir: Path | None) -> dict[str, float]:
    """The LRs a checkpoint folder records: ``schedule_base`` (the scheduler's ``base_lrs`` x vidstab's
    ``lr_multiplier``), ``schedule_last`` (its last LR), ``optimizer`` (param group 0's ``lr``) and
    ``optimizer_initial`` (its ``initial_lr``). Missing files or fields are left out."""
    if ckpt_dir is None:
        return {}
    out: dict[str, float] = {}
    guard = _read_json(ckpt_dir / "vidstab.json")
    mult = json_float(guard.get("lr_multiplier")) if isinstance(guard, dict) else None
    mult = mult if mult is not None and math.isfinite(mult) and mult > 0 else 1.0
    sched = _read_json(ckpt_dir / "scheduler.json")
    if isinstance(sched, dict):
        if base := _positive(sched.get("base_lrs")):
            out["schedule_base"] = base[0] * mult
        if last := _positive(sched.get("_last_lr")):
            out["schedule_last"] = last[0]
    opt = _read_json(ckpt_dir / "optimizer.json")
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        if lr := _positive(groups[0].get("lr")):
            out["optimizer"] = lr[0]
        if initial := _positive(groups[0].get("initial_lr")):
            out["optimizer_initial"] = initial[0]
    return out


def logged_lrs(run_dir: Path, rank: int, after_step: int | None, up_to_step: int) -> dict[int, float]:
    """``{step: lr}`` from the ``metrics`` events of ``rank`` for steps in ``(after_step, up_to_step]``."""
    path = events_dir(run_dir) / f"events-rank{rank}.jsonl"
    if not path.is_file():
        return {}
    low = after_step if after_step is not None else -1
    out: dict[int, float] = {}
    for rec in iter_event_file(path):
        step = rec.get("step")
        if rec.get("kind") != "metrics" or not isinstance(step, int) or not low < step <= up_to_step:
            continue
        lr = json_float(rec.get("lr"))
        if lr is not None:
            out[step] = lr  # a later pass over the step (after a rollback) replaces an earlier one
    return out


def lr_evidence(recorded: float | None, run_dir: Path, rank: int, step: int, ckpt_dir: Path | None,
                ckpt_step: int | None) -> dict:
    """The LR to test and the sane one to compare it with.

    Returns ``{"recorded", "checkpoint": {...}, "reference", "suspect", "suspect_step", "outlier", "factor",
    "sane"}``: ``suspect`` is the largest of the recorded LR and the LRs logged since the checkpoint (at
    ``suspect_step``), ``reference`` the largest LR the checkpoint records, ``outlier`` whether ``suspect``
    exceeds it ``LR_OUTLIER_FACTOR``-fold, and ``sane`` the LR of a normal update (the checkpoint's
    optimizer or schedule LR), or ``None`` without a checkpoint to read it from.
    """
    ckpt = checkpoint_lrs(ckpt_dir)
    logged = logged_lrs(run_dir, rank, ckpt_step, step)
    candidates = [(s, v) for s, v in logged.items() if math.isfinite(v)]
    if recorded is not None and math.isfinite(recorded):
        candidates.append((step, recorded))
    suspect_step, suspect = max(candidates, key=lambda c: c[1], default=(step, recorded))
    reference = max(ckpt.values(), default=None)
    outlier = bool(reference and suspect is not None and suspect > LR_OUTLIER_FACTOR * reference)
    sane = ckpt.get("optimizer") or ckpt.get("schedule_last") or reference
    return {"recorded": recorded, "checkpoint": ckpt, "logged_since_checkpoint": len(logged), "reference": reference,
            "suspect": suspect, "suspect_step": suspect_step, "outlier": outlier,
            "factor": (suspect / reference) if outlier else None, "sane": sane}
