"""One run per output folder: a lock that refuses a second live trainer, and a rule for relaunches.

Two ways to mix two runs in one ``output_dir`` are refused (docs/ARCHITECTURE.md, "Run folder"):

- **Another live trainer holds the folder.** The main process holds an exclusive ``flock`` on
  ``OUTPUT_DIR/.vidstab.lock`` for the life of the run; the file names its holder (host, pid, start time,
  command). A second trainer is refused with the holder's host and pid. The operating system releases the
  lock when the holder dies, however it dies (SIGKILL included), so the lock of a killed run is stale by
  construction and simply taken over (and that is said). ``flock`` works across hosts on NFS (Linux
  emulates it with POSIX locks there); on a file system without locks the lock is not enforced (a warning).
- **The same command twice.** A folder that already holds a vidstab run (an event log or checkpoints) is
  refused unless the launch resumes it (``resume="latest"``, as diffusers' ``--resume_from_checkpoint
  latest``) or asks to start over (``overwrite=True``, as transformers' ``--overwrite_output_dir``): then
  the old run's ``vidstab/`` folder and checkpoints are moved, not deleted, into
  ``OUTPUT_DIR/previous-runs/<UTC time>/``, so no log or checkpoint of two runs is ever mixed.

A folder that cannot be written (a read-only mount, an immutable folder) is refused with one line
(:class:`RunDirNotWritable`) before anything in it changes.

**Run identity.** The first claim of a folder gives the run an id (:func:`run_id`), kept in
``OUTPUT_DIR/.vidstab-run.json`` (next to the lock; it does not make a fresh folder look like an earlier run) and
recorded in every checkpoint's manifest, so a checkpoint of another run (a copied folder, a link) is told
apart from the run's own (see :mod:`vidstab.checkpoint.layout`). Starting over (``overwrite=True``) gives a new
id (the earlier run's id file goes to ``previous-runs/`` with it); a folder whose id file is missing adopts the id its checkpoints carry when they all carry the same one
(checkpoints moved to new storage), else gets a new one.

Every rank calls :func:`claim_run_dir` together; the main process decides and every rank raises the same
error, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..files.atomic import write_json_atomic
from .elastic import LaunchInfo, check_world_size

__all__ = ["RunDirError", "RunDirInUse", "RunDirNotEmpty", "RunDirNotWritable", "RunDirLock", "claim_run_dir", "run_id",
           "RUN_ID_FILE", "RUN_ID_RE", "LOCK_FILE", "PREVIOUS_RUNS"]

logger = logging.getLogger("vidstab.run.run_dir")

LOCK_FILE = ".vidstab.lock"
PREVIOUS_RUNS = "previous-runs"
RUN_ID_FILE = ".vidstab-run.json"
"""The run's identity (``{"run_id", "created"}``), relative to the output folder."""
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a run id looks like (a manifest's ``run_id`` that does not is a damaged manifest)."""
_HELD: dict[str, "RunDirLock"] = {}  # realpath -> lock: the fd must stay open for the life of the process


class RunDirError(RuntimeError):
    """The output folder cannot be used for this launch (the message says why and what to do)."""


class RunDirInUse(RunDirError):
    """Another live trainer holds the output folder."""


class RunDirNotEmpty(RunDirError):
    """The output folder holds an earlier run and this launch neither resumes it nor asks to start over."""


class RunDirNotWritable(RunDirError):
    """The output folder cannot be written (read-only mount, immutable folder, no permission)."""


@dataclass
class RunDirLock:
    """The claim on one output folder, held by the main process (a no-op object on the other ranks)."""

    output_dir: str
    """Absolute path of the output folder."""
    fd: int | None = None
    """Open file descriptor holding the ``flock`` (main process only)."""
    took_over: dict | None = None
    """The holder record of a dead run whose lock was taken over, else None."""
    moved_to: str | None = None
    """Where ``overwrite=True`` moved the earlier run, else None."""
    holder: dict = field(default_factory=dict)
    """This process's holder record, as written into the lock file."""
    run_id: str | None = None
    """The run's identity (:func:`run_id`; main process only)."""

    def release(self) -> None:
        """Release the lock (also done by the OS when the process ends)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, (json.dumps(dict(self.holder, released=time.time())) + "\n").encode(), 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None
            _HELD.pop(os.path.realpath(self.output_dir), None)

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def earlier_run(output_dir: str | os.PathLike, checkpoint_subdir: str | None = None) -> list[str]:
    """What in ``output_dir`` belongs to an earlier vidstab run: its ``vidstab/`` folder (event logs,
    incidents, recovery state) and its checkpoint folder, where they hold anything. Empty for a fresh folder."""
    if checkpoint_subdir is None:
        from ..checkpoint import CheckpointConfig

        checkpoint_subdir = CheckpointConfig().subdir
    found = []
    for sub in ("vidstab", checkpoint_subdir):
        p = os.path.join(output_dir, sub)
        try:
            if os.path.isdir(p) and any(not n.startswith(".") for n in os.listdir(p)):
                found.append(sub)
        except OSError:
            continue
    return found


def claim_run_dir(accelerator: Any, output_dir: str | os.PathLike, *, resume: Any = None, overwrite: bool = False,
                  checkpoint_subdir: str | None = None) -> RunDirLock:
    """Claim ``output_dir`` for this run, before anything is written into it; every rank calls it.

    Args:
        accelerator: the run's ``Accelerator`` (None for a single process without one).
        output_dir: the run's output folder (created if missing).
        resume: what the launch resumes from (e.g. ``args.resume_from_checkpoint``); truthy allows
            continuing an earlier run in the folder.
        overwrite: start over in a folder that holds an earlier run; it is moved to
            ``previous-runs/<UTC time>/`` first, never deleted.
        checkpoint_subdir: the checkpoint folder under ``output_dir`` (default: ``CheckpointConfig().subdir``).

    Raises:
        RunDirInUse: another live trainer holds the folder (the message names its host and pid).
        RunDirNotEmpty: an earlier run is there and the launch neither resumes nor overwrites it.
        RunDirNotWritable: the folder cannot be written (nothing in it was changed).
        vidstab.run.elastic.LaunchMismatch: the launcher started more processes than the Accelerator joined.
    """
    if accelerator is not None:
        check_world_size(accelerator.num_processes)  # a launch that did not join: say so, not "folder in use"
    output_dir = os.path.abspath(os.fspath(output_dir))
    is_main = accelerator is None or accelerator.is_main_process
    error: RunDirError | None = None
    lock = RunDirLock(output_dir)
    if is_main:
        try:
            lock = _claim_on_main(output_dir, resume, overwrite, checkpoint_subdir)
        except RunDirError as e:
            error = e
    code = {None: 0, RunDirInUse: 1, RunDirNotEmpty: 2, RunDirNotWritable: 3}[type(error) if error else None]
    code = _broadcast_code(accelerator, code)
    if error is not None:
        raise error
    if code:
        cls = {1: RunDirInUse, 2: RunDirNotEmpty}.get(code, RunDirNotWritable)
        raise cls(f"output_dir {output_dir} refused by the main process (its message says why)")
    return lock


def _claim_on_main(output_dir: str, resume: Any, overwrite: bool, checkpoint_subdir: str | None) -> RunDirLock:
    real = os.path.realpath(output_dir)
    if real in _HELD:  # this process already holds it (e.g. the loop claims once per launch and again per stage)
        return _HELD[real]
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _not_writable(output_dir, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirInUse(
                f"output_dir {output_dir} is in use by another trainer (host {holder.get('host', '?')}, pid "
                f"{holder.get('pid', '?')}, since {_when(holder.get('started'))}: {holder.get('command', '?')}). "
                f"Two runs writing one folder would mix their checkpoints and logs; wait for it, stop it, or choose "
                f"another --output_dir.") from None
        logger.warning("cannot lock %s (%s): this file system has no locks, so a second trainer in the same "
                       "folder would not be noticed", path, e)
    previous = _read_holder(fd)
    took_over = previous if previous and "released" not in previous else None
    if took_over:
        logger.warning("took over the lock of a run that is gone (host %s, pid %s, since %s): its lock was "
                       "released when it died", took_over.get("host"), took_over.get("pid"), _when(took_over.get("started")))
    lock = RunDirLock(output_dir, fd=fd, took_over=took_over)
    try:
        earlier = earlier_run(output_dir, checkpoint_subdir)
        if earlier and not resume:
            if not overwrite:
                raise RunDirNotEmpty(
                    f"output_dir {output_dir} already holds a run ({', '.join(s + '/' for s in earlier)}). Running "
                    f"the same command again would start over on top of it and mix two runs. Resume it with "
                    f"--resume_from_checkpoint latest (resume='latest'), or start over with --overwrite_output_dir "
                    f"(overwrite=True: the earlier run is moved to {PREVIOUS_RUNS}/, not deleted), or choose another "
                    f"--output_dir.{_restart_advice()}")
            lock.moved_to = _move_aside(output_dir, earlier)
            logger.warning("overwrite: the earlier run in %s was moved to %s", output_dir, lock.moved_to)
        lock.run_id = run_id(output_dir, new=lock.moved_to is not None, checkpoint_subdir=checkpoint_subdir)
    except OSError as e:
        lock.fd = None
        os.close(fd)
        raise _not_writable(output_dir, e) from None
    except BaseException:
        lock.fd = None
        os.close(fd)
        raise
    lock.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                   "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(lock.holder) + "\n").encode(), 0)
    os.fsync(fd)
    _HELD[os.path.realpath(output_dir)] = lock
    return lock


def _not_writable(output_dir: str, e: OSError) -> RunDirNotWritable:
    where = f": {e.filename}" if e.filename else ""
    return RunDirNotWritable(
        f"output_dir {output_dir} cannot be written ({e.strerror or e}{where}); a read-only mount or an immutable "
        f"folder? Nothing in it was changed. Make it writable, or choose another --output_dir.")


def run_id(output_dir: str | os.PathLike, *, new: bool = False, create: bool = True,
           checkpoint_subdir: str | None = None) -> str | None:
    """The id of the run in ``output_dir`` (from :data:`RUN_ID_FILE`). Missing or unreadable (and ``create``):
    the single run id that the checkpoints under ``checkpoint_subdir`` (default: ``CheckpointConfig().subdir``)
    carry is adopted, else a new one is made; ``new``: always a new one (starting over). The file is written
    atomically; raises OSError when it cannot be. Without ``create``: None when there is none."""
    path = os.path.join(os.fspath(output_dir), RUN_ID_FILE)
    found = None if new else _read_run_id(path)
    if found or not create:
        return found
    rid = None if new else _adopted_run_id(os.fspath(output_dir), checkpoint_subdir)
    if rid:
        logger.warning("run identity file %s is missing; adopted the run id %s that the checkpoints in %s carry",
                       path, rid, output_dir)
    rid = rid or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)
    write_json_atomic(path, {"run_id": rid, "created": time.time()})
    return rid


def _read_run_id(path: str) -> str | None:
    try:
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 4096:
            return None
        with open(path, "rb") as f:
            rid = json.loads(f.read(4097).decode("utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        logger.warning("run identity file %s is unreadable", path)
        return None
    return rid if isinstance(rid, str) and RUN_ID_RE.fullmatch(rid) else None


def _adopted_run_id(output_dir: str, checkpoint_subdir: str | None) -> str | None:
    from ..checkpoint import CheckpointConfig, layout  # the checkpoint package imports this module: import late

    root = os.path.join(output_dir, checkpoint_subdir or CheckpointConfig().subdir)
    ids = {i.manifest.get("run_id") for i in layout.list_checkpoints(root)} - {None}
    return ids.pop() if len(ids) == 1 else None


def _restart_advice() -> str:
    """On a torch-elastic restart, what the launch line lacks: the restart runs the same command again."""
    launch = LaunchInfo.from_env()
    if not launch.is_restart:
        return ""
    return (f" This is torch-elastic restart {launch.restart_count} of {launch.max_restarts}: it runs the launch's command "
            f"again, so a launch under --max_restarts must pass --resume_from_checkpoint latest (resume='latest') for "
            f"every restart to resume; a first launch with it starts from scratch (docs/faults.md).")


def _move_aside(output_dir: str, entries: list[str]) -> str:
    dest = os.path.join(output_dir, PREVIOUS_RUNS, time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    n, base = 1, dest
    while os.path.exists(dest):
        n += 1
        dest = f"{base}-{n}"
    os.makedirs(dest)
    for sub in entries:
        if any(sub.startswith(other.rstrip("/") + "/") for other in entries if other != sub):
            continue  # inside another entry (the checkpoints under vidstab/): it moves with it
        shutil.move(os.path.join(output_dir, sub), os.path.join(dest, sub))
    if os.path.isfile(os.path.join(output_dir, RUN_ID_FILE)):  # the earlier run's identity goes with it
        shutil.copy2(os.path.join(output_dir, RUN_ID_FILE), os.path.join(dest, RUN_ID_FILE))
    return dest


def _read_holder(fd: int) -> dict:
    for _ in range(3):  # the holder may be writing its record right now
        try:
            raw = os.pread(fd, 4096, 0)
            return json.loads(raw.decode("utf-8")) if raw.strip() else {}
        except (OSError, ValueError, UnicodeDecodeError):
            time.sleep(0.05)
    return {}


def _when(t: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
    except (TypeError, ValueError):
        return "?"


def _broadcast_code(accelerator: Any, code: int) -> int:
    if accelerator is None or accelerator.num_processes == 1:
        return code
    import torch
    from accelerate.utils import broadcast

    t = torch.tensor([code], dtype=torch.int64, device=accelerator.device)
    return int(broadcast(t, from_process=0).item())
