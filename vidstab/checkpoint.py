"""Atomic, validated, rotated checkpoints for Accelerate training runs (no pickle anywhere).

Why not ``accelerator.save_state``: it writes in place (a kill mid-save leaves a folder that
``load_state`` picks and then fails on), its ``total_limit`` deletes the oldest checkpoint *before* the
new one is complete, nothing checks completeness on load, and custom objects are unpickled with
``weights_only=False``.

Layout (see ``docs/ARCHITECTURE.md``)::

    OUTPUT_DIR/checkpoints/step_000100/   model.safetensors, optimizer.safetensors + optimizer.json,
                                          scheduler.json, scaler.json, ema.safetensors + ema.json,
                                          rng-rank{R}.safetensors + rng-rank{R}.json, trainer.json,
                                          vidstab.json, manifest.json (written last)
    OUTPUT_DIR/checkpoints/latest         pointer file: folder name of the newest complete checkpoint
    OUTPUT_DIR/checkpoints/last_good      pointer file: newest checkpoint that passed the health gate

How a save stays atomic:

1. Every rank writes its files into ``checkpoints/.tmp-step_{STEP:06d}-{nonce}`` (the nonce is chosen
   by the main process and broadcast), checksumming each file while writing it (CRC-32 by default, see
   ``CheckpointConfig.checksum``), and fsyncs it.
2. Ranks other than the main one then drop a marker ``.rank{R}.done`` (JSON: their files' sizes and
   digests) into the folder; on failure an empty ``.rank{R}.failed`` (creating an empty file needs no
   data blocks, so it works on a full disk).
3. The main process waits for every rank's marker (this is the "all ranks finished" barrier; it works
   from a background thread, where collectives must not be used), writes ``manifest.json`` last and the
   new ``latest`` (and, when healthy, ``last_good``) pointer contents to temp files, fsyncs its own data
   files, the manifest, the pointer temp files and the folder in one concurrent batch, renames the folder
   to ``step_{STEP:06d}``, replaces the pointers atomically, fsyncs ``checkpoints/``, and only then
   rotates old ones.

Any folder without a valid manifest is never loaded, and every file is checked against the manifest's
size and checksum before anything is applied (:func:`verify_checkpoint_files` does the same check for
other tools); stale ``.tmp-*`` entries from a killed save are
removed when the manager starts.

Async saves (``async_save=True``, the default, any world size): ``save`` copies the state to host memory
(pinned where CUDA) — the only part the training loop waits for — and steps 1-3 run in a background
thread on each rank. The next ``save``/``wait``/``load`` joins that thread and all ranks agree (one
small all-reduce) on whether it succeeded, so a failure on any rank raises ``CheckpointError`` on all
ranks at the same call instead of leaving them out of step.

Scope: single process and DDP (full state dict on the main process). FSDP/DeepSpeed sharded optimizer
states are not handled yet.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import statedict_io as sio
from .events import log_event

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointInfo", "CheckpointManager", "verify_checkpoint_files"]

logger = logging.getLogger("vidstab.checkpoint")

MANIFEST = "manifest.json"
SCHEMA = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
# Registered names whose files are spelled differently in the documented layout.
_STEMS = {"lr_scheduler": "scheduler"}
_RESERVED = {"manifest", "trainer", "scaler"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no valid checkpoint could be loaded."""


@dataclass
class CheckpointConfig:
    """How checkpoints are written, kept and loaded."""

    keep: int = 3
    """Number of newest checkpoints kept (by save time); the one ``last_good`` points to is kept in addition."""
    async_save: bool = True
    """Copy state to host memory synchronously, write it in a background thread (the loop waits only for the copy)."""
    subdir: str = "checkpoints"
    """Folder under the output dir that holds checkpoints and pointer files."""
    fsync: bool = True
    """fsync files and folders. Turning this off gives up durability on power loss; only for throw-away runs."""
    pin_memory: bool = True
    """Use pinned host buffers for the async copy when tensors live on CUDA."""
    check_params_finite: bool = True
    """Check registered models' parameters for NaN/Inf (one on-device reduction) before saving; a
    checkpoint with non-finite parameters is never a rollback target."""
    reuse_buffers: bool = True
    """Async saves: keep the host copy's buffers for the next save (faster copy; holds one host-memory copy
    of the state between saves). False: allocate per save and free after writing."""
    remove_stale: bool = True
    """Remove ``.tmp-*`` leftovers of killed saves when the manager starts (main process). Set False for a
    tool that opens the folder of a run that is still training, whose save may be in flight."""
    rank_timeout_s: float = 1800.0
    """How long the main process waits for other ranks' files before giving up on a checkpoint."""
    checksum: str = "crc32"
    """Per-file checksum recorded in the manifest and verified on load: ``"crc32"`` or ``"sha256"``.
    CRC-32 detects truncation, all single-bit flips and burst errors up to 32 bits, which is what a
    checkpoint is defended against here -- torn writes and bit rot -- as zip, gzip and PNG do; at
    ~5 GB/s per core it costs far less than the write. ``"sha256"`` gives a cryptographic digest (about
    4x slower) for checkpoints that cross trust boundaries. The manifest names the algorithm per file,
    so either kind of checkpoint loads whatever this is set to."""


@dataclass
class CheckpointInfo:
    """A checkpoint folder as listed (manifest read, files not verified)."""

    path: str
    """Absolute path of the folder."""
    name: str
    """Folder name, e.g. ``step_000100``."""
    step: int
    """Optimizer step the checkpoint was taken at."""
    healthy: bool
    """``healthy`` as passed to ``save`` and parameters finite: usable as a rollback target."""
    time: float
    """Unix time the manifest was written."""
    manifest: dict = field(repr=False, default_factory=dict)
    """The parsed manifest."""


@dataclass
class _File:
    name: str
    tensors: dict[str, torch.Tensor] | None = None  # -> safetensors
    data: bytes | None = None  # -> raw bytes (JSON)
    metadata: dict[str, str] | None = None


@dataclass
class _Job:
    step: int
    name: str
    tmp_dir: str
    files: list[_File]
    healthy: bool
    params_finite: bool
    t0: float
    error: BaseException | None = None
    path: str | None = None


def _rel(path: str, root: str) -> str:
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return path


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------- verification


def _read_manifest(path: str) -> dict:
    """Parse ``path/manifest.json``; raise :class:`CheckpointError` if it is missing, unreadable, of another
    schema or lists a pickled file."""
    name = os.path.basename(os.path.normpath(path))
    try:
        with open(os.path.join(path, MANIFEST), "rb") as fh:
            man = json.loads(fh.read())
        files = man["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, not an object")
        if man.get("schema") != SCHEMA:
            raise CheckpointError(f"{name}: unsupported manifest schema {man.get('schema')!r}")
    except FileNotFoundError:
        raise CheckpointError(f"{name}: no manifest.json (incomplete save)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{name}: unreadable manifest ({e})") from None
    for bad in (f for f in files if f.endswith((".pt", ".bin", ".pkl", ".pickle"))):
        raise CheckpointError(f"{name}: refusing pickled file {bad}")
    return man


def _verify_file(ckpt: str, path: str, f: str, meta: Any, keep: bool = False, checksum: bool = True) -> bytes | None:
    """Check ``path/f`` against its manifest entry ``meta``: present, size, and (``checksum``) every checksum
    the entry records (``crc32`` and/or ``sha256``). Returns the file's bytes when ``keep`` (read once, for
    decoding); otherwise streams the file in constant memory."""
    if not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int):
        raise CheckpointError(f"{ckpt}: manifest entry for {f} is malformed ({meta!r})")
    want = [(a, meta[a]) for a in sio.CHECKSUMS if a in meta]
    if not want:
        raise CheckpointError(f"{ckpt}: manifest records no checksum for {f} (expected one of "
                              f"{', '.join(sio.CHECKSUMS)}; has {sorted(meta)})")
    fp = os.path.join(path, f)
    try:
        size = os.stat(fp).st_size
    except OSError:
        raise CheckpointError(f"{ckpt}: file {f} is missing") from None
    if size != meta["bytes"]:
        why = "truncated?" if size < meta["bytes"] else "overwritten?"
        raise CheckpointError(f"{ckpt}: file {f} has {size} bytes, manifest says {meta['bytes']} ({why})")
    if not checksum:
        return None
    hashers = [(a, sio.new_checksum(a), str(d).lower()) for a, d in want]
    data = None
    try:
        with open(fp, "rb") as fh:
            if keep:
                data = fh.read()
                for _, h, _ in hashers:
                    h.update(data)
            else:
                buf = bytearray(1 << 22)
                mv = memoryview(buf)
                while n := fh.readinto(buf):
                    for _, h, _ in hashers:
                        h.update(mv[:n])
    except OSError as e:
        raise CheckpointError(f"{ckpt}: file {f} cannot be read ({e})") from None
    for a, h, d in hashers:
        if h.hexdigest() != d:
            raise CheckpointError(f"{ckpt}: file {f} is corrupt ({a} mismatch)")
    return data


def verify_checkpoint_files(path: str | os.PathLike, names: list[str] | None = None) -> None:
    """Check the files of the checkpoint folder ``path`` against its ``manifest.json``.

    Each file (``names``, or every file the manifest lists when ``None``) must be listed, present, of the
    recorded size and match the recorded checksum -- whichever the manifest records for it (``crc32``,
    the default since vidstab writes it, or ``sha256`` in older or ``checksum="sha256"`` checkpoints).
    Files are streamed (constant memory). Raises :class:`CheckpointError` whose message names the
    checkpoint folder, the file and the problem (no/unreadable manifest, not listed, missing, size,
    checksum). Does not decode anything.
    """
    path = os.fspath(path)
    ckpt = os.path.basename(os.path.normpath(path))
    files = _read_manifest(path)["files"]
    for f in files if names is None else names:
        if f not in files:
            raise CheckpointError(f"{ckpt}: file {f} is not listed in its manifest.json")
        _verify_file(ckpt, path, f, files[f])


class CheckpointManager:
    """Atomic, validated, rotated checkpoints of everything registered, plus scaler and RNG states.

    All ranks must call :meth:`save`, :meth:`wait` and :meth:`load` together (they contain collectives).

    Example::

        ckpt = CheckpointManager(accelerator, output_dir, CheckpointConfig(keep=3))
        ckpt.register("model", model); ckpt.register("optimizer", optimizer)
        ckpt.register("lr_scheduler", lr_scheduler); ckpt.register("vidstab", guard)
        trainer_state = ckpt.load("latest")   # None on a fresh run
        ...
        ckpt.save(step, healthy=guard.healthy, trainer_state={"step": step, "epoch": e, "batch": i})
        ...
        ckpt.wait()
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
        self.is_main = accelerator.is_main_process
        self._objects: dict[str, Any] = {}
        self._host_buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._deleters: list[threading.Thread] = []
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None
        self.last_saved: str | None = None
        """Path of the newest checkpoint this manager finished writing."""
        self.last_loaded: dict | None = None
        """``{"path", "step", "skipped": [[path, reason], ...]}`` of the last :meth:`load`."""
        if self.is_main:
            os.makedirs(self.root, exist_ok=True)
            if self.config.remove_stale:
                self._remove_stale()

    # ------------------------------------------------------------------ registration
    def register(self, name: str, obj: Any) -> None:
        """Register an object to save/load under ``name``.

        ``torch.nn.Module`` (prepared/wrapped is fine) -> ``{name}.safetensors`` from
        ``accelerator.get_state_dict``, loaded with ``strict=True`` into the unwrapped model.
        Anything else with ``state_dict``/``load_state_dict`` (optimizer, scheduler, EMA, guard) ->
        ``{name}.json`` (+ ``{name}.safetensors`` when it holds tensors). ``lr_scheduler`` is stored as
        ``scheduler.*``.
        """
        stem = _STEMS.get(name, name)
        if stem in _RESERVED or stem.startswith("rng-") or not re.fullmatch(r"[A-Za-z0-9_.-]+", stem):
            raise ValueError(f"cannot register {name!r}: reserved or not a plain file name")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name!r}: object needs state_dict() and load_state_dict()")
        self._objects[name] = obj

    # ------------------------------------------------------------------ save
    def save(self, step: int, healthy: bool = True, trainer_state: dict | None = None) -> str:
        """Save a checkpoint of ``step``; returns the final folder path (complete once :meth:`wait` returns
        when saving asynchronously). Raises :class:`CheckpointError` for a failure of this save (sync)
        or of the previous async one."""
        self._finish_pending()
        step = int(step)
        t0 = time.perf_counter()
        name = f"step_{step:06d}"
        params_finite = self._params_finite() if self.config.check_params_finite else True
        nonce = self._shared_nonce()
        tmp_dir = os.path.join(self.root, f"{_TMP_PREFIX}{name}-{nonce}")
        copy = self.config.async_save
        files: list[_File] = []
        try:
            if self.is_main:
                os.makedirs(self.root, exist_ok=True)
                os.mkdir(tmp_dir)
            files = self._snapshot(copy, trainer_state or {})
        except Exception as e:  # noqa: BLE001 - every rank must learn of it (below), not just this one
            error: Exception | None = e
        else:
            error = None
        # All ranks agree on the snapshot before anyone writes: this is also the barrier that keeps other
        # ranks from writing before the main process created the folder.
        if not self._all_ok(error is None):
            if self.is_main:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            msg = f"checkpoint {name} could not be written: "
            if error is not None:
                raise CheckpointError(msg + f"{type(error).__name__}: {error}") from error
            raise CheckpointError(msg + "failed on another rank (see its log)")
        job = _Job(step, name, tmp_dir, files, healthy, params_finite, t0)
        if copy:
            self._job = job
            self._thread = threading.Thread(target=self._run_job, args=(job,), name=f"vidstab-ckpt-{name}")
            self._thread.start()
            return os.path.join(self.root, name)
        self._run_job(job)
        self._job = job
        self._finish_pending(join_deleters=False)  # old checkpoints' bytes may still be freed meanwhile
        return job.path or os.path.join(self.root, name)

    def wait(self) -> str | None:
        """Block until the pending async save (if any) is durable on every rank; re-raise its error.
        Returns the path of the newest checkpoint written by this manager."""
        self._finish_pending()
        return self.last_saved

    close = wait

    def _finish_pending(self, join_deleters: bool = True) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while join_deleters and self._deleters:
            self._deleters.pop().join()
        job, self._job = self._job, None
        err = job.error if job is not None else None
        if not self._all_ok(err is None):
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

    # -- snapshot (synchronous part)
    def _snapshot(self, copy: bool, trainer_state: dict) -> list[_File]:
        files: list[_File] = []
        pinned = copy and self.config.pin_memory and torch.cuda.is_available()
        on_cuda = False

        keep = self._host_buffers if self.config.reuse_buffers else {}
        used: dict[tuple[str, str], torch.Tensor] = {}

        def host(file: str, key: str, t: torch.Tensor) -> torch.Tensor:
            nonlocal on_cuda
            t = t.detach()
            if hasattr(t, "full_tensor"):  # DTensor
                t = t.full_tensor()
            if not copy:
                return t
            on_cuda = on_cuda or t.device.type == "cuda"
            # Reusing last save's buffer avoids fresh allocations (page faults; pinned allocations are
            # slow): the copy is then the only cost the loop pays. Safe: the previous write has finished.
            dst = keep.get((file, key))
            if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned and t.device.type == "cuda")
            dst.copy_(t, non_blocking=pinned and t.device.type == "cuda")
            used[(file, key)] = dst
            return dst

        for name, obj in self._objects.items():
            stem = _STEMS.get(name, name)
            if isinstance(obj, torch.nn.Module):
                # get_state_dict may be a collective (FSDP/DeepSpeed): every rank calls it.
                sd = self.accelerator.get_state_dict(obj)
                if self.is_main:
                    fn = f"{stem}.safetensors"
                    files.append(_File(fn, tensors={k: host(fn, k, v) for k, v in sd.items()},
                                       metadata={"format": "pt"}))
                continue
            if not self.is_main:
                continue
            tensors, structure = sio.flatten(obj.state_dict(), prefix="t")
            files.append(_File(f"{stem}.json", data=sio.dumps(structure)))
            if tensors:
                fn = f"{stem}.safetensors"
                files.append(_File(fn, tensors={k: host(fn, k, v) for k, v in tensors.items()}))
        if self.is_main:
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                files.append(_File("scaler.json", data=sio.dumps(sio.flatten(scaler.state_dict())[1])))
            tensors, structure = sio.flatten(trainer_state)
            if tensors:
                raise TypeError("trainer_state must be JSON-serialisable (no tensors)")
            files.append(_File("trainer.json", data=sio.dumps(structure)))
        tensors, structure = sio.flatten(_rng_state(), prefix="t")
        files.append(_File(f"rng-rank{self.rank}.json", data=sio.dumps(structure)))
        fn = f"rng-rank{self.rank}.safetensors"
        files.append(_File(fn, tensors={k: host(fn, k, v) for k, v in tensors.items()}))
        if on_cuda:
            torch.cuda.synchronize()  # the non-blocking copies must land before the loop changes the state
        if self.config.reuse_buffers and copy:
            self._host_buffers = used
        return files

    # -- writing (background thread or inline)
    def _run_job(self, job: _Job) -> None:
        algo = self.config.checksum
        try:
            def write(f: _File) -> tuple[str, dict]:
                path = os.path.join(job.tmp_dir, f.name)
                if f.tensors is not None:
                    return path, sio.write_safetensors(path, f.tensors, f.metadata, fsync=False, checksum=algo,
                                                       writeback=self.config.fsync).to_json()
                return path, sio.write_bytes(path, f.data, fsync=False, checksum=algo).to_json()

            # Files are written (and checksummed) concurrently: a checksum is single-threaded per file, so
            # this is what lets sha256 keep up with a fast disk. fsyncs come after, in one batch.
            with ThreadPoolExecutor(max_workers=min(4, max(1, len(job.files))),
                                    thread_name_prefix="vidstab-ckpt-write") as ex:
                results = list(ex.map(write, job.files))
            digests = {os.path.basename(p): d for p, d in results}
            paths = [p for p, _ in results]
            job.files = []  # release the host copy early
            if not self.is_main:
                if self.config.fsync:
                    sio.fsync_files(paths)
                sio.write_bytes(os.path.join(job.tmp_dir, f".rank{self.rank}.done"),
                                json.dumps(digests).encode(), fsync=self.config.fsync)
                return
            digests.update(self._collect_ranks(job))
            self._finalize(job, digests, paths)
        except BaseException as e:  # noqa: BLE001 - surfaced by _finish_pending on every rank
            job.error = e if isinstance(e, CheckpointError) else CheckpointError(
                f"checkpoint {job.name} could not be written: {type(e).__name__}: {e}")
            if job.error is not e:
                job.error.__cause__ = e
            if self.is_main:
                shutil.rmtree(job.tmp_dir, ignore_errors=True)
            else:
                try:  # empty file: needs no data blocks, so it works on a full disk
                    os.close(os.open(os.path.join(job.tmp_dir, f".rank{self.rank}.failed"),
                                     os.O_WRONLY | os.O_CREAT, 0o644))
                except OSError:
                    pass

    def _collect_ranks(self, job: _Job) -> dict[str, dict]:
        out: dict[str, dict] = {}
        deadline = time.monotonic() + self.config.rank_timeout_s
        pending = set(range(self.world_size)) - {self.rank}
        while pending:
            for r in sorted(pending):
                if os.path.exists(os.path.join(job.tmp_dir, f".rank{r}.failed")):
                    raise CheckpointError(f"checkpoint {job.name} could not be written: rank {r} failed to write its files")
                done = os.path.join(job.tmp_dir, f".rank{r}.done")
                if os.path.exists(done):
                    with open(done, "rb") as fh:
                        out.update(json.loads(fh.read()))
                    os.unlink(done)
                    pending.discard(r)
            if pending:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"checkpoint {job.name}: ranks {sorted(pending)} did not finish writing "
                                          f"within {self.config.rank_timeout_s:.0f}s")
                time.sleep(0.02)
        return out

    def _finalize(self, job: _Job, digests: dict[str, dict], unsynced: list[str]) -> None:
        """Write the manifest, make everything durable, publish (rename, pointers), rotate.

        ``unsynced``: this process's data files, written but not yet fsync'd. They are fsync'd in one
        concurrent batch together with the manifest, the new pointer files' contents and the folder
        itself (one journal commit where the file system allows, instead of one per file); only then is
        the folder renamed to its ``step_*`` name, so a crash before that leaves a ``.tmp-*`` folder that
        is never loaded, and a crash after it finds every byte the manifest describes on disk."""
        from . import __version__

        manifest = {
            "schema": SCHEMA,
            "step": job.step,
            "files": dict(sorted(digests.items())),
            "healthy": bool(job.healthy and job.params_finite),
            "healthy_requested": bool(job.healthy),
            "params_finite": bool(job.params_finite),
            "config_hash": self.config_hash,
            "vidstab_version": __version__,
            "world_size": self.world_size,
            "objects": {n: _STEMS.get(n, n) for n in self._objects},
            "time": time.time(),
        }
        man_path = os.path.join(job.tmp_dir, MANIFEST)
        sio.write_bytes(man_path, json.dumps(manifest, indent=1).encode(), fsync=False)
        pointers: dict[str, str] = {}  # pointer -> its new content, written to a temp file
        try:
            for ptr in ("latest", "last_good") if manifest["healthy"] else ("latest",):
                pointers[ptr] = self._pointer_tmp(ptr, job.name, fsync=False)
            if self.config.fsync:
                # Data, manifest, pointer contents and the folder's entries durable before the rename.
                sio.fsync_files(unsynced + [man_path, *pointers.values(), job.tmp_dir])
            final = os.path.join(self.root, job.name)
            if os.path.lexists(final):
                # Same step saved again (e.g. after a rollback): move the old one aside first; rename cannot
                # replace a non-empty folder.
                trash = os.path.join(self.root, f"{_TMP_PREFIX}old-{job.name}-{secrets.token_hex(4)}")
                os.rename(final, trash)
                os.rename(job.tmp_dir, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(job.tmp_dir, final)
            for ptr, tmp in pointers.items():
                self._write_pointer(ptr, job.name, sync_root=False, tmp=tmp)
        except BaseException:
            for tmp in pointers.values():
                _unlink_quietly(tmp)  # the ones not yet moved into place
            raise
        # One directory fsync makes the rename and both pointer replacements durable. Should a crash keep
        # a pointer but lose the rename, load() ignores the dangling pointer and falls back to listing.
        if self.config.fsync:
            sio.fsync_dir(self.root)
        job.path = final
        seconds = time.perf_counter() - job.t0
        self._rotate()
        log_event(self.output_dir, self.rank, "checkpoint", job.step, path=_rel(final, self.output_dir),
                   healthy=manifest["healthy"], params_finite=job.params_finite, seconds=round(seconds, 4))
        logger.info("checkpoint %s written (%.2fs, healthy=%s)", final, seconds, manifest["healthy"])

    def _pointer_tmp(self, pointer: str, target: str, fsync: bool) -> str:
        """Write the new content of ``pointer`` to a temp file in the checkpoints folder; return its path."""
        tmp = os.path.join(self.root, f"{_TMP_PREFIX}ptr-{pointer}-{secrets.token_hex(4)}")
        sio.write_bytes(tmp, (target + "\n").encode(), fsync=fsync)
        return tmp

    def _write_pointer(self, pointer: str, target: str, sync_root: bool = True, tmp: str | None = None) -> None:
        """Replace ``pointer`` atomically with ``target``; ``tmp``: its content already written (and made
        durable) by :meth:`_pointer_tmp`."""
        if tmp is None:
            tmp = self._pointer_tmp(pointer, target, fsync=self.config.fsync)
        os.replace(tmp, os.path.join(self.root, pointer))
        if sync_root and self.config.fsync:
            sio.fsync_dir(self.root)

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

    def _rotate(self) -> None:
        infos = sorted(self.list(), key=lambda i: i.time, reverse=True)
        keep = {i.name for i in infos[: self.config.keep]}
        good = self._read_pointer("last_good")
        if good:
            keep.add(good)
        latest = self._read_pointer("latest")
        if latest:
            keep.add(latest)
        for i in infos:
            if i.name not in keep:
                # Rename first so a kill mid-delete never leaves a half-deleted folder under a step name.
                trash = os.path.join(self.root, f"{_TMP_PREFIX}del-{i.name}-{secrets.token_hex(4)}")
                try:
                    os.rename(i.path, trash)
                except OSError:
                    continue
                # The bytes are freed in the background: nothing depends on it, and a kill
                # mid-delete leaves a .tmp-* folder that the next start removes.
                t = threading.Thread(target=shutil.rmtree, args=(trash, True), name="vidstab-ckpt-rm")
                t.start()
                self._deleters.append(t)

    def _remove_stale(self) -> None:
        for n in os.listdir(self.root):
            if n.startswith(_TMP_PREFIX):
                p = os.path.join(self.root, n)
                logger.info("removing stale %s (left by an interrupted save)", p)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    try:
                        os.unlink(p)
                    except OSError:
                        pass

    # ------------------------------------------------------------------ listing
    def _read_pointer(self, pointer: str) -> str | None:
        try:
            with open(os.path.join(self.root, pointer)) as fh:
                name = fh.read().strip()
        except OSError:
            return None
        return name if _STEP_RE.match(name) else None

    def list(self) -> list[CheckpointInfo]:
        """Complete-looking checkpoints (a parseable manifest), oldest step first. Files are not verified."""
        out = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for n in names:
            m = _STEP_RE.match(n)
            if not m:
                continue
            p = os.path.join(self.root, n)
            try:
                with open(os.path.join(p, MANIFEST), "rb") as fh:
                    man = json.loads(fh.read())
                out.append(CheckpointInfo(p, n, int(man["step"]), bool(man.get("healthy")), float(man["time"]), man))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda i: (i.step, i.time))

    def _candidates(self, which: str) -> list[str]:
        infos = sorted(self.list(), key=lambda i: i.time, reverse=True)
        by_name = {i.name: i for i in infos}
        order: list[str] = []
        if which in ("latest", "last_good"):
            first = self._read_pointer(which)
            if first:
                order.append(os.path.join(self.root, first))
            pool = [i for i in infos if which == "latest" or i.healthy]
            if first in by_name:
                # Only older ones: anything newer than the pointer is from an abandoned trajectory
                # (before a rollback) or was never pointed at.
                t = by_name[first].time
                pool = [i for i in pool if i.time < t]
            order += [i.path for i in pool]
        else:
            path = which
            if not os.path.isabs(path) and not os.path.isdir(path):
                # "checkpoints/step_000100" or "step_000100" relative to the run folder
                for base in (self.output_dir, self.root):
                    if os.path.isdir(os.path.join(base, path)):
                        path = os.path.join(base, path)
                        break
            path = os.path.abspath(path)
            order.append(path)
            name = os.path.basename(os.path.normpath(path))
            if name in by_name:
                t = by_name[name].time
                order += [i.path for i in infos if i.time < t]
        seen, out = set(), []
        for p in order:
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out

    def latest_path_str(self) -> str | None:
        """``latest`` as a path relative to the output dir (e.g. ``checkpoints/step_000100``), from the
        pointer file without verifying the files (cheap: for incident bundles); None before the first save."""
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

    # ------------------------------------------------------------------ load
    def load(self, which: str = "latest") -> dict | None:
        """Load ``"latest"``, ``"last_good"`` or a checkpoint folder into everything registered.

        Every file is verified (present, size, checksum) and decoded before anything is applied; an
        invalid checkpoint is skipped with a warning in favour of the previous valid one. Returns the
        saved ``trainer_state`` plus ``"_checkpoint": {"path", "step", "skipped"}`` saying which
        checkpoint was used. Returns ``None`` when there is no checkpoint at all for ``"latest"`` /
        ``"last_good"`` (a fresh run); raises :class:`CheckpointError` if there are checkpoints but none
        is valid, or ``which`` is a folder and neither it nor an older one is valid.
        """
        self._finish_pending()
        cands = self._candidates(which)
        if not cands and which in ("latest", "last_good"):
            logger.info("no checkpoint under %s to resume from", self.root)
            return None
        skipped: list[list[str]] = []
        chosen, payload = -1, None
        if self.is_main:
            for i, p in enumerate(cands):
                try:
                    payload = self._read(p)
                    chosen = i
                    break
                except CheckpointError as e:
                    skipped.append([_rel(p, self.output_dir), str(e)])
                    logger.warning("skipping checkpoint %s: %s", p, e)
        chosen = self._broadcast_int(chosen)
        if chosen < 0:
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
        if skipped:
            logger.warning("loaded %s instead of %s (fell back past %d invalid checkpoint(s))",
                           path, cands[0], len(skipped))
        self._apply(payload)
        ts = dict(payload["trainer"])
        info = {"path": _rel(path, self.output_dir), "step": payload["manifest"]["step"], "skipped": skipped}
        ts["_checkpoint"] = info
        self.last_loaded = info
        return ts

    def _read(self, path: str, decode: bool = True) -> dict:
        """Verify every file of the checkpoint at ``path`` and (optionally) decode what this rank needs."""
        name = os.path.basename(os.path.normpath(path))
        man = _read_manifest(path)
        files = man["files"]
        needed: dict[str, str] = {}
        for n in self._objects:
            stem = _STEMS.get(n, n)
            if isinstance(self._objects[n], torch.nn.Module):
                needed[f"{stem}.safetensors"] = n
            else:
                needed[f"{stem}.json"] = n
        for f, n in needed.items():
            if f not in files:
                raise CheckpointError(f"{name}: has no state for {n!r} ({f})")
        raw: dict[str, bytes] = {}
        own_rng = {f"rng-rank{self.rank}.json", f"rng-rank{self.rank}.safetensors"}
        for f, meta in files.items():
            # Verify everything on the main process; other ranks check the sizes of all files and the
            # checksums of what they read.
            full = self.is_main or f in own_rng or not f.startswith("rng-rank")
            keep = decode and (not f.startswith("rng-rank") or f in own_rng)
            data = _verify_file(name, path, f, meta, keep=keep, checksum=full)
            if keep:
                raw[f] = data
        if not decode:
            return {"manifest": man}
        from safetensors.torch import load as st_load

        try:
            out: dict[str, Any] = {"manifest": man, "objects": {}}
            for n, obj in self._objects.items():
                stem = _STEMS.get(n, n)
                if isinstance(obj, torch.nn.Module):
                    sd = st_load(raw[f"{stem}.safetensors"])
                    self._check_model_keys(name, n, obj, sd)
                    out["objects"][n] = sd
                else:
                    tensors = st_load(raw[f"{stem}.safetensors"]) if f"{stem}.safetensors" in raw else {}
                    out["objects"][n] = sio.unflatten(sio.loads(raw[f"{stem}.json"]), tensors)
            out["scaler"] = sio.unflatten(sio.loads(raw["scaler.json"]), {}) if "scaler.json" in raw else None
            out["trainer"] = sio.unflatten(sio.loads(raw["trainer.json"]), {}) if "trainer.json" in raw else {}
            rj = f"rng-rank{self.rank}.json"
            if rj in raw:
                out["rng"] = sio.unflatten(sio.loads(raw[rj]), st_load(raw[f"rng-rank{self.rank}.safetensors"]))
            else:
                out["rng"] = None
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any decode problem makes the checkpoint invalid
            raise CheckpointError(f"{name}: cannot decode ({type(e).__name__}: {e})") from e
        if self.config_hash and man.get("config_hash") and man["config_hash"] != self.config_hash:
            logger.warning("%s was written with config %s, this run has config %s", name, man["config_hash"],
                           self.config_hash)
        return out

    def _check_model_keys(self, ckpt: str, name: str, model: torch.nn.Module, sd: dict) -> None:
        ref = self.accelerator.unwrap_model(model).state_dict()
        missing, extra = set(ref) - set(sd), set(sd) - set(ref)
        if missing or extra:
            raise CheckpointError(f"{ckpt}: {name!r} does not match the model (missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(extra)[:5]})")
        for k, v in sd.items():
            if tuple(v.shape) != tuple(ref[k].shape):
                raise CheckpointError(f"{ckpt}: {name}.{k} has shape {tuple(v.shape)}, model has {tuple(ref[k].shape)}")

    def _apply(self, payload: dict) -> None:
        for n, obj in self._objects.items():
            state = payload["objects"][n]
            if isinstance(obj, torch.nn.Module):
                self.accelerator.unwrap_model(obj).load_state_dict(state, strict=True)
            else:
                obj.load_state_dict(state)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and payload["scaler"] is not None:
            scaler.load_state_dict(payload["scaler"])
        if payload["rng"] is not None:
            _set_rng_state(payload["rng"])
        else:
            logger.warning("checkpoint has no RNG state for rank %d (world size changed?); RNG not restored",
                           self.rank)

    # ------------------------------------------------------------------ helpers
    def _params_finite(self) -> bool:
        flags = []
        for obj in self._objects.values():
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    t = p.detach()
                    if hasattr(t, "to_local"):
                        t = t.to_local()
                    if t.numel():
                        # A sum propagates NaN/Inf and is much cheaper than isfinite (no bool tensor per
                        # parameter); an fp32 sum overflowing on finite weights would itself be a sick model.
                        flags.append(t.sum(dtype=torch.float32))
        if not flags:
            return True
        ok = bool(torch.isfinite(torch.stack(flags).sum()).item())  # one reduction, one host sync
        return self._all_ok(ok)

    def _all_ok(self, ok: bool) -> bool:
        if self.world_size == 1:
            return ok
        t = torch.tensor([0 if ok else 1], device=self.accelerator.device)
        return int(self.accelerator.reduce(t, reduction="sum").item()) == 0

    def _broadcast_int(self, v: int) -> int:
        if self.world_size == 1:
            return v
        from accelerate.utils import broadcast

        t = torch.tensor([v], dtype=torch.int64, device=self.accelerator.device)
        return int(broadcast(t, from_process=0).item())

    def _shared_nonce(self) -> str:
        return f"{self._broadcast_int(secrets.randbits(31) if self.is_main else 0):08x}"



# ---------------------------------------------------------------------------- RNG


def _rng_state() -> dict:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in st and torch.cuda.is_available():
        states = st["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            logger.warning("checkpoint has %d CUDA RNG states, this process sees %d devices; CUDA RNG not restored",
                           len(states), torch.cuda.device_count())
