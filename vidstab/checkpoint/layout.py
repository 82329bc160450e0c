"""The on-disk layout of a checkpoint run: names, the manifest, pointer files, listing and verification.

::

    OUTPUT_DIR/checkpoints/step_000100/   the files of one checkpoint + manifest.json (written last)
    OUTPUT_DIR/checkpoints/latest         pointer file: folder name of the newest complete checkpoint
    OUTPUT_DIR/checkpoints/last_good      pointer file: newest checkpoint that passed the health gate
    OUTPUT_DIR/checkpoints/.tmp-*         a save in progress, or the remains of a killed one: never loaded

A folder counts as a checkpoint only with a parseable ``manifest.json`` of this :data:`SCHEMA`; every file
it lists carries its size and a checksum, checked before anything is decoded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from typing import Any

from .. import statedict_io as sio
from ..atomic import TMP_PREFIX, fsync_dir
from .config import CheckpointError, CheckpointInfo

__all__ = ["MANIFEST", "SCHEMA", "STEP_RE", "TMP_PREFIX", "POINTERS", "step_name", "file_stem", "rel",
           "read_manifest", "verify_file", "verify_checkpoint_files", "read_pointer", "pointer_tmp",
           "replace_pointer", "list_checkpoints", "candidates", "remove_stale"]

logger = logging.getLogger("vidstab.checkpoint")

MANIFEST = "manifest.json"
SCHEMA = 1
STEP_RE = re.compile(r"^step_(\d+)$")
POINTERS = ("latest", "last_good")
# Registered names whose files are spelled differently in the documented layout.
_STEMS = {"lr_scheduler": "scheduler"}
RESERVED = {"manifest", "trainer", "scaler"}
PICKLE_SUFFIXES = (".pt", ".bin", ".pkl", ".pickle", ".metadata")


def step_name(step: int) -> str:
    """Folder name of the checkpoint of ``step``: ``step_000100``."""
    return f"step_{int(step):06d}"


def file_stem(name: str) -> str:
    """File stem of the registered object ``name`` (``lr_scheduler`` -> ``scheduler``)."""
    return _STEMS.get(name, name)


def rel(path: str, root: str) -> str:
    """``path`` relative to ``root`` where possible (for messages and event logs)."""
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return path


# ---------------------------------------------------------------------------- verification


def read_manifest(path: str) -> dict:
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
    for bad in (f for f in files if f.endswith(PICKLE_SUFFIXES)):
        raise CheckpointError(f"{name}: refusing pickled file {bad}")
    return man


def verify_file(ckpt: str, path: str, f: str, meta: Any, keep: bool = False, checksum: bool = True) -> bytes | None:
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
    files = read_manifest(path)["files"]
    for f in files if names is None else names:
        if f not in files:
            raise CheckpointError(f"{ckpt}: file {f} is not listed in its manifest.json")
        verify_file(ckpt, path, f, files[f])


# ---------------------------------------------------------------------------- pointers


def read_pointer(root: str, pointer: str) -> str | None:
    """Folder name the pointer file ``root/pointer`` names, or None (absent, unreadable, not a step name)."""
    try:
        with open(os.path.join(root, pointer)) as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return name if STEP_RE.match(name) else None


def pointer_tmp(root: str, pointer: str, target: str, fsync: bool) -> str:
    """Write the new content of ``pointer`` to a temp file in ``root``; return its path."""
    tmp = os.path.join(root, f"{TMP_PREFIX}ptr-{pointer}-{secrets.token_hex(4)}")
    sio.write_bytes(tmp, (target + "\n").encode(), fsync=fsync)
    return tmp


def replace_pointer(root: str, pointer: str, target: str, fsync: bool, sync_root: bool = True,
                    tmp: str | None = None) -> None:
    """Replace ``pointer`` atomically with ``target``; ``tmp``: its content already written (and made
    durable) by :func:`pointer_tmp`."""
    if tmp is None:
        tmp = pointer_tmp(root, pointer, target, fsync=fsync)
    os.replace(tmp, os.path.join(root, pointer))
    if sync_root and fsync:
        fsync_dir(root)


# ---------------------------------------------------------------------------- listing


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Complete-looking checkpoints under ``root`` (a parseable manifest), oldest step first. Files are not
    verified."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for n in names:
        if not STEP_RE.match(n):
            continue
        p = os.path.join(root, n)
        try:
            with open(os.path.join(p, MANIFEST), "rb") as fh:
                man = json.loads(fh.read())
            out.append(CheckpointInfo(p, n, int(man["step"]), bool(man.get("healthy")), float(man["time"]), man))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda i: (i.step, i.time))


def candidates(root: str, output_dir: str, which: str) -> list[str]:
    """Folders to try, in order, for ``load(which)``: the pointer's target (``"latest"``/``"last_good"``) or
    the named folder, then older checkpoints (healthy ones only for ``"last_good"``), newest first.
    Anything newer than the pointer's target is from an abandoned trajectory and never a candidate."""
    infos = sorted(list_checkpoints(root), key=lambda i: i.time, reverse=True)
    by_name = {i.name: i for i in infos}
    order: list[str] = []
    if which in POINTERS:
        first = read_pointer(root, which)
        if first:
            order.append(os.path.join(root, first))
        pool = [i for i in infos if which == "latest" or i.healthy]
        if first in by_name:
            t = by_name[first].time
            pool = [i for i in pool if i.time < t]
        order += [i.path for i in pool]
    else:
        path = which
        if not os.path.isabs(path) and not os.path.isdir(path):
            # "checkpoints/step_000100" or "step_000100" relative to the run folder
            for base in (output_dir, root):
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


def remove_stale(root: str) -> None:
    """Remove ``.tmp-*`` entries of ``root``: saves, pointer updates and deletions a kill interrupted."""
    for n in os.listdir(root):
        if n.startswith(TMP_PREFIX):
            p = os.path.join(root, n)
            logger.info("removing stale %s (left by an interrupted save)", p)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass
