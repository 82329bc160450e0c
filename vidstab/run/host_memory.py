"""Host memory: each rank's resident memory, a warning before a steady climb reaches the limit, and a data-loader
worker killed by a signal (the kernel's OOM killer sends SIGKILL) recorded as such.

* :func:`resident_mib` reads ``/proc/self/statm`` through a descriptor held open (``pread``): opening the file
  again after a large step costs far more than reading it.
* :class:`HostMemoryWatch` keeps a thinned history of the readings the metrics lines take (every step on the
  main process, every ``rank_log_every`` steps elsewhere) and, when the resident memory climbs steadily, logs one
  ``host_memory_climb`` event and prints one line with the slope and the projected time to the limit (the
  cgroup's ``memory.max`` where one is set, else the machine's ``MemTotal``).
* :func:`worker_killed` recognises the error PyTorch's DataLoader raises when a worker died of a signal; the
  tracked loader (:mod:`vidstab.guard.loader`) logs a ``dataloader_worker_killed`` event with the worker, the
  signal and the history, and raises :class:`DataLoaderWorkerKilled` with one clear message: the process exits
  non-zero, so an elastic launcher restarts the job from its last checkpoint.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..step_numbering import StepNumbering

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_statm: tuple[int, int] | None = None  # (pid, descriptor): a forked child opens its own


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux ``/proc/self/statm``; ``None`` where it cannot be read)."""
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
        return round(int(os.pread(_statm[1], 256, 0).split()[1]) * _PAGE / 2**20, 1)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def process_resident_mib(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MiB (``None`` when it is gone or unreadable)."""
    try:
        with open(f"/proc/{int(pid)}/statm", "rb") as f:
            return round(int(f.read().split()[1]) * _PAGE / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def memory_limit_mib() -> tuple[float | None, str]:
    """``(limit in MiB, where it comes from)``: this process's cgroup ``memory.max`` (v2) or
    ``memory.limit_in_bytes`` (v1) where one is set, else ``MemTotal`` (``None`` where neither can be read)."""
    for path in _cgroup_limit_files():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text and text != "max" and text.isdigit() and int(text) < 2**60:
            return int(text) / 2**20, str(path)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024, "MemTotal"
    except (OSError, ValueError, IndexError):
        pass
    return None, "unknown"


def _cgroup_limit_files() -> list[Path]:
    """The memory-limit files of this process's cgroup (v2 first, then v1), deepest first."""
    files = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            base = Path("/sys/fs/cgroup") / rel
            files += [p / "memory.max" for p in (base, *base.parents) if str(p).startswith("/sys/fs/cgroup")]
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel
            files += [p / "memory.limit_in_bytes" for p in (base, *base.parents)
                      if str(p).startswith("/sys/fs/cgroup/memory")]
    return files


class HostMemoryWatch:
    """A rank's resident-memory readings, thinned to at most ``keep`` samples spread over the whole run, and the
    one warning of a steady climb.

    A climb is steady when the history holds at least ``min_samples`` readings, at least ``rising`` of its
    consecutive pairs did not go down, and the median of its last third exceeds that of its first third by at least
    ``min_growth_mib`` and ``min_growth_fraction`` of the first. Warned once per run (a later, larger climb is the same leak)."""

    def __init__(self, keep: int = 32, min_samples: int = 8, rising: float = 0.8, min_growth_mib: float = 64.0,
                 min_growth_fraction: float = 0.1) -> None:
        self.keep, self.min_samples, self.rising = keep, min_samples, rising
        self.min_growth_mib, self.min_growth_fraction = min_growth_mib, min_growth_fraction
        self.history: list[tuple[float, int, float]] = []  # (time, step, MiB)
        self.stride = 1  # every how many readings one is kept (doubles when the history is thinned)
        self._seen = 0
        self.warned = False

    def observe(self, step: int, rss: float | None, when: float | None = None) -> dict | None:
        """Take one reading; returns the climb's figures the first time the history shows a steady climb."""
        if rss is None:
            return None
        self._seen += 1
        if (self._seen - 1) % self.stride:
            return None
        self.history.append((time.time() if when is None else when, int(step), float(rss)))
        if len(self.history) > self.keep:
            self.history = self.history[::2]
            self.stride *= 2
        if self.warned:
            return None
        climb = self.climb()
        if climb is not None:
            self.warned = True
        return climb

    def climb(self) -> dict | None:
        """The figures of a steady climb over the history, or None."""
        h = self.history
        if len(h) < self.min_samples:
            return None
        third = len(h) // 3
        first, last = _median([m for _, _, m in h[:third]]), _median([m for _, _, m in h[-third:]])
        growth = last - first  # of the medians of the first and the last third: one high reading is no climb
        up = sum(b[2] >= a[2] for a, b in zip(h, h[1:])) / (len(h) - 1)
        if up < self.rising or growth < max(self.min_growth_mib, self.min_growth_fraction * first):
            return None
        per_second = _slope([t for t, _, _ in h], [m for _, _, m in h])
        per_step = _slope([float(s) for _, s, _ in h], [m for _, _, m in h])
        limit, source = memory_limit_mib()
        now = h[-1][2]
        seconds = (limit - now) / per_second if limit is not None and per_second > 0 and limit > now else None
        return {"rss_mib": round(h[-1][2], 1), "growth_mib": round(growth, 1), "since_step": h[0][1],
                "slope_mib_per_s": round(per_second, 4), "slope_mib_per_step": round(per_step, 4),
                "limit_mib": round(limit, 1) if limit is not None else None, "limit_source": source,
                "projected_seconds_to_limit": round(seconds, 1) if seconds is not None else None,
                "history": self.recent()}

    def recent(self) -> list[list[float]]:
        """The kept readings as ``[step, MiB]`` pairs (oldest first)."""
        return [[s, m] for _, s, m in self.history]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (0 when ``xs`` do not vary)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0


def climb_line(rank: int, step: int, c: dict, numbering: Any = None) -> str:
    """The console line of a climb (``numbering``: the guard's, naming the trajectory's step beside the script's)."""
    when = c["projected_seconds_to_limit"]
    eta = f"the limit ({c['limit_mib']:.0f} MiB, {c['limit_source']}) in about {when / 60:.1f} min at this rate" \
        if when is not None else "no limit could be read"
    return (f"vidstab: {(numbering or StepNumbering()).label(step)}, rank {rank}: host memory climbing steadily: {c['rss_mib']:.0f} MiB resident, "
            f"+{c['growth_mib']:.0f} MiB since step {c['since_step']} ({c['slope_mib_per_step']:.2f} MiB/step, "
            f"{c['slope_mib_per_s']:.2f} MiB/s); {eta}. Look for tensors kept across steps (losses kept without "
            f".item(), growing caches) and the data loader's workers")


class DataLoaderWorkerKilled(RuntimeError):
    """A data-loader worker died of a signal (the kernel's OOM killer sends SIGKILL)."""


_KILLED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: (.+?)\s*\.?\s*$|exited unexpectedly)",
                     re.MULTILINE)


def worker_killed(exc: BaseException) -> dict | None:
    """``{"worker_pids": [...], "signal": name or None}`` when ``exc`` is PyTorch's error for a data-loader worker
    that died (killed by a signal, or exited unexpectedly), else None."""
    if not isinstance(exc, RuntimeError):
        return None
    m = _KILLED.search(str(exc))
    if m is None:
        return None
    pids = [int(p) for p in m.group(1).replace(" ", "").split(",") if p]
    sig = m.group(2).strip().rstrip(".") if m.group(2) else _exit_signal(exc, pids)
    return {"worker_pids": pids, "signal": sig}


def _exit_signal(exc: BaseException, pids: list[int]) -> str | None:
    """The signal that ended one of ``pids``, read from the DataLoader iterator's worker processes (found in the
    error's traceback: ``exited unexpectedly`` names no signal)."""
    tb = exc.__traceback__
    while tb is not None:
        workers = getattr(tb.tb_frame.f_locals.get("self"), "_workers", None)
        for w in workers or []:
            code = getattr(w, "exitcode", None)
            if getattr(w, "pid", None) in pids and isinstance(code, int) and code < 0:
                try:
                    return signal.strsignal(-code) or signal.Signals(-code).name
                except (ValueError, AttributeError):
                    return f"signal {-code}"
        tb = tb.tb_next
    return None


class ChildrenMemory:
    """The resident memory of this process's children (a data loader's workers), read every ``every`` calls of
    :meth:`sample` and at the first call of each epoch (:meth:`new_epoch`: a new epoch's workers are new
    processes); the last ``keep`` readings of each, as ``[batch, MiB]``."""

    def __init__(self, every: int = 16, keep: int = 16) -> None:
        self.every, self.keep = every, keep
        self.calls = 0
        self.due = True
        self.history: dict[int, list[list[float]]] = {}

    def new_epoch(self) -> None:
        """The loader starts an epoch: read its workers at the next :meth:`sample`."""
        self.due = True

    def sample(self) -> None:
        self.calls += 1
        if (self.calls - 1) % self.every and not self.due:
            return
        self.due = False
        pid = os.getpid()
        try:
            children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                        for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except (OSError, ValueError):
            return
        for child in children:
            rss = process_resident_mib(child)
            if rss is not None:
                h = self.history.setdefault(child, [])
                h.append([self.calls - 1, rss])
                del h[:-self.keep]
        if len(self.history) > 4 * max(len(children), 1):  # workers of earlier epochs
            self.history = {c: self.history[c] for c in children if c in self.history}


def record_worker_killed(exc: BaseException, events: Any, step: int, rank: int, watch: HostMemoryWatch,
                         workers_rss: dict[int, list[list[float]]]) -> DataLoaderWorkerKilled | None:
    """Log ``dataloader_worker_killed`` for ``exc`` (when it is a dead worker) and return the error to raise."""
    info = worker_killed(exc)
    if info is None:
        return None
    rss = resident_mib()
    history = {str(p): workers_rss.get(p, []) for p in info["worker_pids"]}
    limit, source = memory_limit_mib()
    events.log("dataloader_worker_killed", step, **info, error=str(exc)[:500], rss_mib=rss,
               rss_history=watch.recent(), worker_rss_history=history,
               limit_mib=round(limit, 1) if limit is not None else None, limit_source=source)
    events.flush()
    sig = info["signal"] or "an unexpected exit"
    why = " (SIGKILL: most likely the kernel's out-of-memory killer)" if sig.lower() in ("killed", "sigkill") else ""
    last = {p: h[-1][1] for p, h in workers_rss.items() if h}
    where = (getattr(events, "numbering", None) or StepNumbering()).label(step)  # the guard's log has the numbering
    message = (f"vidstab: {where}, rank {rank}: data-loader worker pid {info['worker_pids']} died of {sig}{why}. "
               f"This rank held {rss} MiB; workers' last readings {last or 'none'} MiB (limit {limit and round(limit)} "
               f"MiB, {source}); the history is in the event log. Fewer num_workers, a smaller prefetch_factor or "
               f"smaller cached samples lower host memory; an elastic launch (--max_restarts) resumes from the last "
               f"checkpoint")
    print(message, file=sys.stderr, flush=True)
    return DataLoaderWorkerKilled(message)
