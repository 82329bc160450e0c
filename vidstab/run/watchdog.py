"""Hang watchdog: a rank that stops making progress dumps every thread's stack and exits, so the job restarts.

A rank that hangs (a data loader that never returns, a collective whose peer is gone, a deadlock) burns
accelerator hours until a collective timeout fires, if one ever does (NCCL's default is 10 minutes, gloo's
30). NVIDIA's resiliency extension (nvidia-resiliency-ext, "in-process restart" and "hang detection") shows
the remedy: each rank reports its progress, a watchdog notices when it stops, and the launcher restarts the
job. Here the rank reports with :meth:`Watchdog.beat` (``step`` and ``phase``: ``data``, ``forward_backward``,
``guard``, ``checkpoint``); a daemon thread compares the time since the last beat with a deadline set at that
beat. Nothing crosses processes, so there is no collective on the hot path: a beat is a clock read and a few
attribute stores.

The deadline is derived from what the run has shown, with generous margins (every number settable in
:class:`WatchdogConfig`):

- outside checkpoints: ``max(timeout_s, multiple x the slowest step seen so far)`` -- checkpoint time
  excluded, so one slow save does not blunt the step deadline;
- in the ``checkpoint`` phase: ``max(timeout_s, multiple x the slowest checkpoint phase seen so far)``;
- before the first step (or the first checkpoint) has completed: ``max(timeout_s, first_step_s)``, for
  compilation, data warm-up and the first save.

The slowest time only grows, so a rank that becomes slow but keeps going moves its own deadline out: a
healthy slow rank is never killed (``tests/test_watchdog.py``).

On a hang the watchdog writes ``RUN_DIR/vidstab/hang-rank{R}-step{S}.txt`` (what it saw, then every
thread's Python stack from :mod:`faulthandler`), logs a ``hang`` event, and ends the process with
``os._exit(exit_code)`` -- ``75``, ``EX_TEMPFAIL`` of BSD ``sysexits.h`` ("temporary failure; the user is
invited to retry"). Torch elastic (``accelerate launch --max_restarts N`` / ``torchrun --max_restarts N``)
restarts the whole worker group on any non-zero worker exit, and the trainer then resumes from the latest
checkpoint (:mod:`vidstab.run.elastic`). ``os._exit`` and not an exception: a hung main thread never reaches
the code that would handle one.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..events import events_dir, log_event

__all__ = ["WATCHDOG_EXIT_CODE", "PHASES", "WatchdogConfig", "Watchdog"]

logger = logging.getLogger("vidstab.run.watchdog")

WATCHDOG_EXIT_CODE = 75
"""Exit status of a rank ended by the watchdog: ``EX_TEMPFAIL`` (``sysexits.h``). Any non-zero worker exit makes
torch elastic restart the group; this one says "hung" in the launcher's failure summary."""

PHASES = ("data", "forward_backward", "guard", "checkpoint")
"""Phases the reference trainer reports. Any string is accepted; only ``checkpoint`` is timed apart."""

CHECKPOINT_PHASE = "checkpoint"


@dataclass
class WatchdogConfig:
    """How long a rank may go without progress before the watchdog declares it hung."""

    timeout_s: float = 300.0
    """Floor: never declare a hang sooner than this many seconds after the last beat."""
    multiple: float = 10.0
    """... nor sooner than this multiple of the slowest step (or, in the checkpoint phase, the slowest checkpoint) seen."""
    first_step_s: float = 900.0
    """Allowance until the first step (and the first checkpoint) has completed: compilation, data warm-up, first save."""
    poll_s: float | None = None
    """How often the thread looks; default ``min(1, timeout_s / 10)``."""
    exit_code: int = WATCHDOG_EXIT_CODE
    """Exit status of a hung rank (non-zero, so the elastic launcher restarts the group)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "multiple", "first_step_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"WatchdogConfig.{name} must be a positive number of seconds/times, got {value!r}")
        if self.poll_s is not None and not self.poll_s > 0:
            raise ValueError(f"WatchdogConfig.poll_s must be > 0, got {self.poll_s!r}")
        if not 0 < int(self.exit_code) < 256:
            raise ValueError(f"WatchdogConfig.exit_code must be in 1..255, got {self.exit_code!r}")


class Watchdog:
    """Per-rank hang watchdog (a daemon thread). Use as a context manager, or :meth:`start` / :meth:`stop`.

    Args:
        run_dir: the run folder; stacks go to ``RUN_DIR/vidstab/hang-rank{R}-step{S}.txt``, the event to
            the rank's event log.
        rank: this process's rank (names the files and the event).
        config: timeouts; see :class:`WatchdogConfig`.
        on_hang: called from the watchdog thread with the ``hang`` event just before the process exits
            (tests, custom alerting). The process exits whatever it does.

    Example::

        with Watchdog(output_dir, rank=accelerator.process_index) as wd:
            for step, batch in enumerate(loader):
                wd.beat(step, "forward_backward")
                ...
    """

    def __init__(self, run_dir: str | Path, rank: int = 0, config: WatchdogConfig | None = None,
                 on_hang: Callable[[dict], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.config = config or WatchdogConfig()
        self.on_hang = on_hang
        self.step = -1
        self.phase = "start"
        self.slowest_step_s = 0.0
        self.slowest_checkpoint_s = 0.0
        now = time.monotonic()
        self._phase_t = now
        self._step_acc = 0.0  # time in non-checkpoint phases of the current step
        self._ckpt_acc = 0.0  # time in the current checkpoint phase
        self._deadline = math.inf  # monotonic time after which the rank counts as hung; set by each beat
        self._last_beat = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: dict | None = None

    # -- the hot path ------------------------------------------------------------------------------------
    def beat(self, step: int, phase: str) -> None:
        """Record progress: this rank is now in ``phase`` of optimizer step ``step``.

        A change of ``step`` completes a step (a rollback's jump back counts too). Cheap: no lock, no I/O.
        """
        now = time.monotonic()
        elapsed = now - self._phase_t
        if self.phase == CHECKPOINT_PHASE:
            self._ckpt_acc += elapsed
            if phase != CHECKPOINT_PHASE:
                self.slowest_checkpoint_s = max(self.slowest_checkpoint_s, self._ckpt_acc)
                self._ckpt_acc = 0.0
        elif self.phase != "start":
            self._step_acc += elapsed
        if step != self.step:
            if self.step >= 0 or self.phase != "start":
                self.slowest_step_s = max(self.slowest_step_s, self._step_acc)
            self._step_acc = 0.0
            self.step = step
        self.phase = phase
        self._phase_t = now
        self._last_beat = now
        self._deadline = now + self.timeout_for(phase)

    def timeout_for(self, phase: str) -> float:
        """Seconds without a beat after which a rank in ``phase`` counts as hung, from what was seen so far."""
        cfg = self.config
        seen = self.slowest_checkpoint_s if phase == CHECKPOINT_PHASE else self.slowest_step_s
        if seen <= 0.0:
            return max(cfg.timeout_s, cfg.first_step_s)
        return max(cfg.timeout_s, cfg.multiple * seen)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No hang can be declared inside this block (an evaluation or upload of unknown length); the next beat re-arms."""
        self._deadline = math.inf
        try:
            yield
        finally:
            now = time.monotonic()
            self._phase_t = now
            self._last_beat = now
            self._deadline = now + self.timeout_for(self.phase)

    # -- the thread ---------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        """Start the thread; the first deadline is the first-step allowance."""
        if self._thread is None:
            self._last_beat = self._phase_t = time.monotonic()
            self._deadline = self._last_beat + self.timeout_for(self.phase)
            self._thread = threading.Thread(target=self._watch, name=f"vidstab-watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (the run finished or is exiting on its own)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _watch(self) -> None:
        poll = self.config.poll_s or min(1.0, self.config.timeout_s / 10)
        while not self._stop.wait(poll):
            if time.monotonic() > self._deadline:
                self._fire()
                return

    def _fire(self) -> None:
        silent = time.monotonic() - self._last_beat
        step, phase, timeout = self.step, self.phase, self.timeout_for(self.phase)
        folder = events_dir(self.run_dir)
        stacks = folder / f"hang-rank{self.rank}-step{max(step, 0):06d}.txt"
        header = (f"vidstab watchdog: rank {self.rank} made no progress for {silent:.1f} s in phase {phase!r} of step "
                  f"{step} (timeout {timeout:.1f} s: max(floor {self.config.timeout_s:g} s, {self.config.multiple:g} x "
                  f"slowest {'checkpoint' if phase == CHECKPOINT_PHASE else 'step'} "
                  f"{self.slowest_checkpoint_s if phase == CHECKPOINT_PHASE else self.slowest_step_s:.2f} s) or the "
                  f"first-step allowance {self.config.first_step_s:g} s); exiting with {self.config.exit_code} so the "
                  f"launcher restarts the job (docs/runbook.md, 'A rank hung').\n")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(stacks, "w", encoding="utf-8") as f:
                f.write(header + "\nPython stacks of every thread (most recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a full disk must not keep a hung rank alive
            logger.error("watchdog could not write %s: %s", stacks, exc)
        sys.stderr.write(header)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
        event = {"phase": phase, "seconds_without_progress": round(silent, 2), "timeout_s": round(timeout, 2),
                 "slowest_step_s": round(self.slowest_step_s, 4), "slowest_checkpoint_s": round(self.slowest_checkpoint_s, 4),
                 "stacks": str(stacks.relative_to(self.run_dir)), "exit_code": self.config.exit_code}
        log_event(self.run_dir, self.rank, "hang", max(step, 0), **event)
        self.fired = event
        if self.on_hang is not None:
            try:
                self.on_hang(event)
            except Exception as exc:  # noqa: BLE001 -- the process exits regardless
                logger.error("watchdog on_hang callback failed: %r", exc)
        os._exit(self.config.exit_code)
