"""The checkpoint manager: the one place that runs collectives, so every rank takes the same path.

All ranks call :meth:`CheckpointManager.save`, :meth:`~CheckpointManager.wait` and
:meth:`~CheckpointManager.load` together. A save is: agree on a nonce and on the snapshot (a failure on
any rank fails the save on all), write this rank's files (:mod:`.writer`, in a background thread for async
saves), let the main process learn every rank's digests, publish. The next ``save``/``wait``/``load`` joins
the writer and all ranks agree (one small all-reduce) on whether it succeeded, so a failure on any rank
raises :class:`CheckpointError` on all ranks at the same call instead of leaving them out of step.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import secrets
import shutil
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from ..run import run_dir
from ..files import statedict_io as sio
from ..files.atomic import fsync_paths
from ..engines.deepspeed_support import DeepSpeedUnsupported
from ..engines import Engine, engine_for
from ..events import flush_log, log_event
from ..run.exit_fence import register_exit_fence
from ..files.limits import read_json_file
from . import layout
from .config import CheckpointConfig, CheckpointError, CheckpointInfo
from .consistency import ensure_identical
from .dcp_backend import ShardedBackend, is_optimizer
from .full_state import FullStateBackend
from .layout import RESERVED, file_stem, rel, step_name
from .memory_copy import MemoryCopy, default_budget_bytes
from .reader import read_checkpoint
from .writer import SaveJob, publish, rotate, write_files, write_manifest

__all__ = ["CheckpointManager"]

logger = logging.getLogger("vidstab.checkpoint")


UNVERIFIED_ADVICE = (" Restore their manifests (or the files that disagree), or start over with --overwrite_output_dir "
                     "and without --resume_from_checkpoint (overwrite=True: the earlier run, these folders included, is "
                     "moved to previous-runs/, not deleted)")
"""What a launch can do about unverifiable checkpoints; a rollback's abort leaves it out (a running loop can do neither)."""


class CheckpointManager:
    """Atomic, validated, rotated checkpoints of everything registered, plus scaler and RNG states.

    All ranks must construct it together (at world size > 1 it creates its own gloo process group) and
    call :meth:`save`, :meth:`wait` and :meth:`load` together (they contain collectives).

    Example::

        ckpt = CheckpointManager(accelerator, output_dir, CheckpointConfig(keep=3))
        ckpt.register("model", model); ckpt.register("optimizer", optimizer)
        ckpt.register("lr_scheduler", lr_scheduler); ckpt.register("vidstab", guard)
        trainer_state = ckpt.load("latest")   # None on a fresh run; logs a ``resume`` event otherwise
        ...
        ckpt.save(step, healthy=guard.healthy, trainer_state={"step": step, "epoch": e, "batch": i})
        ...
        ckpt.wait()

    ``guard.healthy`` (:class:`vidstab.Guard`) is False while the guard has seen trouble recently; such a
    checkpoint is kept but never a rollback target. Without a guard, pass ``healthy=True``.

    A resume refuses a checkpoint written by another number of processes (``CheckpointError`` saying so):
    per-rank data positions, RNG streams and an LR scheduler stepped once per process per optimizer step
    all depend on it. ``CheckpointConfig(allow_world_size_change=True)`` loads anyway, for a loop that
    re-derives those itself.
    """

    def __init__(self, accelerator, output_dir: str, config: CheckpointConfig | None = None,
                 config_hash: str | None = None) -> None:
        self.accelerator = accelerator
        self.output_dir = os.path.abspath(output_dir)
        self.config = config or CheckpointConfig()
        if self.config.keep < 1:
            raise ValueError("CheckpointConfig.keep must be >= 1")
        if self.config.checksum not in sio.CHECKSUMS:
            raise ValueError(f"CheckpointConfig.checksum must be one of {sio.CHECKSUMS}, not {self.config.checksum!r}")
        self.config_hash = config_hash
        self.root = os.path.join(self.output_dir, self.config.subdir)
        self.rank = accelerator.process_index
        self.world_size = accelerator.num_processes
        self.node_local = node_local_folders(accelerator)
        self.is_main = accelerator.is_local_main_process if self.node_local else accelerator.is_main_process
        """Whether this process publishes the checkpoint folder (writes the replicated files and the manifest,
        renames, moves the pointers, rotates): the main process, or with ``save_on_each_node=True`` each
        node's local main process, into that node's folder (see :func:`node_local_folders`)."""
        self.node = self.rank - accelerator.local_process_index
        """The rank of this node's local main process (torch launchers number a node's ranks contiguously)."""
        self.engine = _engine_of(accelerator)
        """What differs between DDP, FSDP2 and DeepSpeed (:mod:`vidstab.engines`): which backend saves and loads,
        what a save checks, what is refused."""
        self.backends = self.engine.checkpoint_backends(self.config)
        """Every backend this engine's checkpoints may use, by the name their manifests record."""
        self.full_state: FullStateBackend = self.backends[FullStateBackend.name]
        self.sharded: ShardedBackend = self.backends[ShardedBackend.name]
        for backend in self.backends.values():
            backend.is_main = self.is_main
            backend.node_local = self.node_local
        self.group = _checkpoint_group(self.world_size, self.config.rank_timeout_s)
        """Dedicated gloo process group for the writer's collectives (None at world size 1): they run in a
        background thread while training uses the default group, and a dead peer errors within seconds."""
        self.run_id = self._agree_run_id()
        """The run's identity (:func:`vidstab.run.run_dir.run_id`, rank 0's), recorded in every manifest; another
        run's checkpoints are refused (``CheckpointConfig.allow_other_run``). None: the run folder holds none
        and cannot be given one (checkpoints are then not told apart by run)."""
        self._warned_unidentified = False
        self._objects: dict[str, Any] = {}
        self._deleters: list[threading.Thread] = []
        # One long-lived writer thread, started at the first async save: starting a thread per save made
        # ``save`` wait for the new thread's start-up while DCP's own thread held the GIL.
        self._writer: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[tuple[SaveJob, threading.Event]] = queue.SimpleQueue()
        self._job_done: threading.Event | None = None  # set by the writer when the pending async job is done
        self._job: SaveJob | None = None
        self.last_saved: str | None = None
        """Path of the newest checkpoint this manager finished writing."""
        self.last_loaded: dict | None = None
        """``{"path", "step", "trajectory_step", "skipped": [[path, reason], ...], ...}`` of the last :meth:`load`."""
        self._head: dict | None = None  # {"name", "sequence"}: what the next save's state descends from
        budget = self.config.rollback_memory_budget_bytes
        self.memory = None if budget == 0 else MemoryCopy(default_budget_bytes() if budget is None else budget)
        """The newest healthy checkpoint kept in host memory for rollbacks (:mod:`.memory_copy`); None: off."""
        self.after_files_written: Callable[[int], None] | None = None
        """Called with the step on each rank once its files of a save are written, before the ranks agree
        on it (in the writer thread for async saves). For drills: ``vidstab.faults``' ``kill_in_save``
        kills a rank there."""
        if self.is_main:
            os.makedirs(self.root, exist_ok=True)
            if self.config.remove_stale:
                layout.remove_stale(self.root)

    def _agree_run_id(self) -> str | None:
        """Rank 0 reads (or creates) the run id; every rank gets rank 0's (one broadcast at construction)."""
        rid = None
        if self.accelerator.is_main_process:
            try:
                rid = run_dir.run_id(self.output_dir, checkpoint_subdir=self.config.subdir)
            except OSError as e:
                rid = run_dir.run_id(self.output_dir, create=False)
                if rid is None:
                    logger.warning("cannot record a run id in %s (%s): this run's checkpoints will not be told "
                                   "apart from another run's", self.output_dir, e)
        if self.group is None:
            return rid
        import torch.distributed as dist

        buf = torch.zeros(64, dtype=torch.uint8)
        if rid:
            buf[: len(rid)] = torch.frombuffer(bytearray(rid.encode("ascii")), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return bytes(buf.numpy()).rstrip(b"\0").decode("ascii") or None

    # ------------------------------------------------------------------ registration
    def register(self, name: str, obj: Any) -> None:
        """Register an object to save/load under ``name``.

        ``torch.nn.Module`` (prepared/wrapped is fine) -> ``{name}.safetensors`` from
        ``accelerator.get_state_dict``, loaded with ``strict=True`` into the unwrapped model.
        Anything else with ``state_dict``/``load_state_dict`` (optimizer, scheduler, EMA, guard) ->
        ``{name}.json`` (+ ``{name}.safetensors`` when it holds tensors). ``lr_scheduler`` is stored as
        ``scheduler.*``.
        """
        stem = file_stem(name)
        if stem in RESERVED or stem.startswith("rng-") or not re.fullmatch(r"[A-Za-z0-9_.-]+", stem):
            raise ValueError(f"cannot register {name!r}: reserved or not a plain file name")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name!r}: object needs state_dict() and load_state_dict()")
        self.engine.refuse_registered(name, obj)
        self._objects[name] = obj

    def holds(self, obj: Any) -> bool:
        """Whether ``obj`` is registered: saved with every checkpoint and restored by every load."""
        return any(o is obj for o in self._objects.values())

    @property
    def backend(self) -> FullStateBackend:
        """The backend the next save uses, the engine's choice: sharded (DCP) when a registered model has DTensor
        parameters (FSDP2) or ``CheckpointConfig.sharded`` says so, else full state; DeepSpeed's under DeepSpeed."""
        return self.engine.save_backend(self.backends, self._objects, self.config)

    def _backend_of(self, manifest: dict) -> FullStateBackend:
        return self.engine.load_backend(manifest.get("backend"), self.backends)

    # ------------------------------------------------------------------ save
    def save(self, step: int, healthy: bool = True, trainer_state: dict | None = None,
             trajectory_step: int | None = None) -> str:
        """Save a checkpoint of ``step``; returns the final folder path (complete once :meth:`wait` returns
        when saving asynchronously). Raises :class:`CheckpointError` for a failure of this save (sync)
        or of the previous async one.

        ``step`` is the script's step (the folder's name, the manifest's ``step``, the ``checkpoint`` event's);
        ``trajectory_step`` the trajectory's, where in-place rollbacks made the two differ (the attached form:
        :mod:`vidstab.step_numbering`), recorded in the manifest and returned by :meth:`load` beside it."""
        # ONE agreement of all ranks before anything is written (each collective adds to the stall):
        # the previous async save's outcome, whether the parameters are finite, this snapshot's outcome,
        # and the folder nonce (rank 0's, the others add 0).
        entered = time.perf_counter()  # waiting for the previous async write blocks the loop too
        prev_job, prev_err = self._join_pending()
        step = int(step)
        t0 = time.perf_counter()
        name = step_name(step)
        copy = self.config.async_save
        backend = self.backend
        # An async sharded save checks the parameters on its staged copy, in the writer thread (the ranks'
        # answers join the "files written" exchange): not on the loop's time.
        check_staged = copy and self.config.check_params_finite and backend is self.sharded
        finite_here = self._params_finite_here() if self.config.check_params_finite and not check_staged else True
        files = []
        error: Exception | None = None
        # The copy kept for rollbacks is the snapshot's own host copy: full state, or an async sharded save's staging.
        keep_copy = self.memory is not None and (backend is self.full_state or (backend is self.sharded and copy))
        keep_copy = keep_copy and not self.memory.over_budget  # declined, said at the first rollback
        if self.memory is not None and not keep_copy and not self.memory.over_budget:
            self.memory.decline(f"{backend.name} checkpoints roll back from their files"
                                + (" (a synchronous sharded save stages no host copy)" if backend is self.sharded else ""))
        if self.memory is not None:  # this save replaces the held folder of the same step (after a rollback)
            self.memory.drop(name)
        kept: list = []
        if prev_err is None:  # a failed previous save is reported below: no snapshot for a save that won't happen
            try:
                os.makedirs(self.root, exist_ok=True)  # an unwritable folder fails here, where every rank learns of it
                if keep_copy:  # in host buffers on every rank (the kept copy's excepted), replicated files included
                    self.full_state._host_buffers = self.memory.reuse(self.full_state._host_buffers)
                    kept = backend.snapshot(self._objects, True, trainer_state or {}, mirror=True)
                    files = [f for f in kept if f.write]
                else:
                    files = backend.snapshot(self._objects, copy, trainer_state or {})
            except Exception as e:  # noqa: BLE001 - every rank must learn of it (below), not just this one
                error = e
        prev_failed, nonfinite, failed, nonce = self._sum_ints(
            [prev_err is not None, not finite_here, error is not None or prev_err is not None,
             secrets.randbits(31) if self.is_main else 0])
        self._settle_pending(prev_job, prev_err, prev_failed == 0)
        params_finite = nonfinite == 0
        tmp_dir = os.path.join(self.root, f"{layout.TMP_PREFIX}{name}-{nonce:08x}")
        if failed:
            msg = f"checkpoint {name} could not be written: "
            if error is not None:
                raise CheckpointError(msg + f"{type(error).__name__}: {error}") from error
            raise CheckpointError(msg + "failed on another rank (see its log)")
        # Every rank makes the folder it writes into (no barrier needed after the main process's mkdir;
        # node-local folders get theirs from their own ranks). Should it still fail, this rank's writes fail
        # and the writer's exchange reports it to every rank: no rank leaves the others waiting.
        try:
            os.makedirs(tmp_dir, exist_ok=True)
        except OSError as e:
            logger.warning("could not create %s: %s", tmp_dir, e)
        job = SaveJob(step, name, tmp_dir, files, healthy, params_finite, t0)
        job.trajectory_step = step if trajectory_step is None else int(trajectory_step)
        job.backend = backend.name
        if self.is_main:
            job.steps = self._carried_steps(trainer_state or {}, step)
        if check_staged:
            job.check_staged = [n for n, o in self._objects.items() if isinstance(o, torch.nn.Module)]
        for spec in [f for f in files if f.sharded is not None]:
            # dcp.async_save stages its host copy here (the stall) and writes in its own thread.
            if keep_copy:
                self.sharded.stage_into(self.memory.reuse_staged)
            job.sharded_write = self.sharded.start_write(spec, tmp_dir, self.group, copy)
            job.files.remove(spec)
        if keep_copy:
            self.memory.offer(name, [f for f in kept if f.sharded is None],
                              staged=self.sharded.staged() if backend is self.sharded else None)
        if copy:
            self._job, self._job_done = job, threading.Event()
            if self._writer is None:
                # A daemon: a writer blocked on a dead peer must never keep the process from exiting.
                self._writer = threading.Thread(target=self._write_jobs, name="vidstab-ckpt-writer", daemon=True)
                self._writer.start()
            job.blocking = (time.perf_counter() - entered, time.time())
            self._jobs.put((job, self._job_done))
            return os.path.join(self.root, name)
        self._run_job(job)
        self._job = job
        self._finish_pending(join_deleters=False)  # old checkpoints' bytes may still be freed meanwhile
        return job.path or os.path.join(self.root, name)

    def _carried_steps(self, trainer_state: dict, step: int) -> dict:
        """The JSON state files of this save that carry its ``step`` (the manifest's ``steps``): ``trainer.json``
        and each registered object whose state is JSON (e.g. the guard's ``step_count``)."""
        states = {"trainer.json": trainer_state}
        for n, o in self._objects.items():
            if not isinstance(o, torch.nn.Module) and not is_optimizer(o):
                states[f"{file_stem(n)}.json"] = o.state_dict()
        return layout.carried_steps(states, step)

    def wait(self) -> str | None:
        """Block until the pending async save (if any) is durable on every rank; re-raise its error.
        Returns the path of the newest checkpoint written by this manager."""
        self._finish_pending()
        return self.last_saved

    close = wait

    def join_writer(self) -> BaseException | None:
        """Wait for this rank's writer thread to finish the pending async save, without the collective that
        agrees on its outcome: for a rank about to exit (a process that exits while its writer is in the
        save's exchange is aborted) while another may still be busy. Returns this rank's error for that save,
        if any; a later :meth:`wait` or save still settles it."""
        self._wait_writer()
        return self._job.error if self._job is not None else None

    def _finish_pending(self, join_deleters: bool = True) -> None:
        """Join the pending async save and agree with every rank on its outcome (raises its error)."""
        job, err = self._join_pending(join_deleters)
        self._settle_pending(job, err, self._all_ok(err is None))

    def _join_pending(self, join_deleters: bool = True) -> tuple[SaveJob | None, BaseException | None]:
        """Wait for this rank's writer thread (no collective); (the job, its error on this rank)."""
        self._wait_writer(join_deleters)
        job, self._job = self._job, None
        err = job.error if job is not None else None
        if isinstance(err, _PeerLost):
            raise err  # the default group has lost the same peer: another collective would fail or hang
        # Taken back below if another rank failed it. (An async sharded save's staged-parameter check is the main
        # process's to know: the ranks may hold different saves, and a load uses the copy only when all hold its.)
        if self.memory is not None and job is not None:
            self.memory.settled(job.name, job.healthy and job.params_finite, err is None)
        return job, err

    def _wait_writer(self, join_deleters: bool = True) -> None:
        """Block until this rank's writer has finished the pending job (and the rotation's deleters)."""
        if self._job_done is not None:
            self._job_done.wait()
            self._job_done = None
        while join_deleters and self._deleters:
            self._deleters.pop().join()

    def _settle_pending(self, job: SaveJob | None, err: BaseException | None, all_ok: bool) -> None:
        """Given every rank's word on the joined job (``all_ok``): raise its error, or record its path."""
        if not all_ok:
            if job is not None and self.memory is not None:
                self.memory.drop(job.name)
            if job is not None and self.is_main:
                shutil.rmtree(job.tmp_dir, ignore_errors=True)
            if err is not None:
                if isinstance(err, CheckpointError):
                    raise err
                raise CheckpointError(f"checkpoint {job.name} could not be written: {err}") from err
            raise CheckpointError(
                f"checkpoint {job.name if job else '?'} could not be written: failed on another rank (see its log)")
        if job is not None and job.path is not None:
            self.last_saved = job.path

    # -- writing (background thread or inline)
    def _write_jobs(self) -> None:
        """The writer thread: one async job after another (one is in flight at a time: ``save`` joins the
        previous one first)."""
        while True:
            job, done = self._jobs.get()
            try:
                self._run_job(job)
            finally:
                done.set()

    def _run_job(self, job: SaveJob) -> None:
        """Write this rank's files, tell the main process their digests (or this rank's error), publish."""
        error: BaseException | None = None
        try:
            if job.check_staged:  # DCP is writing from the staged copy meanwhile (read-only, both)
                job.staged_finite = self.sharded.staged_finite(job.check_staged)
            sharded = job.sharded_write() if job.sharded_write is not None else {}
            job.sharded_write = None
            write_files(job, self.config.checksum, self.config.fsync)
            job.digests.update(sharded)
            # DCP's shard files are fsync'd in the same concurrent batch as this rank's other files; the
            # main process also fsyncs the shard folder that names them.
            job.unsynced += [os.path.join(job.tmp_dir, f) for f in sharded]
            if sharded and self.is_main:
                job.unsynced.append(os.path.join(job.tmp_dir, os.path.dirname(next(iter(sharded)))))
            if not self.is_main:
                # This rank's event lines of the steps the checkpoint covers are durable before it is published.
                log = flush_log(self.output_dir, self.rank)
                if self.config.fsync:
                    fsync_paths(job.unsynced + ([str(log)] if log else []))
            if self.after_files_written is not None:
                self.after_files_written(job.step)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it through the exchange below
            error = e
        try:
            reports = self._exchange(job, error)
            if self.is_main:
                digests: dict[str, dict] = {}
                for r, rep in enumerate(reports):
                    if not rep["ok"]:
                        raise CheckpointError(f"checkpoint {job.name} could not be written: "
                                              f"rank {r} failed to write its files ({rep['error']})")
                    if not self.node_local or rep["node"] == self.rank:  # node-local: this node's ranks' files
                        digests.update(rep["digests"])
                job.params_finite = job.params_finite and all(rep["finite"] for rep in reports)
                self._finalize(job, digests, job.unsynced)
            elif error is not None:
                raise error
        except BaseException as e:  # noqa: BLE001 - surfaced by _finish_pending on every rank
            job.error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"checkpoint {job.name} could not be written: {type(e).__name__}: {e}")
            if job.error is not e:
                job.error.__cause__ = e
            if self.is_main:
                shutil.rmtree(job.tmp_dir, ignore_errors=True)

    def _exchange(self, job: SaveJob, error: BaseException | None) -> list[dict]:
        """Every rank's ``{"ok", "error", "digests", "node", "finite"}`` for ``job`` (all ranks, on the checkpoint group).

        This is the "all ranks finished writing" barrier of a save. It runs in the writer thread, so it
        uses the dedicated gloo group, whose collectives fail within seconds when a peer's connection
        closes (a dead rank) and after ``rank_timeout_s`` when a peer hangs; the main process then never
        publishes the folder. Raises :class:`_PeerLost`."""
        mine = {"ok": error is None, "digests": (job.digests or {}) if error is None else {}, "node": self.node,
                "error": None if error is None else f"{type(error).__name__}: {error}", "finite": job.staged_finite}
        if self.world_size == 1:
            return [mine]
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
            width = int(max(s.item() for s in sizes))
            bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world_size)]
            dist.all_gather(bufs, torch.cat([data, torch.zeros(width - data.numel(), dtype=torch.uint8)]),
                            group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError (closed connection, timeout)
            raise _PeerLost(f"checkpoint {job.name} could not be written: lost contact with another rank during "
                            f"the save ({type(e).__name__}: {str(e).splitlines()[0][:300]}); the unfinished "
                            f"folder is never loaded. A rank probably died: see its log.") from e
        return [json.loads(bytes(b[: int(n.item())].numpy())) for b, n in zip(bufs, sizes)]

    def _finalize(self, job: SaveJob, digests: dict[str, dict], unsynced: list[str]) -> None:
        """Write the manifest, make everything durable, publish (rename, pointers), rotate (main process)."""
        from .. import __version__

        sequence = 1 + max((int(i.manifest.get("sequence") or 0) for i in layout.list_checkpoints(self.root)), default=0)
        steps = {f: keys for f, keys in (job.steps or {}).items() if f in digests}
        manifest = write_manifest(job, digests, backend=job.backend, config_hash=self.config_hash,
                                  vidstab_version=__version__, world_size=self.world_size,
                                  objects={n: file_stem(n) for n in self._objects}, sequence=sequence, parent=self._head,
                                  **({"run_id": self.run_id} if self.run_id else {}), steps=steps,
                                  trajectory_step=job.trajectory_step)
        # Its event and every line of the steps it covers reach the disk in the same fsync batch as its files,
        # before the rename and ``latest`` publish it: a kill after that loses none of them. ``seconds``: writing.
        blocking, went_on = job.blocking if job.blocking is not None else (time.perf_counter() - job.t0, time.time())
        log_event(self.output_dir, self.rank, "checkpoint", job.step,
                  path=rel(os.path.join(self.root, job.name), self.output_dir), healthy=manifest["healthy"],
                  params_finite=job.params_finite, seconds=round(time.perf_counter() - job.t0, 4),
                  blocking_seconds=round(blocking, 4), blocking_ended=went_on, trajectory_step=job.trajectory_step)
        log = flush_log(self.output_dir, self.rank)
        try:
            final = publish(job, self.root, manifest["healthy"], unsynced + ([str(log)] if log else []),
                            self.config.fsync, replace=self._write_pointer, unmovable=self._unmovable,
                            run_id=self.run_id)
        except BaseException as e:
            log_event(self.output_dir, self.rank, "warn", job.step, detector="checkpoint", figures={}, bad_ranks=[],
                      message=f"checkpoint {job.name} logged above was not published: {type(e).__name__}: {e}",
                      trajectory_step=job.trajectory_step)
            raise
        job.path = final
        self._head = {"name": job.name, "sequence": sequence}
        seconds = time.perf_counter() - job.t0
        self._rotate()
        logger.info("checkpoint %s written (%.2fs, healthy=%s)", final, seconds, manifest["healthy"])

    def _unmovable(self, job: SaveJob, error: OSError, old_name: str) -> None:
        message = (f"checkpoint folder {old_name} (damaged or from an abandoned trajectory) cannot be moved aside "
                   f"({error.strerror or error}: read-only mount or immutable file?); this save of step {job.step} "
                   f"went to {job.name} instead and training goes on. {old_name} is never loaded while {job.name} "
                   f"is valid: remove {os.path.join(self.root, old_name)} by hand when you can (e.g. `chattr -R -i` "
                   "it, or remount read-write)")
        logger.warning(message)
        log_event(self.output_dir, self.rank, "warn", job.step, detector="checkpoint", message=message,
                  figures={}, bad_ranks=[], path=rel(os.path.join(self.root, job.name), self.output_dir),
                  trajectory_step=job.trajectory_step)

    def _write_pointer(self, pointer: str, target: str, sync_root: bool = True, tmp: str | None = None) -> None:
        layout.replace_pointer(self.root, pointer, target, self.config.fsync, sync_root=sync_root, tmp=tmp)

    def _rotate(self) -> None:
        self._deleters += rotate(self.root, self.config.keep, self._incident_checkpoints(), run_id=self.run_id)

    def _incident_checkpoints(self) -> set[str]:
        """Folder names (in this root) of the checkpoints the newest incident bundles replay on."""
        from ..evidence.capture import META_FILE, list_incidents  # capture imports this package: import late

        names: list[str] = []
        for bundle in reversed(list_incidents(self.output_dir)):
            if len(names) >= self.config.keep_for_incidents:
                break
            try:
                named = read_json_file(bundle / META_FILE).get("checkpoint")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(named, str):
                path = os.path.normpath(os.path.join(self.output_dir, named))
                if os.path.dirname(path) == os.path.normpath(self.root) and os.path.basename(path) not in names:
                    names.append(os.path.basename(path))
        return set(names)

    def set_latest(self, path: str) -> None:
        """Point ``latest`` at an existing checkpoint (main process; e.g. after a rollback, so a restart
        resumes on the current trajectory rather than the abandoned one)."""
        if self.is_main:
            self._write_pointer("latest", os.path.basename(os.path.normpath(path)))

    def set_last_good(self, path: str) -> None:
        """Point ``last_good`` at an existing checkpoint (main process; e.g. when the one it named proved bad:
        a rollback to it failed again)."""
        if self.is_main:
            self._write_pointer("last_good", os.path.basename(os.path.normpath(path)))

    # ------------------------------------------------------------------ listing
    def _read_pointer(self, pointer: str) -> str | None:
        return layout.read_pointer(self.root, pointer)

    def list(self) -> list[CheckpointInfo]:
        """Complete-looking checkpoints (a parseable manifest), oldest step first. Files are not verified."""
        return layout.list_checkpoints(self.root)

    def _candidates(self, which: str) -> list[str]:
        return layout.candidates(self.root, self.output_dir, which, run_id=self.run_id,
                                 allow_other_run=self.config.allow_other_run)

    def latest_path_str(self) -> str | None:
        """``latest`` as a path relative to the output dir (e.g. ``vidstab/checkpoints/step_000100``), from
        the pointer file without verifying the files (cheap: for incident bundles); None before the first
        save (or while the pointer is damaged)."""
        name = self._read_pointer("latest")
        return f"{self.config.subdir}/{name}" if name else None

    def latest_valid(self) -> str | None:
        """Path of the checkpoint ``load("latest")`` would use (fully verified), or None."""
        return self._first_valid("latest")

    def last_good(self) -> str | None:
        """Path of the checkpoint ``load("last_good")`` would use (fully verified), or None."""
        return self._first_valid("last_good")

    def _first_valid(self, which: str) -> str | None:
        for p in self._candidates(which):
            try:
                self._read(p, decode=False)
                return p
            except CheckpointError:
                continue
        return None

    def _unverified_message(self, which: str, unverified: list[tuple[str, str]]) -> str:
        sub = rel(self.root, self.output_dir)
        listed = "; ".join(f"{n}: {why}" for n, why in unverified)
        return (f"nothing to load for {which!r}: {sub} holds {len(unverified)} checkpoint folder(s) that cannot be "
                f"verified ({listed}). Nothing was loaded and nothing in them will be overwritten.{UNVERIFIED_ADVICE}")

    # ------------------------------------------------------------------ load
    def load(self, which: str = "latest", resume_event: bool = True, from_memory: bool = False) -> dict | None:
        """Load ``"latest"``, ``"last_good"`` or a checkpoint folder into everything registered.

        Every file is verified (present, size, checksum) and decoded before anything is applied; an
        invalid checkpoint is skipped with a warning in favour of the previous valid one. Returns the
        saved ``trainer_state`` plus ``"_checkpoint": {"path", "step", "trajectory_step", "skipped"}`` saying
        which checkpoint was used (``step``: the script's, its folder's name; ``trajectory_step``: the
        trajectory's, the same unless in-place rollbacks made them differ; a folder written before it was
        recorded: the same). Returns ``None`` when there is no checkpoint at all for ``"latest"`` /
        ``"last_good"`` (a fresh run); raises :class:`CheckpointError` if there are checkpoints but none
        is valid, ``which`` is a folder and neither it nor an older one is valid, ``which`` names no
        checkpoint ("no such checkpoint", listing what exists), or the checkpoint was written by another
        number of processes (see the class doc). ``resume_event``: log a ``resume`` event (the loop
        resumes from it; :class:`vidstab.Recovery` passes False and logs its ``rollback``).

        A checkpoint of another run (its manifest's run id), or a folder reached through a symbolic link, is
        refused naming both runs unless ``CheckpointConfig.allow_other_run``; one whose folder name, manifest
        and state files disagree on the step cannot be verified (skipped, named, never overwritten). Each
        manifest is parsed once per call (:func:`~.layout.parse_once`).

        ``from_memory`` (an in-place rollback): when ``which`` resolves to the checkpoint held in host memory
        (``CheckpointConfig.rollback_memory_budget_bytes``) on every rank, its state comes from there, unread
        from disk. The returned ``"_checkpoint"`` says which (``"source"``: ``"memory"`` or ``"files"``) and how
        long the load took (``"seconds"``).
        """
        self._finish_pending()
        with layout.parse_once():
            return self._load(which, resume_event, from_memory)

    def _load(self, which: str, resume_event: bool, from_memory: bool = False) -> dict | None:
        cands = self._candidates(which)
        if not cands and which in ("latest", "last_good"):
            unverified = layout.unverifiable(self.root)
            if unverified:
                raise CheckpointError(self._unverified_message(which, unverified))
            logger.info("no checkpoint under %s to resume from", self.root)
            return None
        self._check_world_size(cands)
        started = time.perf_counter()
        payload = self._from_memory(which, cands) if from_memory else None
        source, path, skipped = "memory", cands[0] if cands else "", []
        if payload is None:
            source, (path, payload, skipped) = "files", self._read_agreed(which, cands)
        if skipped:
            logger.warning("loaded %s instead of %s (fell back past %d invalid checkpoint(s))",
                           path, cands[0], len(skipped))
        # One source of truth for replicated state: what every rank read is compared (and repaired from
        # rank 0, or refused) before anything is applied.
        replicated = {n: payload["objects"][n] for n, o in self._objects.items()
                      if not isinstance(o, torch.nn.Module) and not is_optimizer(o)}
        replicated["_trainer"] = payload["trainer"]
        replicated, repaired = ensure_identical(replicated, self.rank, self.world_size, self.group,
                                                repair=self.config.on_replica_mismatch == "repair")
        payload["trainer"] = replicated.pop("_trainer")
        payload["objects"].update(replicated)
        backend = self._backend_of(payload["manifest"])
        if backend is self.sharded:
            self.sharded.apply(payload, self._objects, path=path, group=self.group)
        else:
            backend.apply(payload, self._objects)
        ts = dict(payload["trainer"])
        info = {"path": rel(path, self.output_dir), "step": payload["manifest"]["step"],
                "trajectory_step": layout.trajectory_step_of(payload["manifest"]), "skipped": skipped,
                "source": source, "seconds": round(time.perf_counter() - started, 4)}
        if repaired:
            info["repaired_from_rank0"] = repaired
        ts["_checkpoint"] = info
        self.last_loaded = info
        man = payload["manifest"]
        self._say_whose(path, man)
        self._head = {"name": os.path.basename(os.path.normpath(path)), "sequence": int(man.get("sequence") or 0)}
        if resume_event:
            log_event(self.output_dir, self.rank, "resume", int(man["step"]), checkpoint=info["path"],
                      requested=which, skipped=skipped, trajectory_step=info["trajectory_step"])
        return ts

    def _read_agreed(self, which: str, cands: list[str]) -> tuple[str, dict, list[list[str]]]:
        """The first candidate every rank verified and decoded from its files: (path, payload, skipped)."""
        skipped: list[list[str]] = []
        chosen, payload = -1, None
        if self.is_main:
            for i, p in enumerate(cands):
                try:
                    payload = self._read(p)
                    chosen = i
                    break
                except CheckpointError as e:
                    skipped.append([rel(p, self.output_dir), str(e)])
                    logger.warning("skipping checkpoint %s: %s", p, e)
        mine, chosen = chosen, self._broadcast_int(chosen)
        if mine != chosen:
            payload = None  # node-local folders: this node's publisher read another candidate than rank 0
        if chosen >= len(cands):
            raise CheckpointError(f"rank 0 chose checkpoint #{chosen + 1} of its folder, this rank's folder {self.root} "
                                  f"has only {len(cands)} (node-local folders out of step?)")
        if chosen < 0:
            if which in layout.POINTERS:  # every folder it could have been, not only those tried
                named = [(os.path.basename(p), r.removeprefix(f"{os.path.basename(p)}: ")) for p, r in skipped]
                seen = {n for n, _ in named}
                named += [(n, why) for n, why in layout.unverifiable(self.root) if n not in seen]
                raise CheckpointError(self._unverified_message(which, named))
            detail = "; ".join(f"{p}: {r}" for p, r in skipped) or f"no checkpoints under {self.root}"
            raise CheckpointError(f"no valid checkpoint to load for {which!r} ({detail})")
        path = cands[chosen]
        error = None
        if payload is None:
            try:
                payload = self._read(path)
            except CheckpointError as e:
                error = e
        # Nothing is applied unless every rank read its part: no rank loads while another raises.
        if not self._all_ok(error is None):
            raise error or CheckpointError(f"{path}: another rank could not read it (see its log)")
        return path, payload, skipped

    def _from_memory(self, which: str, cands: list[str]) -> dict | None:
        """The decoded in-memory copy of ``cands[0]`` when every rank holds it (one all-reduce), else None."""
        if self.memory is None:
            return None
        payload = None
        raw = self.memory.payload(cands[0]) if cands else None
        if raw is not None:
            try:
                man = layout.read_manifest(cands[0])
                payload = {"manifest": man, "staged": self.memory.staged,
                           **self._backend_of(man).decode(os.path.basename(os.path.normpath(cands[0])), raw, self._objects)}
            except CheckpointError as e:
                logger.warning("the in-memory copy of %s is not used: %s", cands[0], e)
                payload = None
        if self._sum_ints([payload is None])[0]:
            if self.accelerator.is_main_process:
                self.memory.say_once(which)
            return None
        return payload

    def _say_whose(self, path: str, man: dict) -> None:
        """Warn (once per manager) when the loaded checkpoint is not known to be this run's."""
        theirs = man.get("run_id")
        if theirs is None and self.run_id and not self._warned_unidentified:
            self._warned_unidentified = True
            logger.warning("%s was written before vidstab recorded run ids in checkpoints: loaded as this run's "
                           "(%s); its later checkpoints record it", rel(path, self.output_dir), self.run_id)
        elif theirs is not None and theirs != self.run_id:
            logger.warning("%s is a checkpoint of another run (%s), loaded into this run (%s) as asked "
                           "(allow_other_run); this run's checkpoints record %s", rel(path, self.output_dir), theirs,
                           self.run_id, self.run_id)

    def _check_world_size(self, cands: list[str]) -> None:
        """Refuse (every rank alike, from the same files) a checkpoint of another world size. The first
        candidate with a readable manifest decides: a run's checkpoints share one world size, so falling
        back past it would only list the same refusal for each."""
        fixed = self.engine.fixed_world_size
        if self.config.allow_world_size_change and fixed is None:
            return
        for p in cands:
            try:
                saved = layout.read_manifest(p).get("world_size")
            except CheckpointError:
                continue
            if saved is not None and saved != self.world_size and fixed is not None:
                raise CheckpointError(f"{rel(p, self.output_dir)} was written by {saved} processes; this run has "
                                      f"{self.world_size}. {fixed}: relaunch with --num_processes {saved}")
            if saved is not None and saved != self.world_size:
                raise CheckpointError(
                    f"{rel(p, self.output_dir)} was written by {saved} process{'es' if saved != 1 else ''}; this run "
                    f"has {self.world_size}. vidstab does not resume on another world size: each rank's data "
                    "position and RNG stream, and an LR scheduler stepped once per process per optimizer step, "
                    f"would silently change the data order and the LR schedule. Relaunch with {saved} "
                    f"process{'es' if saved != 1 else ''} (e.g. accelerate launch --num_processes {saved}), or start "
                    "a new run in another output folder; a loop that re-derives those itself may pass "
                    "CheckpointConfig(allow_world_size_change=True)")
            return

    def _read(self, path: str, decode: bool = True) -> dict:
        """Verify every file of the checkpoint at ``path`` and (optionally) decode what this rank needs."""
        backend = self._backend_of(layout.read_manifest(path))
        dec = (lambda ckpt, raw: self._checked(ckpt, backend.decode(ckpt, raw, self._objects))) if decode else None
        return read_checkpoint(path, self.rank, self.is_main, backend.needed_files(self._objects), dec,
                               config_hash=self.config_hash, keep_file=getattr(backend, "keep_file", None))

    def _checked(self, ckpt: str, payload: dict) -> dict:
        """``payload`` with each state whose receiver checks what it is given (``checked_state(state, source)``, e.g.
        the guard's) checked before anything is applied: a malformed one makes the checkpoint invalid, named."""
        states = payload.get("objects", {})
        for n, obj in self._objects.items():
            check = getattr(obj, "checked_state", None)
            if callable(check) and n in states:
                states[n] = check(states[n], f"{ckpt}/{file_stem(n)}.json")
        return payload

    # ------------------------------------------------------------------ collectives
    def _params_finite_here(self) -> bool:
        """Whether this rank's (local shards of the) registered models' parameters are all finite."""
        return self.engine.params_finite(self._objects)

    def _all_ok(self, ok: bool) -> bool:
        return self._sum_ints([not ok])[0] == 0

    def _sum_ints(self, values: list[int]) -> list[int]:
        """Each value summed over all ranks: one collective, one host read."""
        if self.world_size == 1:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.accelerator.device)
        return [int(x) for x in self.accelerator.reduce(t, reduction="sum").tolist()]

    def _broadcast_int(self, v: int) -> int:
        if self.world_size == 1:
            return v
        from accelerate.utils import broadcast

        t = torch.tensor([v], dtype=torch.int64, device=self.accelerator.device)
        return int(broadcast(t, from_process=0).item())


class _PeerLost(CheckpointError):
    """A rank stopped answering during a save (died or hung): raised without any further collective."""


def node_local_folders(accelerator) -> bool:
    """``ProjectConfiguration(save_on_each_node=True)``: each node has its own output folder (node-local
    disks), as Accelerate's ``save_state`` assumes when it writes on every node's local main process. Then
    each node's local main process publishes a complete checkpoint into its node's folder: the replicated
    state (JSON, scheduler, guard, trainer state; the full model for the full-state backend) plus the files
    of that node's ranks (their DCP shards and RNG states)."""
    config = getattr(accelerator, "project_configuration", None)
    return bool(getattr(config, "save_on_each_node", False)) and accelerator.num_processes > 1


def _checkpoint_group(world_size: int, timeout_s: float):
    """A gloo process group of all ranks for the checkpoint writer, created once per manager (all ranks
    construct the manager together). Gloo on CPU tensors whatever the training backend (NCCL on GPU), as
    torchtitan does for async checkpointing: DCP's collectives and the writer's exchange then overlap
    training without sharing its communicator."""
    if world_size == 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise CheckpointError(f"world size is {world_size} but torch.distributed is not initialized")
    register_exit_fence()  # its gloo workers must be quiet before the interpreter finalizes (exit_fence.py)
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _engine_of(accelerator) -> Engine:
    """The run's engine, chosen once; the set-ups these checkpoints cannot serve refused here (never hang later)."""
    try:
        engine = engine_for(accelerator)
    except DeepSpeedUnsupported as e:
        raise CheckpointError(str(e)) from None
    engine.refuse_checkpoints()
    return engine
