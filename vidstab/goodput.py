"""Goodput: where every second of a run's wall time went, from its event logs.

The ledger walks the main process's event log (``events-rank0.jsonl``: it logs every step) as a timeline,
attempt by attempt (an attempt begins with a ``start`` event: the first launch, each torch-elastic restart,
each relaunch), and attributes each interval between two consecutive events to ONE bucket, named by the
event that closes it (events are written when the work they name ends):

==================  ===========================================================================================
``productive``      a step whose update the run kept (``metrics`` with ``applied``, never executed again)
``skipped``         a step whose update was thrown away (``metrics`` without ``applied``: NaN, spike, ...)
``rework``          a step applied, then undone: executed again later after a rollback or a restart's resume
``triage``          incident capture and the rerun of a suspect step (``skip``/``rollback_request``/``incident``/
                    ``rerun``)
``checkpoint``      the blocking part of checkpoint saves (``blocking_seconds`` of a ``checkpoint`` event,
                    carved out of the interval it ended in; an asynchronous write goes on behind training)
``rollback``        restoring the state of a rollback (``rollback``)
``restart``         downtime: from the last sign of life of an attempt that crashed, was killed or stopped, to the
                    start of the next attempt's process (``crash``, and the gap between attempts)
``hang``            from the last sign of life to the watchdog's ``hang`` event (any rank's)
``startup``         process start to the first step: imports, building, checkpoint load (``start``, ``resume``,
                    ``restart``; ``start`` carries ``process_started``)
``data``            waiting for data (``data_seconds`` of a ``metrics`` event, carved out of its step)
``validation``      validation and sampling (``validation``)
``other``           the end-of-run export and final checkpoint wait, the ledger's own ``goodput`` events, and
                    what no event names more precisely (closed by ``stop``, ``export``, ``goodput``)
==================  ===========================================================================================

Other events (``warn``, ``checkpoint``, ``quarantine``, ``recovery``, ...) are transparent: their interval belongs to
the next event that closes one. The buckets sum to the wall time by construction (the intervals tile it);
``ettr`` = productive / wall, per attempt and for the run. Clocks: one host's wall clock (``time`` of the
events); events of other ranks add only their ``hang`` and ``crash`` last words.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

from .events import events_dir, iter_event_file, log_to_trackers

BUCKETS = ("productive", "skipped", "rework", "triage", "checkpoint", "rollback", "restart", "hang", "startup",
           "data", "validation", "other")

# The bucket of the interval an event closes (metrics: decided per step).
CLOSES = {"skip": "triage", "rollback_request": "triage", "incident": "triage", "rerun": "triage",
          "rollback": "rollback", "crash": "restart", "hang": "hang", "start": "startup", "resume": "startup",
          "restart": "startup", "validation": "validation", "stop": "other", "export": "other", "goodput": "other",
          "metrics": None}
LAST_WORDS = ("hang", "crash")  # taken from every rank: they end an attempt


def process_start_time() -> float:
    """When this process started (unix time): from ``/proc`` on Linux, else when vidstab was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        from .elastic import PROCESS_START

        return PROCESS_START


def _time(rec: Mapping[str, Any]) -> float | None:
    t = rec.get("time")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0


def _attempts(rank0: list[dict]) -> list[list[dict]]:
    """Rank 0's events split at its ``start`` events (anything before the first one is its own attempt)."""
    attempts: list[list[dict]] = []
    for rec in rank0:
        if rec.get("kind") == "start" or not attempts:
            attempts.append([])
        attempts[-1].append(rec)
    return attempts


def _attempt_begin(events: list[dict]) -> float:
    first = events[0]
    started = first.get("process_started") if first.get("kind") == "start" else None
    t = _time(first)
    if isinstance(started, (int, float)) and math.isfinite(started) and t is not None:
        return min(float(started), t)
    return t


def ledger(run_dir: str | Path, notes: list[str] | None = None) -> dict:
    """The goodput ledger of the run in ``run_dir`` (see the module docstring).

    Returns ``{"wall_seconds", "buckets": {bucket: seconds}, "ettr", "attempts": [{"begin", "end",
    "wall_seconds", "buckets", "ettr", "steps"}, ...], "restarts", "steps"}``; ``notes`` collects lines of the
    logs that could not be read. A run without an event log of rank 0 raises ``FileNotFoundError``."""
    folder = events_dir(run_dir)
    path0 = folder / "events-rank0.jsonl"
    if not path0.is_file():
        raise FileNotFoundError(f"{path0}: no event log of rank 0 (is {run_dir} a vidstab run folder?)")
    rank0 = [r for r in iter_event_file(path0, notes) if _time(r) is not None]
    attempts = _attempts(rank0)
    begins = [_attempt_begin(a) for a in attempts]
    # Other ranks' last words, each in the attempt whose time window holds it.
    extra: list[list[dict]] = [[] for _ in attempts]
    for path in sorted(folder.glob("events-rank*.jsonl")):
        if path.name == path0.name:
            continue
        for rec in iter_event_file(path, notes):
            t = _time(rec)
            if rec.get("kind") in LAST_WORDS and t is not None and attempts and t >= begins[0]:
                index = max(i for i, b in enumerate(begins) if b <= t)
                extra[index].append(rec)

    # Which executions of a step were final: a step logged again later was undone (rollback or resume).
    last_run: dict[int, tuple[int, float]] = {}
    for i, events in enumerate(attempts):
        for rec in events:
            if rec.get("kind") == "metrics" and isinstance(rec.get("step"), int):
                last_run[rec["step"]] = (i, _time(rec))

    out_attempts = []
    for i, events in enumerate(attempts):
        timeline = sorted(events + extra[i], key=lambda r: _time(r))
        begin = begins[i]
        end = _time(timeline[-1])
        intervals: list[dict] = []  # {"start", "end", "share": {bucket: seconds}}
        prev = begin
        steps = {"productive": 0, "skipped": 0, "rework": 0}
        for rec in timeline:
            kind, t = rec.get("kind"), _time(rec)
            if kind not in CLOSES:
                continue
            dt = max(t - prev, 0.0)
            bucket = CLOSES[kind]
            share: dict[str, float] = {}
            if kind == "metrics":
                if not rec.get("applied"):
                    bucket = "skipped"
                elif last_run.get(rec.get("step")) == (i, t):
                    bucket = "productive"
                else:
                    bucket = "rework"
                steps[bucket] += 1
                data = min(_seconds(rec.get("data_seconds")), dt)
                if data:
                    share["data"] = data
                share[bucket] = dt - data
            else:
                share[bucket] = dt
            intervals.append({"start": prev, "end": t, "main": bucket, "share": share})
            prev = max(prev, t)
        if end > prev:  # transparent events after the last closer
            intervals.append({"start": prev, "end": end, "main": "other", "share": {"other": end - prev}})
        for rec in events:  # the blocking part of saves, out of the interval it ended in
            if rec.get("kind") != "checkpoint":
                continue
            blocking = _seconds(rec.get("blocking_seconds", rec.get("seconds")))
            ended = rec.get("blocking_ended", rec.get("time"))
            target = next((iv for iv in intervals if iv["start"] < ended <= iv["end"]), None)
            if target is None or not blocking:
                continue
            main = target["main"]
            taken = min(blocking, target["share"].get(main, 0.0))
            target["share"][main] -= taken
            target["share"]["checkpoint"] = target["share"].get("checkpoint", 0.0) + taken
        # Until the next attempt's process started: downtime.
        stop = begins[i + 1] if i + 1 < len(attempts) else end
        if stop > end:
            intervals.append({"start": end, "end": stop, "main": "restart", "share": {"restart": stop - end}})
        buckets = dict.fromkeys(BUCKETS, 0.0)
        for iv in intervals:
            for b, s in iv["share"].items():
                buckets[b] += s
        wall = max(stop, end) - begin
        out_attempts.append({"attempt": i, "begin": begin, "end": max(stop, end), "wall_seconds": wall,
                             "buckets": buckets, "ettr": buckets["productive"] / wall if wall > 0 else None,
                             "steps": steps})

    total = dict.fromkeys(BUCKETS, 0.0)
    for a in out_attempts:
        for b, s in a["buckets"].items():
            total[b] += s
    wall = (out_attempts[-1]["end"] - out_attempts[0]["begin"]) if out_attempts else 0.0
    steps = {k: sum(a["steps"][k] for a in out_attempts) for k in ("productive", "skipped", "rework")}
    restarts = sum(1 for a in attempts for r in a if r.get("kind") == "restart")
    return {"wall_seconds": wall, "buckets": total, "ettr": total["productive"] / wall if wall > 0 else None,
            "attempts": out_attempts, "restarts": restarts, "steps": steps}


def format_table(led: Mapping[str, Any]) -> str:
    """The ledger as a plain-text table: one row per bucket, seconds and share of the wall time, per attempt."""
    attempts = led["attempts"]
    wall = led["wall_seconds"] or 1.0
    head = f"{'bucket':<12}{'seconds':>10}{'share':>8}" + "".join(f"{'attempt ' + str(a['attempt']):>12}" for a in attempts)
    lines = [head, "-" * len(head)]
    for b in BUCKETS:
        lines.append(f"{b:<12}{led['buckets'][b]:>10.2f}{100 * led['buckets'][b] / wall:>7.1f}%"
                     + "".join(f"{a['buckets'][b]:>12.2f}" for a in attempts))
    lines.append("-" * len(head))
    lines.append(f"{'wall':<12}{led['wall_seconds']:>10.2f}{'100.0%':>8}" + "".join(f"{a['wall_seconds']:>12.2f}" for a in attempts))

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines.append(f"{'ETTR':<12}{pct(led['ettr']):>10}{'':>8}" + "".join(f"{pct(a['ettr']):>12}" for a in attempts))
    s = led["steps"]
    lines.append(f"steps: {s['productive']} productive, {s['skipped']} skipped, {s['rework']} redone later; "
                 f"attempts {len(attempts)}, restarts {led['restarts']}")
    return "\n".join(lines)


def summary_fields(led: Mapping[str, Any]) -> dict:
    """The fields of a ``goodput`` event: the ETTR, the wall time and each bucket's seconds (rounded)."""
    return {"ettr": None if led["ettr"] is None else round(led["ettr"], 5), "wall_seconds": round(led["wall_seconds"], 3),
            "seconds": {b: round(s, 3) for b, s in led["buckets"].items()}, "attempts": len(led["attempts"]),
            "restarts": led["restarts"]}


class GoodputLog:
    """A ``goodput`` event every ``every`` steps and at exit, and the ETTR to the accelerator's trackers as
    ``vidstab/ettr``; on the main process only (the ledger reads every rank's log). ``every=0``: at exit only."""

    def __init__(self, accelerator: Any, run_dir: str | Path, every: int = 100) -> None:
        self.accelerator, self.run_dir, self.every = accelerator, Path(run_dir), int(every)
        self.main = accelerator is None or bool(getattr(accelerator, "is_main_process", True))

    def log(self, events: Any, step: int) -> dict | None:
        """Compute the ledger now, write it as a ``goodput`` event to ``events`` (an EventLog) and to the trackers."""
        if not self.main:
            return None
        try:
            fields = summary_fields(ledger(self.run_dir))
        except (OSError, ValueError) as exc:  # the ledger must never end a run
            events.log("warn", step, detector="goodput", message=f"goodput ledger failed: {exc}", bad_ranks=[])
            return None
        events.log("goodput", step, **fields)
        if fields["ettr"] is not None:
            log_to_trackers(self.accelerator, {"ettr": fields["ettr"]}, step)
        return fields

    def maybe_log(self, events: Any, step: int) -> dict | None:
        """:meth:`log` when ``step`` is a multiple of ``every``."""
        if self.every > 0 and step > 0 and step % self.every == 0:
            return self.log(events, step)
        return None


__all__ = ["BUCKETS", "GoodputLog", "format_table", "ledger", "process_start_time", "summary_fields"]
