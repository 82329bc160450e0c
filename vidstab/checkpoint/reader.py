"""Reading one checkpoint folder: every file verified against the manifest before anything is decoded.

The main process checks every file's size and checksum; other ranks check every size and the checksums of
what they read themselves (the shared files and their own RNG), so a damaged checkpoint is refused on the
rank that would use it. Decoding is the backend's job; nothing here unpickles anything.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ..files.limits import env_name, limits
from .config import CheckpointError
from .layout import check_carried_steps, read_manifest, verify_file

__all__ = ["read_checkpoint"]

logger = logging.getLogger("vidstab.checkpoint")


def read_checkpoint(path: str, rank: int, is_main: bool, needed: dict[str, str],
                    decode: Callable[[str, dict[str, bytes]], dict] | None,
                    config_hash: str | None = None, keep_file: Callable[[str], bool] | None = None) -> dict:
    """Verify the checkpoint at ``path`` and (``decode`` given) decode what this rank needs.

    ``needed``: ``{file: object name}`` the checkpoint must list. ``keep_file(name)``: whether this rank
    reads a listed file's bytes (default: everything but other ranks' RNG files; a backend that reads its
    own files, e.g. DCP shards, says False for them and they are only verified). Returns ``{"manifest"}``
    plus what ``decode(ckpt_name, raw_bytes)`` returns. Raises :class:`CheckpointError`.
    """
    name = os.path.basename(os.path.normpath(path))
    man = read_manifest(path)
    check_carried_steps(path, man)  # the folder name and manifest agree on the step (read_manifest); its files too
    files = man["files"]
    for f, n in needed.items():
        if f not in files:
            raise CheckpointError(f"{name}: has no state for {n!r} ({f})")
    json_cap = limits().json_bytes
    for f, meta in files.items():
        # Parsed JSON takes tens of times its size in memory: a state file larger than any real one is
        # refused before it is read, whatever its manifest entry says.
        if f.endswith(".json") and meta["bytes"] > json_cap:
            raise CheckpointError(f"{name}: {f} is {meta['bytes']} bytes, more than the {json_cap} allowed for a "
                                  f"JSON state file ({env_name('json_bytes')}); refused unread")
    own_rng = {f"rng-rank{rank}.json", f"rng-rank{rank}.safetensors"}
    raw: dict[str, bytes] = {}
    for f, meta in files.items():
        # Verify everything on the main process; other ranks check the sizes of all files and the
        # checksums of what they read.
        mine = f in own_rng or not f.startswith("rng-rank")
        keep = decode is not None and mine and (keep_file is None or keep_file(f))
        data = verify_file(name, path, f, meta, keep=keep, checksum=is_main or mine)
        if keep:
            raw[f] = data
    if decode is None:
        return {"manifest": man}
    try:
        out = decode(name, raw)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any decode problem makes the checkpoint invalid
        raise CheckpointError(f"{name}: cannot decode ({type(e).__name__}: {e})") from e
    if config_hash and man.get("config_hash") and man["config_hash"] != config_hash:
        logger.warning("%s was written with config %s, this run has config %s", name, man["config_hash"],
                       config_hash)
    return {"manifest": man, **out}
