"""Per-rank JSONL event log and the bridge to the accelerator's trackers.

Every rank appends to its own ``RUN_DIR/vidstab/events-rank{R}.jsonl`` (no cross-process locking, and
the quiet error on rank 3 is written by rank 3). One JSON object per line, flushed on write, so a
crash loses at most the line being written; :func:`read_events` tolerates a torn last line.

Line schema: ``{"schema": 1, "time": <unix float>, "step": int, "rank": int, "kind": str, ...fields}``
with ``kind`` in ``metrics | warn | skip | rollback | checkpoint | incident | resume | stop | start |
fault | overflow``. Non-finite floats are written as ``null`` (strict JSON, readable by any dashboard).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

SCHEMA = 1
KINDS = ("metrics", "warn", "skip", "rollback_request", "rollback", "checkpoint", "incident", "resume", "stop", "start", "fault", "overflow",
         "hang", "crash", "restart")


def events_dir(run_dir: str | Path) -> Path:
    """``RUN_DIR/vidstab``: where event logs (and incident bundles) live."""
    return Path(run_dir) / "vidstab"


def _clean(x: Any) -> Any:
    """Make a value strict-JSON: non-finite floats -> None, tuples -> lists, paths -> str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:  # numpy / torch scalars (cold path only)
        return _clean(x.item())
    return str(x)


class EventLog:
    """Append-only JSONL log of one rank. Cheap: one ``json.dumps`` + one write + flush per event."""

    def __init__(self, run_dir: str | Path, rank: int = 0) -> None:
        self.rank = int(rank)
        self.path = events_dir(run_dir) / f"events-rank{self.rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered append: every event reaches the OS as soon as it is written.
        self._f = open(self.path, "a", encoding="utf-8", buffering=1)

    def log(self, kind: str, step: int, **fields: Any) -> dict:
        """Append one event and return it (as written)."""
        rec = {"schema": SCHEMA, "time": time.time(), "step": int(step), "rank": self.rank, "kind": str(kind), **fields}
        try:  # fast path: already plain, finite JSON (the common case: a metrics line every step)
            line = json.dumps(rec, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            rec = _clean(rec)
            line = json.dumps(rec, separators=(",", ":"))
        self._f.write(line + "\n")
        self._f.flush()
        return rec

    def close(self) -> None:
        """Flush and close (further :meth:`log` calls raise)."""
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __del__(self) -> None:  # best effort; the file is flushed per line anyway
        try:
            self._f.close()
        except Exception:
            pass


def log_event(run_dir: str | Path, rank: int, kind: str, step: int, **fields: Any) -> None:
    """Append one event from code that holds no :class:`EventLog` (checkpointing, recovery).

    Never raises: losing one log line must not fail a checkpoint or a rollback.
    """
    try:
        log = EventLog(run_dir, rank)
        try:
            log.log(kind, step, **fields)
        finally:
            log.close()
    except Exception as exc:  # noqa: BLE001
        logging.getLogger(__name__).debug("event log failed: %s", exc)


def iter_event_file(path: str | Path, notes: list[str] | None = None) -> Iterator[dict]:
    """The events of one ``events-rank{R}.jsonl`` file, in file order.

    Lines that do not parse are skipped, with a note appended to ``notes`` when given: a torn last line is
    expected after a kill, anything else deserves a look.
    """
    path = Path(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if notes is not None:
                notes.append(f"{path.name} line {number}: " + (
                    "truncated last line skipped (the process was probably killed while writing)"
                    if number == len(lines) else "unparseable line skipped"))
            continue
        if isinstance(rec, dict) and "kind" in rec:
            yield rec


def read_events(run_dir: str | Path, kinds: str | tuple[str, ...] | None = None,
                notes: list[str] | None = None) -> list[dict]:
    """All events of all ranks of a run, sorted by ``(step, time, rank)``; optionally only some ``kinds``.

    Lines that do not parse (a torn last line after a crash) are skipped and, with ``notes``, reported there.
    """
    if isinstance(kinds, str):
        kinds = (kinds,)
    out = [rec for path in sorted(events_dir(run_dir).glob("events-rank*.jsonl"))
           for rec in iter_event_file(path, notes) if kinds is None or rec.get("kind") in kinds]

    def order(rec: dict) -> tuple:
        step, t, rank = rec.get("step"), rec.get("time"), rec.get("rank")
        return (step if isinstance(step, (int, float)) else 0, t if isinstance(t, (int, float)) else 0.0,
                rank if isinstance(rank, int) else 0)

    out.sort(key=order)
    return out


def log_to_trackers(accelerator: Any, metrics: Mapping[str, Any], step: int, prefix: str = "vidstab/") -> None:
    """Send the finite numeric metrics to ``accelerator.log`` (which only logs on the main process)."""
    if accelerator is None or not getattr(accelerator, "trackers", None):
        return
    flat: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            flat[prefix + k] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            flat[prefix + k] = v
        elif isinstance(v, (list, tuple)) and k == "loss_by_t":
            for i, x in enumerate(v):
                if isinstance(x, (int, float)) and math.isfinite(x):
                    flat[f"{prefix}loss_t{i}"] = x
    accelerator.log(flat, step=step)
