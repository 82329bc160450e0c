"""Bounds on what a file may make vidstab allocate: run folders, checkpoints and incident bundles travel.

Every JSON file vidstab reads (``incident.json``, checkpoint state files, ``recovery.json``, an event log's
lines, a replay's LR evidence) goes through :func:`read_json_file` / :func:`loads_bounded`: its size is
checked before a byte is parsed and its nesting depth before Python's recursive parser and walkers see it,
so a hostile file gets one clear ``ValueError`` naming it, never a ``RecursionError`` or gigabytes of
Python objects. A replayed model's parameter count is checked before its weights are allocated
(``vidstab.tools.replay``).

Each bound is configurable: an environment variable (read at each check, so a launcher or a test can set
it) or, for replay, ``vidstab replay --max-params`` / ``replay(..., max_params=)``.

=================================  ===============  ==============================================
environment variable               default          bounds
=================================  ===============  ==============================================
``VIDSTAB_MAX_JSON_BYTES``         64 MiB           any one JSON file (an event log: any one line,
                                                    ``VIDSTAB_MAX_EVENT_LINE_BYTES``, 1 MiB)
``VIDSTAB_MAX_JSON_DEPTH``         64               nesting of lists and objects in a JSON value
``VIDSTAB_MAX_QUARANTINE_BYTES``   64 MiB           a run's ``vidstab/quarantine.jsonl`` (its lines:
                                                    ``VIDSTAB_MAX_EVENT_LINE_BYTES``)
``VIDSTAB_MAX_BATCH_BYTES``        4 GiB            an incident bundle's ``batch.safetensors``
``VIDSTAB_MAX_PARAMS``             1,000,000,000    parameters of a model rebuilt by replay
=================================  ===============  ==============================================
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Limits", "limits", "TooLarge", "loads_bounded", "read_json_file", "read_bounded", "check_depth",
           "bounded_lines", "not_a_regular_file"]


@dataclass(frozen=True)
class Limits:
    """The bounds in force (see the module doc); :func:`limits` reads them from the environment."""

    json_bytes: int = 64 << 20
    """Largest JSON file read (``VIDSTAB_MAX_JSON_BYTES``)."""
    event_line_bytes: int = 1 << 20
    """Largest line of a JSON-lines file read (``VIDSTAB_MAX_EVENT_LINE_BYTES``): an event log's longer line is
    skipped with a note, a quarantine list's is refused."""
    json_depth: int = 64
    """Deepest nesting of lists and objects in a JSON value (``VIDSTAB_MAX_JSON_DEPTH``); vidstab writes < 10."""
    quarantine_bytes: int = 64 << 20
    """Largest quarantine list read (``VIDSTAB_MAX_QUARANTINE_BYTES``): a larger one stops a resume, named."""
    batch_bytes: int = 4 << 30
    """Largest incident-bundle ``batch.safetensors`` loaded (``VIDSTAB_MAX_BATCH_BYTES``)."""
    params: int = 1_000_000_000
    """Most parameters of a model a replay rebuilds (``VIDSTAB_MAX_PARAMS``; ``vidstab replay --max-params``)."""


_ENV = {"json_bytes": "VIDSTAB_MAX_JSON_BYTES", "event_line_bytes": "VIDSTAB_MAX_EVENT_LINE_BYTES",
        "json_depth": "VIDSTAB_MAX_JSON_DEPTH", "quarantine_bytes": "VIDSTAB_MAX_QUARANTINE_BYTES",
        "batch_bytes": "VIDSTAB_MAX_BATCH_BYTES", "params": "VIDSTAB_MAX_PARAMS"}


class TooLarge(ValueError):
    """A file (or what it describes) exceeds one of the :class:`Limits`; the message names it and the setting."""


def limits() -> Limits:
    """The bounds in force: the defaults, overridden by the environment variables of the module doc."""
    values = {}
    for f in fields(Limits):
        raw = os.environ.get(_ENV[f.name])
        if raw is None or not raw.strip():
            continue
        try:
            values[f.name] = int(float(raw))
        except ValueError:
            raise ValueError(f"{_ENV[f.name]}={raw!r} is not a number") from None
        if values[f.name] <= 0:
            raise ValueError(f"{_ENV[f.name]}={raw!r} must be positive")
    return Limits(**values)


def env_name(field: str) -> str:
    """The environment variable that sets the :class:`Limits` field ``field``."""
    return _ENV[field]


def check_depth(data: bytes | str, what: str, max_depth: int | None = None) -> None:
    """Raise :class:`TooLarge` when the JSON text ``data`` nests lists/objects deeper than ``max_depth``.

    Runs in C-speed passes (counting, then a cumulative sum over the brackets outside strings), so it can
    precede the recursive parser; text with fewer brackets than the bound is passed at once."""
    max_depth = limits().json_depth if max_depth is None else max_depth
    raw = data.encode("utf-8", "replace") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return
    import re

    import numpy as np

    # Brackets inside strings do not nest: drop every string literal first.
    bare = re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', raw, flags=re.DOTALL)
    codes = np.frombuffer(bare, dtype=np.uint8)
    steps = np.zeros(len(codes), dtype=np.int64)
    steps[(codes == ord("[")) | (codes == ord("{"))] = 1
    steps[(codes == ord("]")) | (codes == ord("}"))] = -1
    depth = int(np.cumsum(steps).max(initial=0))
    if depth > max_depth:
        raise TooLarge(f"{what}: JSON nested {depth} levels deep, more than the {max_depth} allowed "
                       f"({env_name('json_depth')}); refused unread")


def loads_bounded(data: bytes | str, what: str, max_bytes: int | None = None, max_depth: int | None = None) -> Any:
    """``json.loads(data)`` after checking its size and nesting (see :class:`Limits`; a reader of many lines
    passes both bounds, read once); ``what`` names the source in messages. Raises ``ValueError``
    (:class:`TooLarge`, or ``json.JSONDecodeError``/``UnicodeDecodeError`` for bytes that are not JSON)."""
    if max_bytes is None or max_depth is None:
        lim = limits()
        max_bytes = lim.json_bytes if max_bytes is None else max_bytes
        max_depth = lim.json_depth if max_depth is None else max_depth
    if len(data) > max_bytes:
        raise TooLarge(f"{what}: {len(data)} bytes of JSON, more than the {max_bytes} allowed "
                       f"({env_name('json_bytes')}); refused unread")
    check_depth(data, what, max_depth)
    try:
        return json.loads(data)
    except RecursionError:  # a depth bound raised above Python's own recursion limit
        raise TooLarge(f"{what}: JSON nested too deeply to read") from None


def not_a_regular_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is not a regular file to read ("missing", "a FIFO (named pipe)", "a character
    device", ..., with the target of a link), else None; from ``stat`` alone: nothing is opened, so a FIFO or a
    device cannot block or flood the reader."""
    path = Path(path)
    link = f" (a link to {os.readlink(path)})" if path.is_symlink() else ""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"missing{link}"
    except OSError as e:
        return f"unreadable ({e.strerror or e}){link}"
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    return next((what for test, what in kinds if test(mode)), "not a regular file") + link


def bounded_lines(fh: Any, max_bytes: int) -> Iterator[tuple[bytes | None, bool]]:
    """``(line, is_last)`` of the binary file ``fh``; a line longer than ``max_bytes`` is read past in
    chunks (never held whole) and given as ``None``."""
    def one() -> bytes | None | bool:
        line = fh.readline(max_bytes + 1)
        if not line:
            return False
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while (chunk := fh.readline(1 << 20)) and not chunk.endswith(b"\n"):
                pass
            return None
        return line

    current = one()
    while current is not False:
        following = one()
        yield current, following is False
        current = following


def read_bounded(path: str | os.PathLike, max_bytes: int, what: str | None = None, setting: str = "json_bytes") -> bytes:
    """The bytes of the regular file ``path`` (no FIFO or device: it is not opened if ``lstat`` says so),
    refused with :class:`TooLarge` before reading when larger than ``max_bytes``; never reads past it.
    OSError (FileNotFoundError, ...) passes through."""
    path = Path(path)
    what = what or str(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: not a regular file ({not_a_regular_file(path)})")
    if st.st_size > max_bytes:
        raise TooLarge(f"{what}: {st.st_size} bytes, more than the {max_bytes} allowed ({env_name(setting)}); "
                       "refused unread")
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(f"{what}: grew past the {max_bytes} bytes allowed ({env_name(setting)}) while being read")
    return data


def read_json_file(path: str | os.PathLike, what: str | None = None) -> Any:
    """Parse the JSON file ``path`` within the bounds of :class:`Limits` (see :func:`loads_bounded`)."""
    what = what or str(path)
    return loads_bounded(read_bounded(path, limits().json_bytes, what), what)
