"""Pickle-free codec for state dicts: tensors -> safetensors, structure -> JSON.

Optimizer, scheduler, EMA and RNG states are nested Python structures (dicts with ``int`` keys,
tuples such as Adam's ``betas``, ``None``, NaN-able floats) holding tensors. ``torch.save`` keeps all
that by pickling, and loading a pickle runs code from the file. This module splits such a structure
into a flat ``{key: tensor}`` mapping (written with safetensors) and a JSON document that keeps the
exact Python shape: ints stay ints, tuples stay tuples, non-string dict keys survive, and
non-finite floats are spelled out so the JSON stays standard.

It also holds a small streaming safetensors writer: it checksums each tensor's bytes while writing
them (CRC-32 by default, sha256 on request), so a checkpoint never has to be re-read to get its
checksum and no second full copy of the state is built in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .limits import loads_bounded

__all__ = [
    "flatten",
    "unflatten",
    "dumps",
    "loads",
    "CHECKSUMS",
    "FileDigest",
    "new_checksum",
    "checksum_bytes",
    "write_safetensors",
    "write_bytes",
    "sha256_bytes",
]

# Markers used in the JSON structure. A plain dict whose keys are all strings and none of which
# starts with "__" is written as a JSON object; everything else uses one of these tagged forms.
_T = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_FLOAT = "__float__"
_DTYPE = "__dtype__"
_NDARRAY = "__ndarray__"


def _is_plain_key(k: Any) -> bool:
    return isinstance(k, str) and not k.startswith("__")


def flatten(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``obj`` into ``(tensors, structure)``.

    ``tensors`` maps generated keys (``prefix`` + running index) to tensors; ``structure`` is a
    JSON-serialisable value in which each tensor is replaced by ``{"__tensor__": key}``.
    Supported leaves: tensors, numpy arrays/scalars, ``None``, bool, int, float (incl. NaN/inf),
    str, ``torch.dtype``. Containers: dict (any hashable JSON-able keys), list, tuple.
    Anything else raises ``TypeError`` naming the path, rather than being pickled silently.
    """
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = x
            return {_T: key}
        if isinstance(x, np.ndarray):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = torch.from_numpy(np.ascontiguousarray(x))
            return {_NDARRAY: key}
        if isinstance(x, np.generic):
            x = x.item()
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {_FLOAT: repr(x)}
        if isinstance(x, torch.dtype):
            return {_DTYPE: str(x).removeprefix("torch.")}
        if isinstance(x, tuple):
            return {_TUPLE: [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            if all(_is_plain_key(k) for k in x):
                return {k: enc(v, f"{path}.{k}") for k, v in x.items()}
            return {_DICT: [[enc(k, f"{path}<key>"), enc(v, f"{path}[{k!r}]")] for k, v in x.items()]}
        raise TypeError(
            f"cannot store {type(x).__name__} at {path or '<root>'} without pickling; "
            "state_dict() values must be tensors, numbers, strings, None, lists, tuples or dicts"
        )

    return tensors, enc(obj, "")


def unflatten(structure: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if len(x) == 1:
                (tag, v), = x.items()
                if tag == _T:
                    return tensors[v]
                if tag == _NDARRAY:
                    return tensors[v].numpy()
                if tag == _TUPLE:
                    return tuple(dec(i) for i in v)
                if tag == _DICT:
                    return {_hashable(dec(k)): dec(val) for k, val in v}
                if tag == _FLOAT:
                    return float(v)
                if tag == _DTYPE:
                    return getattr(torch, v)
            return {k: dec(v) for k, v in x.items()}
        return x

    return dec(structure)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(i) for i in k) if isinstance(k, list) else k


def dumps(structure: Any) -> bytes:
    """Standard JSON (no NaN literals: :func:`flatten` already spelled them out)."""
    return json.dumps(structure, allow_nan=False, indent=1, sort_keys=False).encode()


def loads(data: bytes, what: str = "JSON state") -> Any:
    """Parse JSON written by :func:`dumps`, within :class:`vidstab.files.limits.Limits` (size, nesting)."""
    return loads_bounded(data, what)


# --------------------------------------------------------------------------- file writing

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


CHECKSUMS = ("crc32", "sha256")
"""Checksum algorithms the writer produces and :func:`checksum_bytes` / the checkpoint loader verify."""


class _Crc32:
    """``hashlib``-like incremental CRC-32 (``zlib.crc32``; releases the GIL on large buffers)."""

    name = "crc32"

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return f"0x{self._crc:08x}"


def new_checksum(algo: str):
    """An incremental checksum object (``update(bytes_like)``, ``hexdigest()``) for ``algo`` in :data:`CHECKSUMS`.
    CRC-32 digests are spelled ``"0x"`` + 8 lowercase hex digits, sha256 as 64 hex digits."""
    if algo == "crc32":
        return _Crc32()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algo!r}; expected one of {CHECKSUMS}")


def checksum_bytes(data, algo: str) -> str:
    """Checksum of ``data`` as :func:`new_checksum` spells it."""
    h = new_checksum(algo)
    h.update(data)
    return h.hexdigest()


@dataclass
class FileDigest:
    """Size and checksum of a file as written."""

    bytes: int
    """Size in bytes."""
    checksum: str
    """Algorithm, one of :data:`CHECKSUMS`."""
    digest: str
    """The file's checksum as :func:`new_checksum` spells it."""

    def to_json(self) -> dict:
        """Manifest entry: ``{"bytes": N, "crc32": "0x1234abcd"}`` or ``{"bytes": N, "sha256": "..."}``."""
        return {"bytes": self.bytes, self.checksum: self.digest}


def _write_all(fd: int, mv: memoryview) -> None:
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


def _open_new(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


_WRITEBACK_EVERY = 16 << 20


def _start_writeback(fd: int, start: int, end: int) -> None:
    """Queue ``[start, end)`` of a file being written for writeback without waiting for it (Linux:
    ``POSIX_FADV_DONTNEED`` starts writeback of the dirty pages, then drops only pages already clean --
    the same fallback PostgreSQL uses where ``sync_file_range`` is unavailable)."""
    try:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      fsync: bool = True, checksum: str = "crc32", writeback: bool = False) -> FileDigest:
    """Write ``tensors`` as a safetensors file, checksumming (``checksum``, see :data:`CHECKSUMS`) the
    bytes as they are written.

    Tensors may share storage (tied weights) or be non-contiguous: each is written as its own copy
    of data, which is what ``load_state_dict`` expects. With ``fsync`` the file is fsync'd before
    returning. ``writeback``: start writing the data to disk every 16 MiB while the rest is still being
    written, so that a later fsync (here or by the caller) has little left to wait for.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    views: list[torch.Tensor] = []
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} is not supported by safetensors")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        views.append(t)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the format wants the data section 8-byte aligned
    head = len(hb).to_bytes(8, "little") + hb
    # Byte views without a copy (works for bf16/fp8, which numpy lacks).
    chunks = [memoryview(head)] + [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in views if t.numel()]
    h = new_checksum(checksum)
    # Hash in a second thread while this one writes and fsyncs: both release the GIL on large buffers,
    # so the digest costs max(hash, write) instead of hash + write and the file is never re-read.
    hasher = threading.Thread(target=lambda: [h.update(c) for c in chunks], name=f"vidstab-{checksum}")
    hasher.start()
    try:
        fd = _open_new(path)
        try:
            done = flushed = 0
            for c in chunks:
                _write_all(fd, c)
                done += len(c)
                if writeback and done - flushed >= _WRITEBACK_EVERY:
                    _start_writeback(fd, flushed, done)
                    flushed = done
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        hasher.join()
    return FileDigest(len(head) + offset, checksum, h.hexdigest())


def write_bytes(path: str, data: bytes, fsync: bool = True, checksum: str = "crc32") -> FileDigest:
    """Write ``data`` to a new file, fsync it, return its size and checksum."""
    h = new_checksum(checksum)  # before creating the file: an unknown algorithm leaves nothing behind
    fd = _open_new(path)
    try:
        _write_all(fd, memoryview(data))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    h.update(data)
    return FileDigest(len(data), checksum, h.hexdigest())


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()

