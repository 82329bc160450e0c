"""Durable, atomic file writes: what a reader finds is either the old file or the whole new one.

A file is written to a temporary name in the same folder, flushed and fsync'd, renamed over the target
(``os.replace`` is atomic on POSIX and Windows), and the folder is fsync'd so the rename itself survives a
power cut. Checkpoints, incident bundles, latent caches, reports and state files all go through here.

This module owns fsync by path: :func:`fsync_dir` (one folder) and :func:`fsync_paths` (many files and
folders at once). A writer that holds the open descriptor of the file it is writing calls ``os.fsync`` on
that descriptor itself; anything that opens a path just to make it durable uses these.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from .strict_json import dumps_strict

__all__ = ["AtomicFolder", "TMP_PREFIX", "atomic_folder", "fsync_dir", "fsync_paths", "publish_folder", "temp_folder",
           "write_atomic", "write_json_atomic"]

TMP_PREFIX = ".tmp-"
"""Names of folders being written (and of replaced ones being deleted) start with this: readers skip them,
and a writer may remove the ones a killed process left."""


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder so that entries created or renamed in it are durable.

    Where a platform cannot open a folder (Windows) the rename is still atomic, just not yet durable, so
    that case is skipped; an fsync error itself is raised.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically and (``fsync``) durably; returns the path.

    Readers polling for ``path`` see it only once it is complete: never an empty or partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
            while len(view):
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any, **dumps_kwargs: Any) -> Path:
    """:func:`write_atomic` of strict JSON: :func:`vidstab.files.strict_json.dumps_strict` (``obj``, indent=1,
    ``**dumps_kwargs``), so a non-finite number is written as ``"nan"``/``"inf"``/``"-inf"``."""
    dumps_kwargs.setdefault("indent", 1)
    return write_atomic(path, dumps_strict(obj, **dumps_kwargs) + "\n")


def fsync_paths(paths: list[str | os.PathLike]) -> None:
    """fsync files (and folders) concurrently: the file system can commit them in one journal transaction
    instead of one per file (small files dominate the count)."""
    def one(p: str | os.PathLike) -> None:
        if os.path.isdir(p):
            fsync_dir(p)
            return
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if len(paths) <= 1:
        for p in paths:
            one(p)
        return
    with ThreadPoolExecutor(max_workers=min(8, len(paths)), thread_name_prefix="vidstab-fsync") as ex:
        list(ex.map(one, paths))  # list() re-raises the first error


def temp_folder(parent: str | os.PathLike, name: str) -> Path:
    """Create ``parent/.tmp-{name}-{random}`` (mode 0755) to build the folder ``name`` in."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
    return tmp


def publish_folder(tmp: str | os.PathLike, final: str | os.PathLike, *,
                   exists: Literal["replace", "number"] = "replace", fsync: bool = True) -> Path:
    """Rename the completed folder ``tmp`` to ``final`` atomically; returns the path it got.

    ``fsync``: first make every file in ``tmp`` and ``tmp`` itself durable, and afterwards the parent folder
    (so the rename survives a power cut). Pass False when the caller has fsync'd already (and fsyncs the
    parent itself). ``exists``: what to do if ``final`` is taken -- ``"replace"`` moves the old folder aside
    (a rename cannot replace a non-empty folder), puts the new one in and deletes the old one, so a reader
    finds either whole; ``"number"`` never overwrites and uses ``final-2``, ``final-3``, ...
    """
    tmp, final = Path(tmp), Path(final)
    if fsync:
        fsync_paths([*(p for p in tmp.iterdir() if p.is_file()), tmp])
    if exists == "number":
        n, target = 1, final
        while True:
            try:
                os.rename(tmp, target)  # fails if `target` exists and is non-empty: never overwrite
                break
            except OSError:
                if not target.exists():
                    raise
                n += 1
                target = final.with_name(f"{final.name}-{n}")
        final, old = target, None
    elif exists == "replace":
        old = None
        if os.path.lexists(final):
            old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{secrets.token_hex(4)}")
            os.rename(final, old)
        os.rename(tmp, final)
    else:
        raise ValueError(f"exists must be 'replace' or 'number', not {exists!r}")
    if fsync:
        fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        # Old folders left by a replace that a crash interrupted are never in use: tidy them.
        for stale in final.parent.glob(f"{TMP_PREFIX}old-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
    return final


@dataclass
class AtomicFolder:
    """The folder being written by :func:`atomic_folder`."""

    tmp: Path
    """Where to write the files."""
    path: Path | None = None
    """The published folder, once the ``with`` block has finished without an error."""


@contextmanager
def atomic_folder(parent: str | os.PathLike, name: str, *, exists: Literal["replace", "number"] = "replace",
                  fsync: bool = True) -> Iterator[AtomicFolder]:
    """Build the folder ``parent/name`` so that readers see all of it or none of it.

    Files are written into ``folder.tmp``; when the block ends they are fsync'd and the folder is renamed
    into place (:func:`publish_folder`); on an error the temporary folder is removed. Example::

        with atomic_folder(run_dir / "incidents", "step000042", exists="number") as folder:
            (folder.tmp / "meta.json").write_text(text)
        print(folder.path)
    """
    folder = AtomicFolder(temp_folder(parent, name))
    try:
        yield folder
        folder.path = publish_folder(folder.tmp, Path(parent) / name, exists=exists, fsync=fsync)
    except BaseException:
        shutil.rmtree(folder.tmp, ignore_errors=True)
        raise
