"""The last healthy checkpoint's state kept in host memory, so an in-place rollback need not read its files back.

A save's snapshot already copies the state to host memory (pinned where CUDA) for the writer; when the copy fits
``CheckpointConfig.rollback_memory_budget_bytes``, :class:`MemoryCopy` keeps those same buffers once the save is
published healthy (one producer: the files are written from them). A load whose first candidate is that folder then
decodes the kept buffers instead of reading and verifying the files; everything after the decode (the replicated
state compared across ranks, the apply) is the files' path. The files stay the source of truth: a new process (a
relaunch) has no copy and reads them.

Every rank keeps its own copy (at world size > 1 the snapshot gives non-publishing ranks the replicated files too,
not written by them), so a rollback needs no transfer; the ranks agree (one all-reduce) on whether every one of them
holds the target before any uses it. Full-state checkpoints (single process, DDP) and async sharded ones (FSDP2:
the shards ``dcp.async_save`` staged on each rank, copied back into the same local shards; in-process, the sharding
is the same); synchronous sharded saves stage nothing and DeepSpeed checkpoints are its engine's: those roll back
from their files, said once.

The kept copy costs one more host copy of the state beside the async save's reused buffers: the two sets of buffers
take turns (the snapshot after a kept save writes into the buffers the copy before it let go).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .writer import FileSpec

__all__ = ["MemoryCopy", "HeldTensors", "held_tensors", "held_metadata", "default_budget_bytes"]

logger = logging.getLogger("vidstab.checkpoint")


class HeldTensors(dict):
    """A kept safetensors file: its tensors by key, and its header ``metadata`` (what decoding reads from bytes)."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
        super().__init__(tensors)
        self.metadata = dict(metadata or {})


def held_tensors(raw: Any, clone: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of one file of a load: decoded from verified bytes, or the kept copy's (cloned unless the
    receiver copies them itself: an optimizer's ``load_state_dict`` keeps the tensors it is given)."""
    if isinstance(raw, HeldTensors):
        return {k: t.clone() for k, t in raw.items()} if clone else dict(raw)
    from safetensors.torch import load as st_load

    return st_load(raw)


def held_metadata(raw: Any) -> dict[str, str]:
    """The safetensors header metadata of one file of a load (verified bytes, or the kept copy)."""
    if isinstance(raw, HeldTensors):
        return dict(raw.metadata)
    from .frozen import read_header_metadata

    return read_header_metadata(raw)


def default_budget_bytes() -> int:
    """An eighth of this machine's memory, shared by the node's processes."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(0, total // 8 // max(1, local))


def _nbytes(files: list[FileSpec]) -> int:
    from ..signals import local_tensor

    n = 0
    for f in files:
        n += len(f.data or b"") + sum(local_tensor(t).numel() * t.element_size() for t in (f.tensors or {}).values())
    return n


def _leaves(tree: dict, prefix: str = ""):
    """``(key, tensor)`` of a nested state dict."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


class MemoryCopy:
    """The kept copy of one checkpoint folder's files on this rank (see the module doc).

    The manager calls :meth:`offer` with a save's staged files, :meth:`settled` once every rank agreed on the
    save, :meth:`reuse` before each snapshot and :meth:`payload` at a load."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = int(budget_bytes)
        self.name: str | None = None
        """The folder name of the checkpoint held (None: nothing held)."""
        self.bytes = 0
        self._files: dict[str, Any] = {}
        self.staged: dict | None = None
        """A sharded save's staged state (``{object: {key: tensor or DTensor of this rank's shards}}``), held."""
        self._pending: tuple[str, list[FileSpec], dict | None, int] | None = None
        self._spare: dict = {}  # the buffers of the copy let go: the next snapshot's
        self._spare_staged: dict | None = None
        self.declined: str | None = None
        """Why the newest healthy save is not held (the first rollback says it once)."""
        self.over_budget = False
        """A save's state did not fit the budget: later saves (the same state) are not staged for a copy at all."""
        self._said = False

    def reuse(self, buffers: dict) -> dict:
        """The host buffers the next snapshot may write into: never the held copy's."""
        held = {id(t) for spec in self._files.values() if isinstance(spec, HeldTensors) for t in spec.values()}
        if any(id(t) in held for t in buffers.values()):
            return self._spare
        return buffers

    def reuse_staged(self, cache: dict | None) -> dict | None:
        """The staging buffers the next sharded save may write into (None: new ones): never the held copy's."""
        return self._spare_staged if cache is not None and cache is self.staged else cache

    def offer(self, name: str, files: list[FileSpec], staged: dict | None = None) -> None:
        """A save's files (and a sharded save's ``staged`` state) in host buffers the loop does not change; held
        once :meth:`settled`."""
        self._pending = None
        size = _nbytes(files) + _nbytes([FileSpec("", tensors=dict(_leaves(staged)))] if staged else [])
        if size > self.budget:
            self.over_budget = True
            self.decline(f"the state is {size / 2**20:.0f} MiB on this process, more than "
                         f"rollback_memory_budget_bytes={self.budget} ({self.budget / 2**20:.0f} MiB)")
            return
        self._pending = (name, list(files), staged, size)

    def decline(self, why: str) -> None:
        """The newest save is not kept (``why``): a rollback to it reads its files."""
        self._pending, self.declined = None, why

    def settled(self, name: str, healthy: bool, written: bool) -> None:
        """This rank wrote the offered save ``name`` (``written``) and it is healthy: hold it, letting the
        previous copy go (its buffers are the next snapshot's). :meth:`drop` takes it back if another rank failed."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != name or not (healthy and written):
            return
        name, files, staged, size = pending
        old = self._files
        self._spare_staged, self.staged = self.staged, staged
        self._files = {f.name: (HeldTensors(f.tensors, f.metadata) if f.tensors is not None else f.data)
                       for f in files}
        self._spare = {(fn, k): t for fn, spec in old.items() if isinstance(spec, HeldTensors)
                       for k, t in spec.items()}
        self.name, self.bytes, self.declined = name, size, None

    def drop(self, name: str) -> None:
        """The folder ``name`` is no longer what the copy holds (its save failed on some rank, or a save of the same
        step replaces it): not a rollback target from memory."""
        if self.name == name:
            self.name, self._files, self.staged, self.bytes = None, {}, None, 0
            self.declined = f"{name} changed on disk after it was kept"

    def payload(self, path: str) -> dict[str, Any] | None:
        """The kept files of the checkpoint folder ``path`` (``{file: bytes | HeldTensors}``), or None."""
        if self.name is None or os.path.basename(os.path.normpath(path)) != self.name:
            return None
        return dict(self._files)

    def say_once(self, which: str) -> None:
        """At the first load that uses the files although a copy was asked for: one line saying why."""
        if self._said:
            return
        if self.name is None and self.declined is None:
            return  # no save yet in this process (a resume): the files are the only source
        why = self.declined or f"the target is not {self.name}, the checkpoint held in memory"
        self._said = True
        logger.warning("rollback to %r restores from the checkpoint's files, not from host memory: %s", which, why)
