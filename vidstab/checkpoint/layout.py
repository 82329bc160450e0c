"""The on-disk layout of a checkpoint run: names, the manifest, pointer files, listing, order and verification.

::

    OUTPUT_DIR/vidstab/checkpoints/step_000100/   the files of one checkpoint + manifest.json (written last)
    OUTPUT_DIR/vidstab/checkpoints/step_000100-2/ the same step saved again while a damaged step_000100
                                                  could not be moved aside (read-only, immutable)
    OUTPUT_DIR/vidstab/checkpoints/latest         pointer file: folder name of the newest complete checkpoint
    OUTPUT_DIR/vidstab/checkpoints/last_good      pointer file: newest checkpoint that passed the health gate
    OUTPUT_DIR/vidstab/checkpoints/.tmp-*         a save in progress, or the remains of a killed one: never loaded

The folder sits under the run's ``vidstab/`` folder so that it coexists with Accelerate's automatic
checkpoint naming (``OUTPUT_DIR/checkpoints/checkpoint_N`` + ``total_limit``) and with diffusers' training
examples, which take every ``OUTPUT_DIR/checkpoint*`` entry for one of their ``checkpoint-N`` folders.

A folder counts as a checkpoint only with a well-formed ``manifest.json`` of this :data:`SCHEMA`; every file
it lists carries its size and a checksum, checked before anything is decoded. Checkpoints travel (shared
storage, other people), so nothing a folder holds is trusted further than this: every name in a manifest
must be a plain relative name inside the folder (no ``..``, no absolute path, no link on the way) and is
opened only after ``lstat`` shows a regular file (no symbolic link, FIFO or device), without following
links and without blocking; sizes are compared before a byte is read, and no read goes past the recorded size. Pointer files
and manifests that cannot be read for any reason (bytes that are not UTF-8, the wrong JSON shape, a FIFO)
count as damaged, like missing ones.

Order never comes from the wall clock: each manifest records its save ``sequence`` (one more than any
checkpoint on disk had) and its ``parent`` (the checkpoint the saved state descends from: the previous save,
or the one loaded on resume or rollback). The newest checkpoint is the one ``latest`` names, else the highest
sequence; its *trajectory* is its chain of parents, so after a rollback the abandoned checkpoints (newer
steps of the old trajectory) are never fallbacks and are the first to be rotated away.

Steps are the script's (:mod:`vidstab.step_numbering`): the folder is named after the step the script had counted
when it saved, and the manifest's ``step`` says the same. Where in-place rollbacks (the attached form's
``rollback_every``) made the trajectory's step (the steps the weights took) differ, the manifest records it as
``trajectory_step``; a manifest without one (written before it was recorded) is of a step that was both.

A checkpoint knows its run and its step. The manifest records the ``run_id`` of the run that wrote it
(:func:`vidstab.run.run_dir.run_id`) and, in ``steps``, the state files that carried the checkpoint's step when
it was saved (``{"trainer.json": {"step": 12}, "vidstab.json": {"step_count": 12}}``). The folder name, the manifest's
``step`` and those files must agree, or the folder is *unverifiable* like one without a manifest: never
loaded, rotated or replaced, and named when a resume finds nothing else. A checkpoint of another run (a
copied folder, a pointer to one) is listed but is no checkpoint of this run: never a fallback, never rotated
away; reached through a pointer or named, it is refused naming both runs unless
``CheckpointConfig.allow_other_run``. A folder reached through a symbolic link is refused likewise: folders
are followed only inside the run's checkpoint folder. Checkpoints written before run ids were recorded
count as the run's own (one warning when loaded).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import secrets
import shutil
import stat
import threading
from typing import Any, Iterator

from ..files import statedict_io as sio
from ..files.atomic import TMP_PREFIX, fsync_dir
from ..files.limits import env_name, limits, loads_bounded
from ..run.run_dir import RUN_ID_RE
from .config import CheckpointError, CheckpointInfo, trajectory_step_of

__all__ = ["MANIFEST", "SCHEMA", "STEP_RE", "TMP_PREFIX", "POINTERS", "step_name", "file_stem", "rel",
           "read_manifest", "verify_file", "verify_checkpoint_files", "read_pointer", "pointer_tmp",
           "replace_pointer", "list_checkpoints", "candidates", "trajectory", "newest", "rotation_order",
           "remove_stale", "check_file_name", "manifest_entry", "unverifiable", "UNVERIFIED_PREFIX",
           "OTHER_RUN_PREFIX", "set_aside_name", "parse_once", "check_carried_steps", "STEP_KEYS", "carried_steps",
           "own_checkpoints", "other_run_error", "trajectory_step_of"]

logger = logging.getLogger("vidstab.checkpoint")

MANIFEST = "manifest.json"
SCHEMA = 1
STEP_RE = re.compile(r"^step_(\d+)(?:-(\d+))?$")
"""A checkpoint folder: ``step_000100``, or ``step_000100-2`` (see the module doc)."""
POINTERS = ("latest", "last_good")
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,254}")
"""One component of a name a manifest may list: no separator, no leading dot (so never ``..``), at most 255
characters. A name is one such component, or a few joined by ``/`` (e.g. the DCP backend's ``dcp/shard-*``),
each an actual folder inside the checkpoint (never a link)."""
MAX_DEPTH = 3
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest is a few kB (one entry per file); anything this large is not one, and is never read."""
MAX_POINTER_BYTES = 4096
"""A pointer file holds one folder name."""
# Registered names whose files are spelled differently in the documented layout.
_STEMS = {"lr_scheduler": "scheduler"}
RESERVED = {"manifest", "trainer", "scaler"}
PICKLE_SUFFIXES = (".pt", ".bin", ".pkl", ".pickle", ".metadata")
STEP_KEYS = ("step", "step_count")
"""Top-level keys of a JSON state file that carry the step it was saved at (``trainer.json``'s ``step``, the
guard's ``step_count``): recorded in the manifest's ``steps`` and checked against the file."""


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


# ---------------------------------------------------------------------------- opening files safely


class _NotRegular(Exception):
    """``lstat`` shows something other than a regular file (the message says what)."""


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return what
    return "not a regular file"


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_regular(folder: str, name: str) -> tuple[int, int]:
    """Open the regular file ``folder/name`` for reading without following a link (in ``name``; ``folder``
    is taken as given) or blocking; returns ``(fd, size)``. Raises FileNotFoundError, :class:`_NotRegular`
    or OSError."""
    parts = name.split("/")
    dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        # Each step is relative to the folder already opened: nothing swapped in meanwhile is followed.
        for part in parts[:-1]:
            st = os.stat(part, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise _NotRegular(f"inside {_kind(st.st_mode)} ({part})")
            sub = os.open(part, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd = sub
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise _NotRegular(_kind(st.st_mode))
        # O_NOFOLLOW and O_NONBLOCK: should the file be swapped for a link or a FIFO after the stat, the open
        # fails or returns at once instead of following it or blocking; fstat then sees what was opened.
        fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=dfd)
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _NotRegular(_kind(st.st_mode))
    return fd, st.st_size


def _read_exactly(fd: int, size: int) -> bytes:
    """The ``size`` bytes of the file open as ``fd`` (closed afterwards); ValueError if it has more or fewer
    (it changed since its size was checked). Never reads more than ``size + 1`` bytes."""
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(size + 1)
    if len(data) != size:
        raise ValueError(f"changed while being read ({len(data)}{'+' if len(data) > size else ''} bytes, expected {size})")
    return data


def check_file_name(ckpt: str, name: Any) -> None:
    """Raise :class:`CheckpointError` unless ``name`` is a plain file name inside a checkpoint folder."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or len(parts) > MAX_DEPTH or not all(PLAIN_NAME.fullmatch(p) for p in parts):
        raise CheckpointError(f"{ckpt}: manifest lists {name!r}, not a plain file name inside the checkpoint folder "
                              "(refused before opening anything)")


# ---------------------------------------------------------------------------- verification


def _check_manifest(name: str, man: Any) -> dict:
    """The manifest ``man`` if it has the shape vidstab writes; CheckpointError naming what is wrong."""
    if not isinstance(man, dict):
        raise CheckpointError(f"{name}: unreadable manifest (a JSON {type(man).__name__}, not an object)")
    if man.get("schema") != SCHEMA:
        raise CheckpointError(f"{name}: unsupported manifest schema {man.get('schema')!r}")
    step, files = man.get("step"), man.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{name}: unreadable manifest ('step' is {step!r}, not a step number)")
    if not isinstance(files, dict):
        raise CheckpointError(f"{name}: unreadable manifest ('files' is a {type(files).__name__}, not an object)")
    for f, meta in files.items():
        check_file_name(name, f)
        if f.endswith(PICKLE_SUFFIXES):
            raise CheckpointError(f"{name}: refusing pickled file {f}")
        size = meta.get("bytes") if isinstance(meta, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(f"{name}: manifest entry for {f} is malformed ({meta!r})")
    for key, kind in (("healthy", bool), ("world_size", int), ("sequence", int), ("time", (int, float))):
        if key in man and man[key] is not None and (not isinstance(man[key], kind) or (kind is int and isinstance(man[key], bool))):
            raise CheckpointError(f"{name}: unreadable manifest ({key!r} is {man[key]!r})")
    rid = man.get("run_id")
    if rid is not None and not (isinstance(rid, str) and RUN_ID_RE.fullmatch(rid)):
        raise CheckpointError(f"{name}: unreadable manifest ('run_id' is {str(rid)[:80]!r})")
    trajectory = man.get("trajectory_step")
    if trajectory is not None and (not isinstance(trajectory, int) or isinstance(trajectory, bool) or trajectory < 0):
        raise CheckpointError(f"{name}: unreadable manifest ('trajectory_step' is {str(trajectory)[:40]!r})")
    steps = man.get("steps")
    if steps is not None and not (isinstance(steps, dict) and all(
            isinstance(f, str) and isinstance(keys, dict) and all(
                k in STEP_KEYS and isinstance(v, int) and not isinstance(v, bool) for k, v in keys.items())
            for f, keys in steps.items())):
        raise CheckpointError(f"{name}: unreadable manifest ('steps' is {str(steps)[:80]!r})")
    m = STEP_RE.match(name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{name}: the folder name says step {int(m.group(1))}, its manifest says step {step} "
                              "(renamed, copied or edited?)")
    return man


_scope = threading.local()


@contextlib.contextmanager
def parse_once() -> Iterator[None]:
    """Within this block, on this thread, each manifest file is parsed (and checked) once, however often it is
    read (one resume lists, orders, checks and loads the same manifests): a file is known by its device,
    inode, size and modification time, so a manifest replaced meanwhile is read again."""
    if getattr(_scope, "cache", None) is not None:
        yield
        return
    _scope.cache = {}
    try:
        yield
    finally:
        _scope.cache = None


def read_manifest(path: str) -> dict:
    """Parse and check ``path/manifest.json``; raise :class:`CheckpointError` if it is missing, not a regular
    file, too large, not UTF-8 JSON of the expected shape, of another schema, or lists a pickled file or a
    name outside the folder."""
    name = os.path.basename(os.path.normpath(path))
    cache, key = getattr(_scope, "cache", None), None
    try:
        fd, size = _open_regular(path, MANIFEST)
        if cache is not None:
            st = os.fstat(fd)
            key = (name, st.st_dev, st.st_ino, size, st.st_mtime_ns)
            if key in cache:
                os.close(fd)
                return _cached(cache[key])
        if size > MAX_MANIFEST_BYTES:
            os.close(fd)
            raise ValueError(f"{size} bytes, far more than any manifest")
        man = loads_bounded(_read_exactly(fd, size), MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{name}: no manifest.json (incomplete save)") from None
    except _NotRegular as e:
        raise CheckpointError(f"{name}: unreadable manifest (manifest.json is {e})") from None
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        result: dict | CheckpointError = CheckpointError(f"{name}: unreadable manifest ({e})")
    else:
        try:
            result = _check_manifest(name, man)
        except CheckpointError as e:
            result = e
    if key is not None:
        cache[key] = result
    return _cached(result)


def _cached(result: dict | CheckpointError) -> dict:
    if isinstance(result, CheckpointError):
        raise CheckpointError(str(result))
    return result


def carried_steps(states: dict[str, Any], step: int) -> dict[str, dict[str, int]]:
    """``{file: {key: step}}`` for the JSON states ``{file: state}`` that carry the checkpoint's ``step``
    (:data:`STEP_KEYS` at top level; a state counting steps otherwise is not checked): what a save records in
    the manifest's ``steps``."""
    out = {}
    for f, state in states.items():
        keys = {k: step for k in STEP_KEYS if isinstance(state, dict) and state.get(k) == step
                and isinstance(state.get(k), int) and not isinstance(state.get(k), bool)}
        if keys:
            out[f] = keys
    return out


def check_carried_steps(path: str, man: dict) -> None:
    """Raise :class:`CheckpointError` unless every file the manifest's ``steps`` names (verified against its
    entry, at most the JSON cap) still carries the manifest's step, as it did when saved: a ``trainer.json`` or
    guard state of another step (copied in, edited, manifest recomputed), or a manifest's step edited, makes
    the folder unverifiable."""
    name = os.path.basename(os.path.normpath(path))
    cap = limits().json_bytes
    for f, keys in (man.get("steps") or {}).items():
        meta = man["files"].get(f)
        if meta is None:
            raise CheckpointError(f"{name}: its manifest records the step of {f}, which it does not list")
        if meta["bytes"] > cap:
            raise CheckpointError(f"{name}: {f} is {meta['bytes']} bytes, more than the {cap} allowed for a JSON "
                                  f"state file ({env_name('json_bytes')}); refused unread")
        try:
            state = loads_bounded(verify_file(name, path, f, meta, keep=True), f)
        except ValueError as e:
            raise CheckpointError(f"{name}: {f} cannot be read ({e})") from None
        for k, want in keys.items():
            got = state.get(k) if isinstance(state, dict) else None
            if got != want or want != man["step"]:
                raise CheckpointError(f"{name}: {f} says {k} {str(got)[:40]}, its manifest says step {man['step']}: "
                                      "the files disagree (copied or edited?)")


def manifest_entry(path: str | os.PathLike, file: str) -> dict | None:
    """The manifest entry (size and checksum) of ``file`` in the checkpoint folder ``path``, or None when the
    manifest is missing or damaged or does not list it. Identifies the file's content without reading it
    (incident bundles record it for the weights they name)."""
    try:
        entry = read_manifest(os.fspath(path))["files"].get(file)
    except CheckpointError:
        return None
    return dict(entry) if isinstance(entry, dict) else None


def verify_file(ckpt: str, path: str, f: str, meta: Any, keep: bool = False, checksum: bool = True) -> bytes | None:
    """Check ``path/f`` against its manifest entry ``meta``: a plain name, a regular file (no link, FIFO or
    device), its size, and (``checksum``) every checksum the entry records (``crc32`` and/or ``sha256``).
    The size is compared before anything is read, and no read goes past it. Returns the file's bytes when
    ``keep`` (read once, for decoding); otherwise streams the file in constant memory."""
    check_file_name(ckpt, f)
    size = meta.get("bytes") if isinstance(meta, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CheckpointError(f"{ckpt}: manifest entry for {f} is malformed ({meta!r})")
    want = [(a, meta[a]) for a in sio.CHECKSUMS if a in meta]
    if not want:
        raise CheckpointError(f"{ckpt}: manifest records no checksum for {f} (expected one of "
                              f"{', '.join(sio.CHECKSUMS)}; has {sorted(meta)})")
    try:
        fd, actual = _open_regular(path, f)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: file {f} is missing") from None
    except _NotRegular as e:
        raise CheckpointError(f"{ckpt}: file {f} is {e}, not a regular file (refused)") from None
    except OSError as e:
        raise CheckpointError(f"{ckpt}: file {f} cannot be opened ({e})") from None
    try:
        if actual != size:
            why = "truncated?" if actual < size else "overwritten?"
            raise CheckpointError(f"{ckpt}: file {f} has {actual} bytes, manifest says {size} ({why})")
        if not checksum:
            return None
        hashers = [(a, sio.new_checksum(a), str(d).lower()) for a, d in want]
        data = None
        if keep:
            owned, fd = fd, -1  # _read_exactly closes it
            data = _read_exactly(owned, size)
            for _, h, _ in hashers:
                h.update(data)
        else:
            buf = bytearray(min(1 << 22, size + 1))
            mv, total = memoryview(buf), 0
            with os.fdopen(fd, "rb", buffering=0) as fh:
                fd = -1
                while total <= size and (n := fh.readinto(buf)):
                    total += n
                    for _, h, _ in hashers:
                        h.update(mv[:n])
            if total != size:
                raise ValueError(f"changed while being read ({total} bytes, expected {size})")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: file {f} cannot be read ({e})") from None
    finally:
        if fd >= 0:
            os.close(fd)
    for a, h, d in hashers:
        if h.hexdigest() != d:
            raise CheckpointError(f"{ckpt}: file {f} is corrupt ({a} mismatch)")
    return data


def verify_checkpoint_files(path: str | os.PathLike, names: list[str] | None = None) -> None:
    """Check the files of the checkpoint folder ``path`` against its ``manifest.json``.

    Each file (``names``, or every file the manifest lists when ``None``) must be listed, a plain file name
    inside the folder, a regular file (no link, FIFO or device), of the recorded size and match the recorded
    checksum -- whichever the manifest records for it (``crc32``, the default since vidstab writes it, or
    ``sha256`` in older or ``checksum="sha256"`` checkpoints). Files are streamed (constant memory), never
    past their recorded size, and nothing blocks. Raises :class:`CheckpointError` whose message names the
    checkpoint folder, the file and the problem (no/unreadable manifest, not listed, not a plain name, not
    a regular file, missing, size, checksum). Does not decode anything.
    """
    path = os.fspath(path)
    ckpt = os.path.basename(os.path.normpath(path))
    files = read_manifest(path)["files"]
    for f in files if names is None else names:
        if f not in files:
            raise CheckpointError(f"{ckpt}: file {f} is not listed in its manifest.json")
        verify_file(ckpt, path, f, files[f])


# ---------------------------------------------------------------------------- pointers


_reported: set[tuple[str, str]] = set()


def _damaged_pointer(path: str, why: str) -> None:
    if (path, why) not in _reported:  # once per pointer and problem, not at every look-up
        _reported.add((path, why))
        logger.warning("pointer file %s is damaged (%s); treating it as missing: the newest checkpoint is found "
                       "from the manifests instead (the next save rewrites it)", path, why)


def read_pointer(root: str, pointer: str) -> str | None:
    """Folder name the pointer file ``root/pointer`` names, or None when it is absent or damaged (not a
    regular file, too large, not ASCII, not a checkpoint folder name): a damaged pointer is a missing one."""
    path = os.path.join(root, pointer)
    try:
        fd, size = _open_regular(root, pointer)
        if size > MAX_POINTER_BYTES:
            os.close(fd)
            raise ValueError(f"{size} bytes")
        name = _read_exactly(fd, size).decode("ascii").strip()
    except FileNotFoundError:
        return None
    except (_NotRegular, OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        _damaged_pointer(path, str(e) or type(e).__name__)
        return None
    if not STEP_RE.match(name):
        _damaged_pointer(path, f"names {name[:40]!r}, not a checkpoint folder")
        return None
    return name


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


def _step_folders(root: str):
    """``(name, path, manifest or the CheckpointError saying why it cannot be read)`` of every ``step_*``
    folder (not a link) under ``root``."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for n in names:
        if not STEP_RE.match(n):
            continue
        p = os.path.join(root, n)
        try:
            if not stat.S_ISDIR(os.lstat(p).st_mode):
                continue
            man: dict | CheckpointError = read_manifest(p)
            check_carried_steps(p, man)
        except OSError:
            continue
        except CheckpointError as e:
            man = e
        yield n, p, man


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Complete-looking checkpoints under ``root`` (a well-formed manifest; folders, not links), oldest step
    first. Files are not verified."""
    out = []
    for n, p, man in _step_folders(root):
        if isinstance(man, CheckpointError):
            continue
        t = man.get("time")
        out.append(CheckpointInfo(p, n, man["step"], bool(man.get("healthy")), float(t) if t is not None else 0.0, man))
    return sorted(out, key=_order_key)


UNVERIFIED_PREFIX = "unverified-"
"""A ``step_*`` folder without a readable manifest that a save of the same step had to replace is renamed to
``unverified-step_*`` (never deleted): it is not a checkpoint (no listing or rotation sees it), and its files
are kept for whoever can restore its manifest."""
OTHER_RUN_PREFIX = "other-run-"
"""Likewise ``other-run-step_*``: another run's checkpoint in the place of a step this run saves again."""


def unverifiable(root: str) -> list[tuple[str, str]]:
    """``(name, why)`` of every ``step_*`` folder under ``root`` whose manifest cannot be read (missing,
    damaged, of another schema): folders that look like checkpoints but cannot be verified, oldest step first."""
    out = [(n, str(man).removeprefix(f"{n}: ")) for n, _, man in _step_folders(root) if isinstance(man, CheckpointError)]
    return sorted(out, key=lambda nw: (int(STEP_RE.match(nw[0]).group(1)), _suffix(nw[0])))


def set_aside_name(root: str, name: str, prefix: str = UNVERIFIED_PREFIX) -> str:
    """A free name ``{prefix}{name}`` (``-2``, ``-3``, ...) under ``root`` to move the folder ``name`` to."""
    base = f"{prefix}{name}"
    n, target = 1, base
    while os.path.lexists(os.path.join(root, target)):
        n += 1
        target = f"{base}-{n}"
    return target


def _suffix(name: str) -> int:
    m = STEP_RE.match(name)
    return int(m.group(2) or 1) if m else 0


def _sequence(i: CheckpointInfo) -> int:
    return int(i.manifest.get("sequence") or 0)


def _order_key(i: CheckpointInfo) -> tuple:
    """Step order; within a step, save order (``step_N-2``, written when ``step_N`` could not be moved aside, after it)."""
    return i.step, _sequence(i), _suffix(i.name)


def _save_key(i: CheckpointInfo) -> tuple:
    """Save order: the save sequence, then the step (checkpoints from before sequences were recorded)."""
    return _sequence(i), i.step, _suffix(i.name)


def newest(infos: list[CheckpointInfo], root: str, pointer: str = "latest") -> CheckpointInfo | None:
    """The checkpoint ``pointer`` names if it is listed, else the last one saved (highest sequence); for
    ``last_good`` without a usable pointer: the newest healthy one on the trajectory of ``latest``."""
    by_name = {i.name: i for i in infos}
    name = read_pointer(root, pointer)
    if name in by_name:
        return by_name[name]
    if pointer == "last_good":
        tip = newest(infos, root, "latest")
        return next((i for i in trajectory(infos, tip) if i.healthy), None) if tip else None
    return max(infos, key=_save_key) if infos else None


def trajectory(infos: list[CheckpointInfo], tip: CheckpointInfo) -> list[CheckpointInfo]:
    """``tip`` and the checkpoints its state descends from, newest first: its chain of ``parent`` links,
    then -- where the chain ends (a parent rotated away, or checkpoints older than parent links) -- those
    saved before the last link and of a lower step. Checkpoints of an abandoned trajectory (saved after a
    rollback's target, before the rollback) are not on it."""
    by_id = {(i.name, _sequence(i)): i for i in infos}
    chain, cur, seen = [tip], tip, {id(tip)}
    while True:
        parent = cur.manifest.get("parent")
        nxt = by_id.get((parent.get("name"), parent.get("sequence") or 0)) if isinstance(parent, dict) else None
        if nxt is None or id(nxt) in seen:
            break
        chain.append(nxt)
        seen.add(id(nxt))
        cur = nxt
    rest = [i for i in infos if id(i) not in seen and _save_key(i) < _save_key(cur) and _order_key(i) < _order_key(cur)]
    return chain + sorted(rest, key=_order_key, reverse=True)


def own_checkpoints(infos: list[CheckpointInfo], run_id: str | None) -> list[CheckpointInfo]:
    """The checkpoints of the run ``run_id`` among ``infos`` (those without a run id count as its own; all of
    them when ``run_id`` is None)."""
    return infos if run_id is None else [i for i in infos if i.manifest.get("run_id") in (None, run_id)]


def rotation_order(root: str, run_id: str | None = None) -> list[CheckpointInfo]:
    """Every listed checkpoint of the run ``run_id``, most worth keeping first: the trajectory of the newest
    checkpoint, then the others (abandoned trajectories) by save order. Rotation keeps the first ``keep`` and
    the pointers'; another run's checkpoints are not listed here, so never deleted and never counted."""
    infos = own_checkpoints(list_checkpoints(root), run_id)
    tip = newest(infos, root)
    on = trajectory(infos, tip) if tip else []
    ids = {id(i) for i in on}
    return on + sorted((i for i in infos if id(i) not in ids), key=_save_key, reverse=True)


def _no_such_checkpoint(root: str, output_dir: str, which: str, tried: str, infos: list[CheckpointInfo]) -> CheckpointError:
    names = [i.name for i in sorted(infos, key=_order_key)]
    close = difflib.get_close_matches(which, [*POINTERS, *names], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    here = ", ".join(names) if names else "none yet"
    sub = rel(root, output_dir)
    return CheckpointError(
        f"no such checkpoint {which!r}: no folder {tried}, nor {which!r} in the run folder or in {sub}; "
        f"checkpoints in {sub}: {here}; give 'latest', 'last_good', a folder name such as "
        f"{names[-1] if names else step_name(100)!r} or a path{hint}")


def other_run_error(path: str, output_dir: str, theirs: str, ours: str | None, how: str) -> CheckpointError:
    """The refusal of another run's checkpoint ``path`` (run ``theirs``; this run: ``ours``), reached ``how``."""
    return CheckpointError(
        f"{rel(path, output_dir)} ({how}) is a checkpoint of another run (run {theirs}); this run is {ours}. Refused: "
        "resuming it would continue another run's weights, data position and logs as this run's. Remove or move "
        "it if it was copied in by mistake; to start from another run's weights on purpose (e.g. fine-tuning), "
        "name it with --resume_from_checkpoint PATH --allow_other_run_checkpoint "
        "(CheckpointConfig(allow_other_run=True))")


def _refuse_link(root: str, output_dir: str, path: str, how: str) -> None:
    """Refuse a folder of the run's checkpoint folder that is a symbolic link: followed, it leads anywhere."""
    if os.path.dirname(os.path.normpath(path)) == os.path.normpath(root) and os.path.islink(path):
        raise CheckpointError(
            f"{rel(path, output_dir)} ({how}) is a symbolic link to {os.readlink(path)}: checkpoint folders are "
            f"followed only inside {rel(root, output_dir)}, never through a link. Refused; to start from another "
            "folder's checkpoint on purpose, name its real path with --resume_from_checkpoint PATH "
            "--allow_other_run_checkpoint (CheckpointConfig(allow_other_run=True))")


def candidates(root: str, output_dir: str, which: str, run_id: str | None = None,
               allow_other_run: bool = False) -> list[str]:
    """Folders to try, in order, for ``load(which)``: the newest checkpoint (``"latest"``: what the pointer
    names, else the last saved; ``"last_good"``: likewise, healthy ones only) or the named folder, then the
    checkpoints on its trajectory (see :func:`trajectory`), newest first. A name or path that does not
    exist raises :class:`CheckpointError` ("no such checkpoint", listing what exists).

    ``run_id``: this run's; another run's checkpoints are never candidates, and one that the pointer or
    ``which`` names is refused (naming both runs), as is a folder reached through a symbolic link in ``root``,
    unless ``allow_other_run``."""
    infos = list_checkpoints(root)
    mine = infos if allow_other_run else own_checkpoints(infos, run_id)
    by_name = {i.name: i for i in infos}
    if which in POINTERS:
        out = []
        named = read_pointer(root, which)
        if named and os.path.lexists(os.path.join(root, named)):
            how = f"what {which!r} names"
            if not allow_other_run:
                _refuse_link(root, output_dir, os.path.join(root, named), how)
                theirs = by_name[named].manifest.get("run_id") if named in by_name else None
                if theirs not in (None, run_id):
                    raise other_run_error(by_name[named].path, output_dir, theirs, run_id, how)
            if named not in by_name and os.path.isdir(os.path.join(root, named)):
                # The pointer names a folder whose manifest is damaged: try it first, so the load says why it
                # was skipped instead of passing over it in silence.
                out.append(os.path.join(root, named))
        first = newest(mine, root, which)
        if first is None:
            return out
        pool = trajectory(mine, first)
        if which == "last_good":
            pool = [first] + [i for i in pool[1:] if i.healthy]
        return out + [i.path for i in pool]
    path = which
    if not os.path.isabs(path) and not os.path.isdir(path):
        # "vidstab/checkpoints/step_000100" or "step_000100" relative to the run folder
        for base in (output_dir, root):
            if os.path.isdir(os.path.join(base, path)):
                path = os.path.join(base, path)
                break
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise _no_such_checkpoint(root, output_dir, which, path, infos)
    if not allow_other_run:
        _refuse_link(root, output_dir, path, f"named {which!r}")
    for i in infos:
        if os.path.normpath(i.path) == os.path.normpath(path):
            theirs = i.manifest.get("run_id")
            if not allow_other_run and theirs not in (None, run_id):
                raise other_run_error(i.path, output_dir, theirs, run_id, f"named {which!r}")
            return [i.path for i in trajectory(mine if any(j is i for j in mine) else infos, i)]
    try:
        theirs = read_manifest(path).get("run_id")
    except CheckpointError:
        theirs = "?"  # the load says what is wrong with it
    if not allow_other_run and theirs not in ("?", run_id):
        if theirs is None and os.path.dirname(os.path.normpath(path)) != os.path.normpath(root):
            theirs = "unknown: it records no run id and lies outside this run's checkpoint folder"
        if theirs is not None:
            raise other_run_error(path, output_dir, theirs, run_id, f"named {which!r}")
    return [path]


def remove_stale(root: str) -> None:
    """Remove ``.tmp-*`` entries of ``root``: saves, pointer updates and deletions a kill interrupted. One
    that cannot be removed (read-only, immutable) is left, with a warning saying what to clean up."""
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
            if os.path.lexists(p):
                logger.warning("cannot remove %s (read-only or immutable?); it is never loaded, remove it by hand "
                               "(e.g. `chattr -R -i` it, or remount read-write) to free its space", p)
