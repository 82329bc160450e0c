"""Writing one checkpoint folder: files checksummed while written, ``manifest.json`` last, then publish.

1. Every rank writes its files into ``vidstab/checkpoints/.tmp-step_{STEP:06d}-{nonce}`` (the nonce is chosen by
   the main process and broadcast), checksumming each file while writing it, concurrently
   (:func:`write_files`).
2. The main process learns every other rank's file digests (:mod:`.manager` owns how: the ranks' barrier),
   writes ``manifest.json`` last and the new ``latest`` (and, when healthy, ``last_good``) pointer contents to
   temp files, fsyncs its data files, the manifest, the pointer temp files and the folder in one concurrent
   batch, renames the folder to ``step_{STEP:06d}`` (:func:`vidstab.files.atomic.publish_folder`), replaces the
   pointers atomically, fsyncs ``vidstab/checkpoints/`` (:func:`publish`), and only then rotates old ones
   (:func:`rotate`).

A crash before the rename leaves a ``.tmp-*`` folder that is never loaded; a crash after it finds every byte
the manifest describes on disk.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from ..files import statedict_io as sio
from ..files.atomic import TMP_PREFIX, fsync_dir, fsync_paths, publish_folder
from ..files.strict_json import dumps_strict
from .config import CheckpointError
from .layout import (MANIFEST, OTHER_RUN_PREFIX, SCHEMA, UNVERIFIED_PREFIX, check_carried_steps, pointer_tmp, read_manifest, read_pointer,
                     replace_pointer, rotation_order, set_aside_name)

__all__ = ["FileSpec", "SaveJob", "write_files", "write_manifest", "publish", "rotate"]

logger = logging.getLogger("vidstab.checkpoint")


@dataclass
class FileSpec:
    """One file of a checkpoint, as captured by a backend's snapshot."""

    name: str
    tensors: dict[str, torch.Tensor] | None = None
    """-> a safetensors file."""
    data: bytes | None = None
    """-> raw bytes (JSON)."""
    metadata: dict[str, str] | None = None
    """safetensors header metadata."""
    sharded: dict | None = None
    """-> tensors/DTensors handed to DCP by the sharded backend (a folder, not one file)."""
    write: bool = True
    """False: a replicated file another rank writes, staged here only for this rank's in-memory copy."""


@dataclass
class SaveJob:
    """One save in flight on one rank."""

    step: int
    """The step as the script counts it: the folder's name, the manifest's ``step``."""
    name: str
    tmp_dir: str
    files: list[FileSpec]
    healthy: bool
    params_finite: bool
    t0: float
    error: BaseException | None = None
    path: str | None = None
    digests: dict[str, dict] | None = None
    """This rank's files: name -> manifest entry (size and checksum), once written."""
    unsynced: list[str] | None = None
    """This rank's files, written but not yet fsync'd."""
    backend: str = "full"
    """Which backend wrote it (recorded in the manifest; the loader picks the same one)."""
    sharded_write: Callable[[], dict[str, dict]] | None = None
    """The sharded backend's DCP write (started or to run); returns its files' manifest entries."""
    check_staged: list[str] | None = None
    """Models whose parameters the writer checks for finiteness on the staged copy (async sharded saves)."""
    staged_finite: bool = True
    """This rank's answer to that check (True when there was nothing to check)."""
    steps: dict[str, dict[str, int]] | None = None
    """The step each JSON state file carries (:func:`~.layout.carried_steps`), for the manifest's ``steps``."""
    trajectory_step: int | None = None
    """The trajectory's step, where in-place rollbacks made it differ from ``step`` (:mod:`vidstab.step_numbering`)."""
    blocking: tuple[float, float] | None = None
    """An async save: (seconds the loop was blocked in ``save``, unix time it went on); a sync save blocks throughout."""


def write_files(job: SaveJob, checksum: str, fsync: bool) -> None:
    """Write ``job.files`` into ``job.tmp_dir``, checksummed while written (not fsync'd yet: the caller
    batches fsyncs); sets ``job.digests`` and ``job.unsynced`` and releases the host copy."""

    def write(f: FileSpec) -> tuple[str, dict]:
        path = os.path.join(job.tmp_dir, f.name)
        if f.tensors is not None:
            return path, sio.write_safetensors(path, f.tensors, f.metadata, fsync=False, checksum=checksum,
                                               writeback=fsync).to_json()
        return path, sio.write_bytes(path, f.data, fsync=False, checksum=checksum).to_json()

    # Files are written (and checksummed) concurrently: a checksum is single-threaded per file, so this is
    # what lets sha256 keep up with a fast disk. fsyncs come after, in one batch.
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(job.files))), thread_name_prefix="vidstab-ckpt-write") as ex:
        results = list(ex.map(write, job.files))
    job.digests = {os.path.basename(p): d for p, d in results}
    job.unsynced = [p for p, _ in results]
    job.files = []  # release the host copy early


def write_manifest(job: SaveJob, digests: dict[str, dict], **fields) -> dict:
    """Write ``manifest.json`` (not fsync'd) into ``job.tmp_dir``; returns it. ``fields`` are added to the
    standard ones (schema, step, files, health)."""
    manifest = {
        "schema": SCHEMA,
        "step": job.step,
        "files": dict(sorted(digests.items())),
        "healthy": bool(job.healthy and job.params_finite),
        "healthy_requested": bool(job.healthy),
        "params_finite": bool(job.params_finite),
        **fields,
        "time": time.time(),
    }
    sio.write_bytes(os.path.join(job.tmp_dir, MANIFEST), dumps_strict(manifest, indent=1).encode(), fsync=False)
    return manifest


def publish(job: SaveJob, root: str, healthy: bool, unsynced: list[str], fsync: bool,
            replace=replace_pointer, unmovable=None, run_id: str | None = None) -> str:
    """Make the folder durable, rename it to its ``step_*`` name and move the pointers; returns its path.

    ``unsynced``: files written but not yet fsync'd. They are fsync'd in one concurrent batch together with
    the manifest, the new pointer files' contents and the folder itself (one journal commit where the file
    system allows, instead of one per file). ``replace``: how a pointer is replaced (the manager's hook).

    A folder of the same step that cannot be moved aside (a damaged checkpoint on a read-only mount, an
    immutable file) does not fail the save: it is published as ``step_N-2`` (``-3``, ...), ``job.name``
    becomes that name, and ``unmovable(job, error, new_name)`` is called (the manager says what to clean
    up) before the pointers move. A same-step folder that cannot be verified, or is another run's than
    ``run_id``'s, is moved aside (never replaced): see :func:`_keep_unverifiable`."""
    pointers: dict[str, str] = {}  # pointer -> its new content, written to a temp file
    try:
        for ptr in ("latest", "last_good") if healthy else ("latest",):
            pointers[ptr] = pointer_tmp(root, ptr, job.name, fsync=False)
        if fsync:
            fsync_paths(unsynced + [os.path.join(job.tmp_dir, MANIFEST), *pointers.values(), job.tmp_dir])
        _keep_unverifiable(root, job.name, run_id)
        # Same step saved again (e.g. after a rollback): the old folder is moved aside and deleted.
        try:
            final = str(publish_folder(job.tmp_dir, os.path.join(root, job.name), exists="replace", fsync=False))
        except OSError as e:
            if not os.path.isdir(job.tmp_dir) or not os.path.lexists(os.path.join(root, job.name)):
                raise
            # The old folder cannot be moved aside (read-only, immutable): this save goes next to it.
            final = str(publish_folder(job.tmp_dir, os.path.join(root, job.name), exists="number", fsync=False))
            old_name, job.name = job.name, os.path.basename(final)
            if unmovable is not None:
                unmovable(job, e, old_name)
            for ptr in pointers:
                os.unlink(pointers[ptr])
                pointers[ptr] = pointer_tmp(root, ptr, job.name, fsync=fsync)
        for ptr, tmp in pointers.items():
            replace(ptr, job.name, sync_root=False, tmp=tmp)
    except BaseException:
        for tmp in pointers.values():
            try:
                os.unlink(tmp)  # the ones not yet moved into place
            except OSError:
                pass
        raise
    # One directory fsync makes the rename and both pointer replacements durable. Should a crash keep a
    # pointer but lose the rename, load() ignores the dangling pointer and falls back to listing.
    if fsync:
        fsync_dir(root)
    return final


def _keep_unverifiable(root: str, name: str, run_id: str | None = None) -> None:
    """A same-step folder whose manifest cannot be read (or whose files disagree on the step) is not vidstab's
    to delete (it may be the only copy of a run whose manifests were lost): rename it to ``unverified-{name}``
    and say so; another run's checkpoint likewise goes to ``other-run-{name}``."""
    path = os.path.join(root, name)
    if not os.path.isdir(path) or os.path.islink(path):
        return
    prefix = UNVERIFIED_PREFIX
    try:
        man = read_manifest(path)
        check_carried_steps(path, man)
        theirs = man.get("run_id")
        if run_id is None or theirs in (None, run_id):
            return
        why, prefix = f"a checkpoint of another run, {theirs}", OTHER_RUN_PREFIX
    except CheckpointError as e:
        why = str(e)
    target = set_aside_name(root, name, prefix)
    try:
        os.rename(path, os.path.join(root, target))
    except OSError:
        return  # publish then goes next to it (step_N-2), as for any folder that cannot be moved
    logger.warning("checkpoint folder %s is not this run's to replace (%s); moved to %s instead", path, why, target)


_unremovable: set[str] = set()


def rotate(root: str, keep: int, protected: set[str] = frozenset(), run_id: str | None = None) -> list[threading.Thread]:
    """Delete all but the ``keep`` checkpoints most worth keeping (:func:`~.layout.rotation_order`: the
    newest checkpoint's trajectory by step, then abandoned ones), the ``protected`` folder names and those
    ``latest``/``last_good`` name; returns the threads freeing the bytes. One that cannot be removed is
    left, with a warning (once). Only the run ``run_id``'s checkpoints are counted or deleted: another run's
    and unverifiable folders are left as they are."""
    order = rotation_order(root, run_id)
    kept = {i.name for i in order[:keep]} | set(protected)
    for ptr in ("last_good", "latest"):
        name = read_pointer(root, ptr)
        if name:
            kept.add(name)
    threads = []
    for i in order:
        if i.name not in kept:
            # Rename first so a kill mid-delete never leaves a half-deleted folder under a step name.
            trash = os.path.join(root, f"{TMP_PREFIX}del-{i.name}-{secrets.token_hex(4)}")
            try:
                os.rename(i.path, trash)
            except OSError as e:
                if i.path not in _unremovable:
                    _unremovable.add(i.path)
                    logger.warning("rotation cannot remove old checkpoint %s (%s: read-only or immutable?); remove it "
                                   "by hand when you can (e.g. `chattr -R -i` it, or remount read-write)", i.path, e)
                continue
            # The bytes are freed in the background: nothing depends on it, and a kill mid-delete leaves a
            # .tmp-* folder that the next start removes.
            t = threading.Thread(target=shutil.rmtree, args=(trash, True), name="vidstab-ckpt-rm")
            t.start()
            threads.append(t)
    return threads
