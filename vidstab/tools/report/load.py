"""Reading a run folder for the dashboard: per-rank event logs as columns, incident bundles, notes.

Reading is tolerant: unparseable lines (a process killed mid-write leaves a torn last line) are skipped and
listed under "Notes". The step counter going back (a rollback or resume) starts a new *attempt*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...events import iter_event_file
from ...files.limits import read_json_file
from ...files.strict_json import json_float


# An events-rank{R}.jsonl file is named by its rank.
_RANK_PREFIX = "events-rank"


@dataclass


class RankMetrics:
    """The ``metrics`` events of one rank as columns (file order), ``nan`` where a value is missing."""

    steps: np.ndarray
    """Step of each record."""
    attempts: np.ndarray
    """0 for the first pass over a step, +1 after every rollback/resume that rewound the step counter."""
    columns: dict[str, np.ndarray]
    """Field -> float values (``nan`` when absent, null or non-finite: the plots leave a gap)."""
    nonfinite: dict[str, np.ndarray]
    """Field -> True where the logged value is a non-finite number: ``"nan"``/``"inf"``/``"-inf"``
    (:mod:`vidstab.files.strict_json`), or ``null`` -- how logs written before that convention spelled it."""
    loss_by_t: np.ndarray
    """``[records, buckets]`` bucket losses (``nan`` for an empty bucket or a record without them)."""


@dataclass


class RunLog:
    """Everything the report reads from a run folder."""

    run_dir: Path
    """The run folder."""
    metrics: dict[int, RankMetrics] = field(default_factory=dict)
    """Rank -> its metrics."""
    events: list[dict] = field(default_factory=list)
    """Every non-metrics event of every rank, with ``_attempt`` added, in (step, time) order."""
    incidents: list[dict] = field(default_factory=list)
    """Parsed ``incident.json`` files, each with ``_folder`` (path relative to the run folder)."""
    notes: list[str] = field(default_factory=list)
    """Problems met while reading (torn lines, unreadable incident files)."""

_NUMERIC = frozenset((int, float, bool))


def _num(x: Any) -> float:
    """A logged value as a float; ``nan`` for null, missing, non-finite or non-numeric (JSON gives exact
    types only)."""
    return float(x) if type(x) in _NUMERIC else math.nan


def _is_nonfinite(x: Any) -> bool:
    """A logged value that stands for a non-finite number (see :attr:`RankMetrics.nonfinite`)."""
    if x is None:
        return True
    f = json_float(x) if isinstance(x, str) else None
    return f is not None and not math.isfinite(f)


def load_run(run_dir: str | Path) -> RunLog:
    """Read the event logs of every rank and the incident bundles of a run folder."""
    run_dir = Path(run_dir)
    log = RunLog(run_dir=run_dir)
    files = sorted((run_dir / "vidstab").glob(f"{_RANK_PREFIX}*.jsonl"))
    if not files:
        log.notes.append(f"no event logs found under {run_dir / 'vidstab'}")
    order = 0
    for path in files:
        suffix = path.stem[len(_RANK_PREFIX):]
        file_rank = int(suffix) if suffix.isdigit() else None
        steps, attempts, records, by_t = [], [], [], []
        attempt, last_step = 0, None
        for rec in iter_event_file(path, log.notes):
            step = int(_num(rec.get("step")) if math.isfinite(_num(rec.get("step"))) else 0)
            rank = file_rank if file_rank is not None else int(_num(rec.get("rank")) or 0)
            if rec["kind"] == "metrics":
                # The step counter going back means a rollback or resume re-runs these steps: a new attempt.
                if last_step is not None and step <= last_step:
                    attempt += 1
                last_step = step
                steps.append(step)
                attempts.append(attempt)
                records.append(rec)
                lbt = rec.get("loss_by_t")
                by_t.append(lbt if isinstance(lbt, list) else [])
            else:
                event = dict(rec)
                event["rank"] = rank
                event["_attempt"] = attempt
                event["_order"] = order
                log.events.append(event)
            order += 1
        if records:
            fields = sorted({k for r in records for k, v in r.items() if k not in ("loss_by_t",)}
                            - {"schema", "time", "step", "rank", "kind"})
            columns = {k: np.array([_num(r.get(k)) for r in records]) for k in fields}
            width = max(map(len, by_t))
            lbt = np.array([[_num(x) for x in row] + [math.nan] * (width - len(row)) for row in by_t]).reshape(len(by_t), width)
            columns["time"] = np.array([_num(r.get("time")) for r in records])
            nonfinite = {k: np.array([k in r and _is_nonfinite(r[k]) for r in records]) for k in fields}
            log.metrics[file_rank if file_rank is not None else int(_num(records[0].get("rank")) or 0)] = RankMetrics(
                np.array(steps), np.array(attempts), columns, nonfinite, lbt
            )
    log.events.sort(key=lambda e: (_num(e.get("step")), _num(e.get("time")), e["_order"]))

    for path in sorted((run_dir / "vidstab" / "incidents").glob("*/incident.json")):
        try:
            info = read_json_file(path, str(path.relative_to(run_dir)))
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            log.notes.append(f"{path.relative_to(run_dir)}: unreadable incident ({err})")
            continue
        info["_folder"] = path.parent.relative_to(run_dir).as_posix()
        log.incidents.append(info)
    # Incident events whose bundle folder is missing (deleted, or the write never finished) still count.
    folders = {i["_folder"] for i in log.incidents}
    for e in log.events:
        if e.get("kind") == "incident" and e.get("path"):
            folder = str(e["path"]).rstrip("/")
            if folder.endswith("incident.json"):
                folder = folder.rsplit("/", 1)[0]
            if folder not in folders:
                folders.add(folder)
                log.incidents.append({**{k: v for k, v in e.items() if not k.startswith("_")},
                                      "_folder": folder, "_missing": True})
    log.incidents.sort(key=lambda i: (_num(i.get("step")), _num(i.get("rank"))))
    return log


def _event_steps(log: RunLog, kind: str) -> list[int]:
    return sorted({int(_num(e.get("step"))) for e in log.events if e.get("kind") == kind})


def _skipped(log: RunLog) -> set[tuple[int, int]]:
    """``(attempt, step)`` of every update not applied by a vidstab verdict: ``skip`` events, plus metrics
    with ``applied: false`` that are not fp16 overflows (those the scaler skips; they are marked apart).
    A step skipped again after a rollback is a second skip: the total counts every attempt."""
    pairs = {(e["_attempt"], int(_num(e.get("step")))) for e in log.events if e.get("kind") == "skip"}
    overflow = {(e["_attempt"], int(_num(e.get("step")))) for e in log.events if e.get("kind") == "overflow"}
    for m in log.metrics.values():
        if "applied" in m.columns:
            sel = m.columns["applied"] == 0
            pairs.update(p for p in zip(m.attempts[sel].tolist(), m.steps[sel].tolist()) if p not in overflow)
    return pairs


def _skip_steps(log: RunLog) -> list[int]:
    """The steps of :func:`_skipped` (each once), for marking plots."""
    return sorted({step for _, step in _skipped(log)})
