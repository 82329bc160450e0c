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
import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping

from .checkpoint_interval import recommend
from ..events import events_dir, flush_open_logs, iter_event_file, log_to_trackers
from ..files.limits import limits, loads_bounded

BUCKETS = ("productive", "skipped", "rework", "triage", "checkpoint", "rollback", "restart", "hang", "startup",
           "data", "validation", "other")

# The bucket of the interval an event closes (metrics: decided per step).
CLOSES = {"skip": "triage", "rollback_request": "triage", "incident": "triage", "rerun": "triage",
          "rollback": "rollback", "crash": "restart", "hang": "hang", "start": "startup", "resume": "startup",
          "restart": "startup", "validation": "validation", "stop": "other", "export": "other", "goodput": "other",
          "metrics": None}
LAST_WORDS = ("hang", "crash")  # taken from every rank: they end an attempt


def process_start_time() -> float:
    """When this process started (unix time): from ``/proc`` on Linux (to a clock tick; the boot time there is
    whole seconds, so the age is taken against the boot clock instead), else when vidstab was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        from .elastic import PROCESS_START

        return PROCESS_START


def _time(rec: Mapping[str, Any]) -> float | None:
    t = rec.get("time")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0


class LedgerBuilder:
    """The ledger, built one event at a time (events in time order: rank 0's, and other ranks' last words).

    Kept small for a long run: a step's last execution is remembered (to count it as rework should it be
    executed again) only back to the ``remember_checkpoints``-th newest checkpoint, the intervals a checkpoint's
    blocking time may have ended in only for the last ``recent`` intervals."""

    def __init__(self, remember_checkpoints: int = 8, recent: int = 512) -> None:
        self.attempts: list[dict] = []
        self.restarts = 0
        self.counts = dict.fromkeys(("checkpoint", "rollback", "hang", "crash"), 0)
        """Events seen, by kind (a hang or crash counts once per attempt, however many ranks said it)."""
        self.save_blocking = 0.0  # as the checkpoint events said it (carved into the ledger once its interval closed)
        self._prev = 0.0  # end of the last closed interval
        self._last = 0.0  # time of the last event of the current attempt
        self._runs: dict[int, dict] = {}  # step -> the interval of its last applied execution (oldest first)
        self._recent: deque[dict] = deque(maxlen=recent)
        self._pending: list[tuple[float, float]] = []  # (blocking ended, seconds) not yet inside a closed interval
        self._checkpoints: deque[int] = deque(maxlen=remember_checkpoints)

    def _add(self, attempt: dict, bucket: str, seconds: float) -> None:
        attempt["buckets"][bucket] += seconds

    def _begin(self, t: float, started: Any) -> None:
        begin = min(float(started), t) if _finite(started) else t
        if self.attempts:  # not before the previous attempt's last event (clocks tick coarsely)
            begin = max(begin, self._last)
            self._end_attempt(next_begin=begin)
        self.attempts.append({"attempt": len(self.attempts), "begin": begin, "end": begin,
                              "buckets": dict.fromkeys(BUCKETS, 0.0),
                              "steps": {"productive": 0, "skipped": 0, "rework": 0}})
        self._prev = self._last = begin

    def _end_attempt(self, next_begin: float | None) -> None:
        """Close the current attempt: events after its last interval are ``other``; until ``next_begin``, downtime."""
        a = self.attempts[-1]
        if self._last > self._prev:
            self._close(a, self._last, "other", {"other": self._last - self._prev})
        a["end"] = self._last
        if next_begin is not None and next_begin > self._last:
            self._add(a, "restart", next_begin - self._last)
            a["end"] = next_begin

    def _close(self, a: dict, t: float, main: str, share: dict, step: int | None = None) -> dict:
        interval = {"start": self._prev, "end": t, "main": main, "share": share, "attempt": a, "step": step}
        for b, sec in share.items():
            self._add(a, b, sec)
        self._recent.append(interval)
        self._prev = max(self._prev, t)
        still = []
        for ended, seconds in self._pending:
            if not self._carve(ended, seconds):
                still.append((ended, seconds))
        self._pending = still
        return interval

    def _carve(self, ended: float, seconds: float) -> bool:
        """Move ``seconds`` of the interval that ``ended`` falls in to ``checkpoint``; False if not closed yet."""
        if ended > self._prev:
            return False
        target = next((iv for iv in reversed(self._recent) if iv["start"] < ended <= iv["end"]), None)
        if target is not None:
            main = target["main"]
            taken = min(seconds, target["share"].get(main, 0.0))
            target["share"][main] -= taken
            target["share"]["checkpoint"] = target["share"].get("checkpoint", 0.0) + taken
            self._add(target["attempt"], main, -taken)
            self._add(target["attempt"], "checkpoint", taken)
        return True

    def feed(self, rec: Mapping[str, Any]) -> None:
        """One event (a ``start`` begins an attempt; events before any ``start`` begin one of their own)."""
        t, kind = _time(rec), rec.get("kind")
        if t is None:
            return
        if kind == "start" or not self.attempts:
            self._begin(t, rec.get("process_started") if kind == "start" else None)
        a = self.attempts[-1]
        self._last = max(self._last, t)
        if kind == "restart":
            self.restarts += 1
        if kind in self.counts and not a.get(kind):
            self.counts[kind] += 1
            if kind in LAST_WORDS:
                a[kind] = True
        if kind == "checkpoint":
            blocking = _seconds(rec.get("blocking_seconds", rec.get("seconds")))
            self.save_blocking += blocking
            ended = rec.get("blocking_ended", t)
            if blocking and _finite(ended) and not self._carve(float(ended), blocking):
                self._pending.append((float(ended), blocking))
            if isinstance(rec.get("step"), int):
                self._checkpoints.append(rec["step"])
                if len(self._checkpoints) == self._checkpoints.maxlen:
                    self._forget_before(self._checkpoints[0])
        if kind not in CLOSES:
            return
        dt = max(t - self._prev, 0.0)
        if kind != "metrics":
            self._close(a, t, CLOSES[kind], {CLOSES[kind]: dt})
            return
        step = rec.get("step") if isinstance(rec.get("step"), int) else None
        bucket = "productive" if rec.get("applied") else "skipped"
        data = min(_seconds(rec.get("data_seconds")), dt)
        share = {"data": data, bucket: dt - data} if data else {bucket: dt}
        a["steps"][bucket] += 1
        interval = self._close(a, t, bucket, share, step)
        if bucket == "productive" and step is not None:
            earlier = self._runs.pop(step, None)
            if earlier is not None:  # executed again: the earlier execution's work was undone
                self._rework(earlier)
            self._runs[step] = interval

    def _rework(self, interval: dict) -> None:
        a, seconds = interval["attempt"], interval["share"].get("productive", 0.0)
        interval["share"]["rework"] = interval["share"].pop("productive", 0.0)
        interval["main"] = "rework"
        self._add(a, "productive", -seconds)
        self._add(a, "rework", seconds)
        a["steps"]["productive"] -= 1
        a["steps"]["rework"] += 1

    def _forget_before(self, step: int) -> None:
        for old in [s for s in self._runs if s < step]:
            del self._runs[old]

    def result(self) -> dict:
        """The ledger so far: ``{"wall_seconds", "buckets", "ettr", "attempts": [...], "restarts", "steps"}``."""
        if not self.attempts:
            return {"wall_seconds": 0.0, "buckets": dict.fromkeys(BUCKETS, 0.0), "ettr": None, "attempts": [],
                    "restarts": 0, "counts": dict(self.counts), "save_blocking_seconds": 0.0, "steps": {"productive": 0, "skipped": 0, "rework": 0}}
        attempts = []
        for a in self.attempts:
            buckets, end = dict(a["buckets"]), a["end"]
            if a is self.attempts[-1]:  # still open: its events after the last interval are "other" so far
                buckets["other"] += max(self._last - self._prev, 0.0)
                end = max(self._last, self._prev)
            wall = end - a["begin"]
            attempts.append({"attempt": a["attempt"], "begin": a["begin"], "end": end, "wall_seconds": wall,
                             "buckets": buckets, "ettr": buckets["productive"] / wall if wall > 0 else None,
                             "steps": dict(a["steps"])})
        total = {b: sum(a["buckets"][b] for a in attempts) for b in BUCKETS}
        wall = attempts[-1]["end"] - attempts[0]["begin"]
        return {"wall_seconds": wall, "buckets": total, "ettr": total["productive"] / wall if wall > 0 else None,
                "attempts": attempts, "restarts": self.restarts, "counts": dict(self.counts),
                "save_blocking_seconds": self.save_blocking,
                "steps": {k: sum(a["steps"][k] for a in attempts) for k in ("productive", "skipped", "rework")}}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _last_words(folder: Path, notes: list[str] | None) -> list[dict]:
    """Other ranks' ``hang``/``crash`` events: they end an attempt."""
    return [rec for path in sorted(folder.glob("events-rank*.jsonl")) if path.name != "events-rank0.jsonl"
            for rec in iter_event_file(path, notes) if rec.get("kind") in LAST_WORDS and _time(rec) is not None]


def ledger(run_dir: str | Path, notes: list[str] | None = None) -> dict:
    """The goodput ledger of the run in ``run_dir`` (see the module docstring): :meth:`LedgerBuilder.result`.

    ``notes`` collects lines of the logs that could not be read. A run without an event log of rank 0 raises
    ``FileNotFoundError``."""
    folder = events_dir(run_dir)
    path0 = folder / "events-rank0.jsonl"
    if not path0.is_file():
        raise FileNotFoundError(f"{path0}: no event log of rank 0 (is {run_dir} a vidstab run folder?)")
    builder = LedgerBuilder()
    rank0 = [r for r in iter_event_file(path0, notes) if _time(r) is not None]
    # Stable: rank 0's own events keep their file order; another rank's last words go where their time is.
    for rec in sorted(rank0 + _last_words(folder, notes), key=_time):
        builder.feed(rec)
    return builder.result()


def format_table(led: Mapping[str, Any], expected_mtbf_hours: float = 24.0) -> str:
    """The ledger as a plain-text table: one row per bucket, seconds and share of the wall time, per attempt;
    then the checkpoint interval its measurements call for (:mod:`vidstab.run.checkpoint_interval`)."""
    attempts = led["attempts"]
    wall = led["wall_seconds"] or 1.0
    head = f"{'bucket':<12}{'seconds':>10}{'share':>8}" + "".join(f"{'attempt ' + str(a['attempt']):>12}"
                                                                   for a in attempts)
    lines = [head, "-" * len(head)]
    for b in BUCKETS:
        lines.append(f"{b:<12}{led['buckets'][b]:>10.2f}{100 * led['buckets'][b] / wall:>7.1f}%"
                     + "".join(f"{a['buckets'][b]:>12.2f}" for a in attempts))
    lines.append("-" * len(head))
    lines.append(f"{'wall':<12}{led['wall_seconds']:>10.2f}{'100.0%':>8}"
                 + "".join(f"{a['wall_seconds']:>12.2f}" for a in attempts))

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines.append(f"{'ETTR':<12}{pct(led['ettr']):>10}{'':>8}" + "".join(f"{pct(a['ettr']):>12}" for a in attempts))
    s = led["steps"]
    lines.append(f"steps: {s['productive']} productive, {s['skipped']} skipped, {s['rework']} redone later; "
                 f"attempts {len(attempts)}, restarts {led['restarts']}")
    advice = recommend(led, expected_mtbf_hours)
    if advice is not None:
        lines.append(f"checkpoint interval these measurements call for (Young/Daly): every {advice['interval_steps']} "
                     f"steps ({advice['interval_seconds']:.1f} s) from a {advice['save_seconds']:.3f} s save stall, "
                     f"{advice['restart_seconds']:.1f} s per failure, MTBF {advice['mtbf_seconds'] / 3600:.2f} h "
                     f"({advice['failures']} failure(s) seen, from {advice['mtbf_from']}; prior {expected_mtbf_hours:g} h)")
    return "\n".join(lines)


def summary_fields(led: Mapping[str, Any], expected_mtbf_hours: float = 24.0) -> dict:
    """The fields of a ``goodput`` event: the ETTR, the wall time, each bucket's seconds (rounded) and the
    checkpoint interval the measurements call for (``interval``: :func:`vidstab.run.checkpoint_interval.recommend`)."""
    advice = recommend(led, expected_mtbf_hours)
    if advice is not None:
        advice = {k: round(v, 4) if isinstance(v, float) else v for k, v in advice.items()}
    return {"interval": advice, "ettr": None if led["ettr"] is None else round(led["ettr"], 5),
            "wall_seconds": round(led["wall_seconds"], 3),
            "seconds": {b: round(s, 3) for b, s in led["buckets"].items()}, "attempts": len(led["attempts"]),
            "restarts": led["restarts"]}


class GoodputLog:
    """A ``goodput`` event every ``every`` steps and at exit, and the ETTR to the accelerator's trackers as
    ``vidstab/ettr``; on the main process only. ``every=0``: at exit only.

    Incremental: the logs are read whole once (earlier attempts, other ranks' last words), then only the lines
    rank 0 appended since (a live attempt has no last words yet), so a long run pays per new line, not per line."""

    def __init__(self, accelerator: Any, run_dir: str | Path, every: int = 100) -> None:
        self.accelerator, self.run_dir, self.every = accelerator, Path(run_dir), int(every)
        self.main = accelerator is None or bool(getattr(accelerator, "is_main_process", True))
        """Whether this process writes the events (the main process)."""
        self._builder: LedgerBuilder | None = None
        self._offset = 0

    def _new_rank0_events(self, path: Path) -> list[dict]:
        """The complete lines rank 0 appended since the last call (a torn last line waits for its end)."""
        flush_open_logs(path)
        max_line = limits().event_line_bytes
        out, tail = [], b""
        with open(path, "rb") as f:
            f.seek(self._offset)
            while chunk := f.read(1 << 22):
                lines = (tail + chunk).split(b"\n")
                tail = lines.pop()
                self._offset += sum(len(line) + 1 for line in lines)
                for line in lines:
                    if not line.strip() or len(line) > max_line:
                        continue
                    try:
                        rec = loads_bounded(line, path.name)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and _time(rec) is not None:
                        out.append(rec)
                if len(tail) > max_line:  # one line past the bound: never held whole
                    self._offset += len(tail)
                    tail = b""
        return out

    def ledger(self) -> dict:
        """The ledger now (reading only what was appended since the last call)."""
        folder = events_dir(self.run_dir)
        path0 = folder / "events-rank0.jsonl"
        if self._builder is None:
            self._builder = LedgerBuilder()
            rank0 = self._new_rank0_events(path0)
            live = max((_time(r) for r in rank0 if r.get("kind") == "start"), default=math.inf)
            words = [w for w in _last_words(folder, None) if _time(w) < live]  # the earlier attempts'
            for rec in sorted(rank0 + words, key=_time):
                self._builder.feed(rec)
        else:
            for rec in self._new_rank0_events(path0):
                self._builder.feed(rec)
        return self._builder.result()

    def log(self, events: Any, step: int) -> dict | None:
        """Write the ledger as a ``goodput`` event to ``events`` (an EventLog) and its ETTR to the trackers."""
        if not self.main:
            return None
        try:
            fields = summary_fields(self.ledger())
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


__all__ = ["BUCKETS", "GoodputLog", "LedgerBuilder", "format_table", "ledger", "process_start_time", "summary_fields"]
