"""Graceful preemption: turn SIGTERM/SIGINT into a "stop after this step" request.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM some seconds before killing a job. The
handler must not save or raise from inside the signal handler: the signal can arrive in the middle of
a collective or of a checkpoint write. It only sets a flag and calls ``on_signal`` (the trainer passes
``guard.request_stop``, which makes every rank agree on the step to stop at through the guard's
per-step reduction); the loop then saves a checkpoint and exits 0.

A second SIGINT restores the default behaviour and re-raises it, so Ctrl-C twice still kills a run
that is stuck.

Schedulers signal the *launcher*, not the trainer. Measured with torch 2.13 / accelerate 1.15
(docs/faults.md): torch elastic (``torchrun``, ``accelerate launch`` with 2 or more
processes) forwards SIGTERM to every worker and SIGKILLs them 30 s later; a 1-process ``accelerate launch``
dies at once and leaves the trainer running as an orphan that no one signals. With ``watch_parent=True`` a
daemon thread notices that the parent process is gone (``os.getppid()`` changed: the orphan was re-parented)
and sends this process SIGTERM, so the orphan stops at the next step boundary the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable

__all__ = ["PreemptionHandler"]

logger = logging.getLogger("vidstab.run.preemption")


class PreemptionHandler:
    """Context manager installing SIGTERM/SIGINT handlers that request a clean stop.

    Args:
        on_signal: called (from the signal handler, in the main thread) on the first signal; keep it
            cheap and non-blocking, e.g. ``guard.request_stop``.
        signals: the signals to handle (default SIGTERM and SIGINT).

    Attributes:
        stop_requested: True once a signal arrived.
        received: the number of the first signal received, or None.

    Outside the main thread (where Python cannot install handlers) it does nothing but log a warning.
    """

    def __init__(self, on_signal: Callable[[], None] | None = None,
                 signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), watch_parent: bool = False,
                 parent_poll_s: float = 0.5) -> None:
        self.on_signal = on_signal
        self.watch_parent = watch_parent
        self.parent_poll_s = parent_poll_s
        self.parent_lost = False
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.signals = tuple(signals)
        self.stop_requested = False
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._sigint_count = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                # Second Ctrl-C: give the user the default behaviour back and deliver it now.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.raise_signal(signal.SIGINT)
                return
        first = not self.stop_requested
        self.stop_requested = True
        if first:
            self.received = signum
            logger.warning("received %s: stopping after the current step (checkpoint, then exit)",
                           signal.Signals(signum).name)
            if self.on_signal is not None:
                self.on_signal()

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            logger.warning("PreemptionHandler outside the main thread: signals not handled")
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        if self.watch_parent and signal.SIGTERM in self.signals:
            parent = os.getppid()
            self._watcher = threading.Thread(target=self._watch, args=(parent,), name="vidstab-parent-watch", daemon=True)
            self._watcher.start()
        return self

    def _watch(self, parent: int) -> None:
        while not self._watch_stop.wait(self.parent_poll_s):
            if os.getppid() != parent:
                self.parent_lost = True
                logger.warning("the launcher (pid %d) is gone: stopping as if it had sent SIGTERM", parent)
                # Process-directed, so the handler runs in the main thread between two bytecodes, as for a real signal.
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def __exit__(self, *exc: object) -> None:
        self._watch_stop.set()
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
