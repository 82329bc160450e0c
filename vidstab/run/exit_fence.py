"""Let the collective library's worker threads go quiet before the interpreter finalizes.

Why: a 2-process gloo run could end with ``terminate called without an active exception`` (SIGABRT,
exit -6) after all of its work was done -- 2 of 32 runs of ``examples/vidstab_loop.py --fsdp``, 3 of 10 of
a ten-line script that all-gathers a view and exits (``tests/scripts/exit_after_collective.py``). A core
dump shows the mechanism: gloo runs each collective on a worker thread (``ProcessGroupGloo::runLoop``),
which drops its reference to the finished work *after* waking the caller. When the caller's Python
reference to an input tensor is already gone, that drop frees the tensor's Python object, which needs the
GIL; if the main thread has meanwhile returned from the script and begun ``Py_FinalizeEx``, CPython ends
the worker thread with ``pthread_exit`` inside a ``noexcept`` destructor, and C++ calls
``std::terminate``. The window is the worker being descheduled between waking the caller and dropping the
work, so it opens on a busy machine. Upstream: pytorch/pytorch#179291 (an ``atexit`` that destroys the
process groups; abandoned, unmerged). Destroying the groups is not enough here anyway: FSDP2's device mesh
keeps the default group alive in torch's DTensor caches, so its threads outlive ``destroy_process_group``.

What: an ``atexit`` handler, registered by every guard and by the checkpoint manager's gloo group, that
(when this process has collective worker threads at exit; else it returns at once) sleeps in short steps (releasing the GIL, so a worker waiting for it takes it now, while the
interpreter is whole) until no collective worker thread of this process is runnable, twice in a row, or a
bound passes. Linux only (it reads ``/proc/self/task``); elsewhere it returns at once. A quiet run pays
one or two 2 ms sleeps at exit. A worker blocked on a peer (a hung collective) sleeps in the kernel and
does not hold the exit up."""

from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["register_exit_fence", "wait_for_quiet_collective_threads"]

# Thread names torch gives the workers that run collectives and drop their finished work: gloo's
# ``pt_gloo_runloop`` (ProcessGroupGloo::runLoop), NCCL's watchdog ``pt_nccl_watchdg``.
COLLECTIVE_THREAD_PREFIXES = ("pt_gloo_runloop", "pt_nccl_watchdg")
_TASKS = "/proc/self/task"
_registered = False
_lock = threading.Lock()


def _collective_tasks() -> list[str]:
    """Thread ids (``/proc/self/task`` entries) of this process's collective worker threads."""
    tids = []
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(COLLECTIVE_THREAD_PREFIXES):
            tids.append(tid)
    return tids


def _runnable(tid: str) -> bool:
    """Whether the thread is running or waiting for a CPU (state ``R`` in ``/proc/.../stat``; the state
    follows the parenthesised name, which may itself hold spaces)."""
    try:
        with open(f"{_TASKS}/{tid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:stat.rfind(")") + 3] == "R"


def wait_for_quiet_collective_threads(timeout_s: float = 2.0, step_s: float = 0.002, quiet_checks: int = 2) -> bool:
    """Sleep (GIL released) until no collective worker thread is runnable at ``quiet_checks`` checks in a
    row; False if ``timeout_s`` passed first or this is not Linux. Safe to call at any time."""
    if not os.path.isdir(_TASKS):
        return False
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(step_s)  # a worker waiting for the GIL to free a tensor takes it during this sleep
        try:
            busy = any(_runnable(t) for t in _collective_tasks())
        except OSError:
            return False
        quiet = 0 if busy else quiet + 1
        if quiet >= quiet_checks:
            return True
    return False


def _fence_at_exit() -> None:
    # Whether or not the groups were destroyed (end_training): FSDP2's cached mesh keeps their threads.
    if _collective_tasks():
        wait_for_quiet_collective_threads()


def register_exit_fence() -> None:
    """Register the ``atexit`` fence once per process (idempotent; cheap to call from every constructor)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_fence_at_exit)
            _registered = True
