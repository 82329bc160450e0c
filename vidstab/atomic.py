"""Durable, atomic file writes: what a reader finds is either the old file or the whole new one.

A file is written to a temporary name in the same folder, flushed and fsync'd, renamed over the target
(``os.replace`` is atomic on POSIX and Windows), and the folder is fsync'd so the rename itself survives a
power cut. Checkpoints, incident bundles, latent caches, reports and state files all go through here.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_atomic", "write_json_atomic"]


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
    """:func:`write_atomic` of ``json.dumps(obj, indent=1, **dumps_kwargs)``."""
    dumps_kwargs.setdefault("indent", 1)
    return write_atomic(path, json.dumps(obj, **dumps_kwargs) + "\n")
