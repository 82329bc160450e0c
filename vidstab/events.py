"""Per-rank JSONL event log and the bridge to the accelerator's trackers.

Every rank appends to its own ``RUN_DIR/vidstab/events-rank{R}.jsonl`` (no cross-process locking, and
the quiet error on rank 3 is written by rank 3). One JSON object per line.

Durability: healthy ``metrics`` lines are buffered in memory (at most ``flush_lines`` lines or
``flush_seconds`` seconds) and every other event (a finding, an incident, a checkpoint, a rollback, a stop)
is written together with the buffered lines at once, in one ``write`` of whole lines. So a crash loses at
most the last few healthy metrics lines, never a finding or an incident, and never tears a line that
another writer (``log_event``) appends next to it. A checkpoint save flushes the log and fsyncs it with its
files before it is published (:func:`flush_log`), and a log that a kill left without a final newline gets one
before the next line. In-process readers (:func:`iter_event_file`,
:func:`read_events`) flush the open logs first; the buffer is also flushed at interpreter exit.

Line schema: ``{"schema": 1, "time": <unix float>, "step": int, "rank": int, "kind": str, ...fields}``
(``step`` the script's; ``trajectory_step`` beside it where in-place rollbacks made the two differ, from the
guard's :class:`~vidstab.step_numbering.StepNumbering`: :attr:`EventLog.numbering`), with ``kind`` in ``metrics | warn | skip | rollback | checkpoint | incident | resume | stop | start |
fault | overflow``. Strict JSON, with vidstab's one convention (:mod:`vidstab.files.strict_json`): a non-finite
float is the string ``"nan"``, ``"inf"`` or ``"-inf"``, and ``null`` means "no value" (not measured this
step). Logs written before this convention spelled a non-finite float ``null``; readers take both
(``strict_json.json_float`` reads a value; the report counts a ``null`` loss as non-finite).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

import orjson

from .files.limits import TooLarge, bounded_lines, env_name, limits, loads_bounded
from .files.strict_json import to_json_safe
from .step_numbering import trajectory_fields

SCHEMA = 1
KINDS = ("metrics", "warn", "skip", "rollback_request", "rollback", "checkpoint", "incident", "resume", "stop", "start", "fault", "overflow",
         "hang", "crash", "restart", "quarantine", "rerun")


def events_dir(run_dir: str | Path) -> Path:
    """``RUN_DIR/vidstab``: where event logs (and incident bundles) live."""
    return Path(run_dir) / "vidstab"


# Built once: json.dumps with options builds a new JSONEncoder on every call.
_STRICT = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _encode(rec: dict) -> tuple[str, dict]:
    """``(line, record as written)``: plain finite JSON as it is, else in vidstab's one spelling."""
    try:  # fast path: already plain, finite JSON
        return _STRICT(rec), rec
    except (TypeError, ValueError):  # a non-finite float or a non-JSON type
        rec = to_json_safe(rec)
        return _STRICT(rec), rec


def _plain_finite(fields: dict) -> bool:
    """Whether a metrics line's fields are all JSON scalars (``None``, ``bool``, ``int``, finite ``float``,
    ``str``) or lists of them: what orjson writes exactly as ``json`` would (it writes NaN as ``null``, so a
    line with a non-finite value, or anything else, takes :func:`_encode`). Exact classes: a numpy float is
    a ``float`` subclass that orjson would refuse."""
    for v in fields.values():
        c = v.__class__
        if c is float:
            if v - v != 0.0:  # NaN or +-inf
                return False
        elif c is list:
            for x in v:
                c = x.__class__
                if c is float:
                    if x - x != 0.0:
                        return False
                elif not (x is None or c is int or c is bool or c is str):
                    return False
        elif not (v is None or c is int or c is bool or c is str):
            return False
    return True


#: Buffered logs open in this process, by file: readers and ``log_event`` go through them.
_OPEN: "weakref.WeakValueDictionary[str, EventLog]" = weakref.WeakValueDictionary()


class EventLog:
    """Append-only JSONL log of one rank; healthy metrics lines are buffered (module docstring)."""

    def __init__(self, run_dir: str | Path, rank: int = 0, *, flush_lines: int = 100,
                 flush_seconds: float = 1.0) -> None:
        self.rank = int(rank)
        self.path = events_dir(run_dir) / f"events-rank{self.rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_lines, self.flush_seconds = int(flush_lines), float(flush_seconds)
        # Unbuffered binary append: each flush is ONE write() of whole lines (O_APPEND), so a line written
        # by another handle (log_event, another EventLog) is never interleaved into ours.
        self._f = open(self.path, "ab", buffering=0)
        if ends_torn(self.path):  # a kill cut the last line: ours must not be glued to it
            self._f.write(b"\n")
        self._pending: list[str | tuple] = []  # encoded lines, and (time, step, fields) of metrics lines
        # The checkpoint writer thread flushes this log too (log_event, flush_log): one flush at a time, in order.
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self.numbering: Any = None
        """The guard's :class:`~vidstab.step_numbering.StepNumbering` (set by the guard that owns this log): an event
        about the step being taken carries the trajectory's step beside its ``step`` where the two differ."""
        _OPEN[str(self.path.resolve())] = self

    def _trajectory(self, step: int, fields: dict) -> dict:
        """``fields`` with the event's ``trajectory_step``, only where it differs from ``step``: the one given (an
        event about a stored step, e.g. a checkpoint's, as it recorded it), else the numbering's of ``step``."""
        if "trajectory_step" in fields:
            fields.update(trajectory_fields(step, fields.pop("trajectory_step")))
        elif self.numbering is not None and self.numbering.lost:
            fields.update(self.numbering.fields(step))
        return fields

    def log(self, kind: str, step: int, **fields: Any) -> dict:
        """Append one event and return its record (of a ``metrics`` event: its fields, :meth:`log_metrics`).
        Anything but ``metrics`` is encoded and reaches the file at once. ``trajectory_step``: of an event about
        a stored step (None: the same as ``step``); else the step being taken's (:meth:`_trajectory`)."""
        if kind == "metrics":
            return self.log_metrics(step, fields)
        fields = self._trajectory(step, fields)
        rec = {"schema": SCHEMA, "time": time.time(), "step": int(step), "rank": self.rank, "kind": str(kind), **fields}
        line, rec = _encode(rec)
        with self._lock:
            self._pending.append(line)
        self.flush()
        return rec

    def log_metrics(self, step: int, fields: dict, when: float | None = None) -> dict:
        """Buffer one ``metrics`` line (a copy of ``fields``: the record cannot change once logged) and return it;
        it is encoded when the buffer is flushed. ``when``: the line's ``time`` (default: now)."""
        fields = self._trajectory(step, dict(fields))
        with self._lock:
            self._pending.append((time.time() if when is None else when, int(step), fields))
        if len(self._pending) >= self.flush_lines or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()
        return fields

    def _metrics_line(self, entry: tuple) -> bytes:
        """One buffered metrics line, encoded: with orjson where the fields are plain finite JSON (every healthy
        step; about twice as fast as ``json``), else with vidstab's strict spelling. The values read back are the
        same; the spelling may differ (``1e-5`` for ``1e-05``, UTF-8 for ``\\u00e9``), both standard JSON."""
        t, step, fields = entry
        rec = {"schema": SCHEMA, "time": t, "step": step, "rank": self.rank, "kind": "metrics", **fields}
        if _plain_finite(fields):
            try:
                return orjson.dumps(rec)
            except orjson.JSONEncodeError:  # an integer past 64 bits: the json path writes it
                pass
        return _encode(rec)[0].encode("utf-8")

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._f.closed

    def flush(self) -> None:
        """Write the buffered lines now (one ``write`` call)."""
        if not self._pending or self._f.closed:
            return
        with self._lock:
            pending, self._pending = self._pending, []
            lines = [p.encode("utf-8") if p.__class__ is str else self._metrics_line(p) for p in pending]
            lines.append(b"")
            data = b"\n".join(lines)
            self._last_flush = time.monotonic()
            view = memoryview(data)
            while view:  # a regular file takes it in one go; loop for the partial-write contract anyway
                view = view[self._f.write(view):]

    def close(self) -> None:
        """Flush, fsync and close (further :meth:`log` calls raise)."""
        if not self._f.closed:
            self.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __del__(self) -> None:  # best effort: write what is buffered
        try:
            self.flush()
            self._f.close()
        except Exception:
            pass


@atexit.register
def _flush_at_exit() -> None:
    flush_open_logs()


def ends_torn(path: Path) -> bool:
    """Whether the file ``path`` is non-empty and does not end with a newline (a line cut by a kill)."""
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, os.SEEK_END) == 0:
                return False
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) != b"\n"
    except OSError:
        return False


def log_path(run_dir: str | Path, rank: int) -> Path:
    """``RUN_DIR/vidstab/events-rank{R}.jsonl``: rank ``rank``'s event log."""
    return events_dir(run_dir) / f"events-rank{int(rank)}.jsonl"


def flush_log(run_dir: str | Path, rank: int) -> Path | None:
    """Write out what rank ``rank``'s open log of ``run_dir`` holds back; returns the log's path when the file
    exists (the caller makes it durable, e.g. in a batch of fsyncs), else None. Never raises."""
    path = log_path(run_dir, rank)
    flush_open_logs(path)
    return path if path.is_file() else None


def flush_open_logs(path: str | Path | None = None) -> None:
    """Flush the buffered logs of this process (all, or the one writing ``path``) before reading files."""
    try:
        logs = [_OPEN.get(str(Path(path).resolve()))] if path is not None else list(_OPEN.values())
    except OSError:
        return
    for log in logs:
        if log is not None:
            try:
                log.flush()
            except (OSError, ValueError):  # a log being torn down: nothing left to save
                pass


def log_event(run_dir: str | Path, rank: int, kind: str, step: int, **fields: Any) -> None:
    """Append one event from code that holds no :class:`EventLog` (checkpointing, recovery).

    Never raises: losing one log line must not fail a checkpoint or a rollback.
    """
    try:
        path = log_path(run_dir, rank)
        open_log = _OPEN.get(str(path.resolve()))
        if open_log is not None and not open_log.closed:  # the guard's log: keep one file order, flush now
            open_log.log(kind, step, **fields)
            return
        log = EventLog(run_dir, rank)
        try:
            log.log(kind, step, **fields)
        finally:
            log.close()
    except Exception as exc:  # noqa: BLE001
        logging.getLogger(__name__).debug("event log failed: %s", exc)


class _Upto:
    """A binary file read up to byte ``end`` (``readline`` only)."""

    def __init__(self, fh: Any, end: int) -> None:
        self.fh, self.end = fh, end

    def readline(self, size: int) -> bytes:
        left = self.end - self.fh.tell()
        return self.fh.readline(min(size, left)) if left > 0 else b""


def iter_event_file(path: str | Path, notes: list[str] | None = None, start: int = 0,
                    end: int | None = None) -> Iterator[dict]:
    """The events of one ``events-rank{R}.jsonl`` file, in file order, read one bounded line at a time
    (from byte ``start`` up to byte ``end``: line boundaries, e.g. the file's size at some moment).

    Lines that do not parse are skipped, with a note appended to ``notes`` when given: a torn last line is
    expected after a kill, anything else deserves a look. A line longer than
    ``vidstab.files.limits.Limits.event_line_bytes`` or nested deeper than ``json_depth`` is skipped unread, with
    a note naming it.
    """
    path = Path(path)
    flush_open_logs(path)
    lim, name = limits(), path.name
    max_line = lim.event_line_bytes
    with open(path, "rb") as f:
        f.seek(start)
        for number, (line, last) in enumerate(bounded_lines(f if end is None else _Upto(f, end), max_line), start=1):
            if line is None:
                if notes is not None:
                    notes.append(f"{path.name} line {number}: longer than {max_line} bytes "
                                 f"({env_name('event_line_bytes')}); skipped unread")
                continue
            if not line.strip():
                continue
            try:
                rec = loads_bounded(line.decode("utf-8", errors="replace"), f"{name} line {number}", max_line,
                                    lim.json_depth)
            except TooLarge as e:
                if notes is not None:
                    notes.append(f"{e}; line skipped")
                continue
            except ValueError:
                if notes is not None:
                    notes.append(f"{path.name} line {number}: " + (
                        "truncated last line skipped (the process was probably killed while writing)"
                        if last else "unparseable line skipped"))
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
