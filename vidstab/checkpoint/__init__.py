"""Atomic, validated, rotated checkpoints for Accelerate training runs (no pickle anywhere).

Why not ``accelerator.save_state``: it writes in place (a kill mid-save leaves a folder that
``load_state`` picks and then fails on), its ``total_limit`` deletes the oldest checkpoint *before* the
new one is complete, nothing checks completeness on load, and custom objects are unpickled with
``weights_only=False``.

The package, one concern per file (see ``docs/ARCHITECTURE.md``):

- :mod:`.config` -- :class:`CheckpointConfig`, :class:`CheckpointInfo`, :class:`CheckpointError`.
- :mod:`.layout` -- folder and file names, ``manifest.json``, the ``latest``/``last_good`` pointer files,
  listing, and verification of every file against the manifest (:func:`verify_checkpoint_files`).
- :mod:`.writer` -- writing one checkpoint folder: files checksummed while written, manifest last, fsync,
  atomic rename (:func:`vidstab.files.atomic.publish_folder`), pointers, rotation after the new one is complete.
- :mod:`.reader` -- verifying a folder and handing the bytes to a backend to decode.
- :mod:`.full_state` -- the full-state backend: one safetensors (+ JSON) file per registered object,
  RNG per rank (single process and DDP).
- :mod:`.dcp_backend` -- the sharded backend: FSDP2 models and their optimizers through
  ``torch.distributed.checkpoint`` (every rank writes its own safetensors shards; reshards on load).
- :mod:`.memory_copy` -- the newest healthy checkpoint's host copy (the buffers its save was written from),
  from which an in-place rollback restores instead of reading the files back.
- :mod:`.consistency` -- replicated state (guard, scheduler, trainer state) identical on every rank after
  a load: hashed, compared, repaired from rank 0 or refused.
- :mod:`.manager` -- :class:`CheckpointManager`, which owns every collective, so all ranks agree on a
  snapshot, on a save's success before ``latest`` moves, and on which checkpoint they load.

Any folder without a valid manifest is never loaded, every file is checked against the manifest's size
and checksum before anything is applied, and stale ``.tmp-*`` entries from a killed save are removed when
the manager starts.

Async saves (``async_save=True``, the default, any world size): ``save`` copies the state to host memory
(pinned where CUDA) -- the only part the training loop waits for -- and the writing runs in a background
thread on each rank.
"""

from .config import CheckpointConfig, CheckpointError, CheckpointInfo
from .layout import MANIFEST, SCHEMA, verify_checkpoint_files
from .manager import CheckpointManager

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointInfo", "CheckpointManager", "verify_checkpoint_files",
           "MANIFEST", "SCHEMA"]
