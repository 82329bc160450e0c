"""What a checkpoint run is configured with, what a listed checkpoint looks like, and the one error type."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointInfo"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no valid checkpoint could be loaded."""


@dataclass
class CheckpointConfig:
    """How checkpoints are written, kept and loaded."""

    keep: int = 3
    """Number of checkpoints kept: the newest steps of the current trajectory first (after a rollback, those of
    the abandoned one go first); the ones ``latest`` and ``last_good`` point to are kept in addition."""
    keep_for_incidents: int = 2
    """Also keep the checkpoints named by the incident bundles of the last this-many distinct checkpoints
    (``OUTPUT_DIR/vidstab/incidents``, newest step first), so a bundle still finds the weights it replays on;
    0: none."""
    async_save: bool = True
    """Copy state to host memory synchronously, write it in a background thread (the loop waits only for the copy)."""
    subdir: str = "vidstab/checkpoints"
    """Folder under the output dir that holds checkpoints and pointer files. Under ``vidstab/`` so that it
    coexists with Accelerate's automatic naming (``checkpoints/checkpoint_N``, ``total_limit``) and with
    diffusers' examples, which read every ``checkpoint*`` entry of the output dir as ``checkpoint-N``."""
    fsync: bool = True
    """fsync files and folders. Turning this off gives up durability on power loss; only for throw-away runs."""
    pin_memory: bool = True
    """Use pinned host buffers for the async copy when tensors live on CUDA."""
    check_params_finite: bool = True
    """Check registered models' parameters for NaN/Inf (one on-device reduction) before saving; a
    checkpoint with non-finite parameters is never a rollback target."""
    reuse_buffers: bool = True
    """Async saves: keep the host copy's buffers for the next save (faster copy; holds one host-memory copy
    of the state between saves). False: allocate per save and free after writing."""
    remove_stale: bool = True
    """Remove ``.tmp-*`` leftovers of killed saves when the manager starts (main process). Set False for a
    tool that opens the folder of a run that is still training, whose save may be in flight."""
    allow_world_size_change: bool = False
    """Load a checkpoint written by another number of processes (default: refuse with a message). Only for a
    loop that re-derives per-rank data positions, RNG and the LR schedule for the new world size itself;
    ranks the checkpoint has no RNG state for keep their own."""
    allow_other_run: bool = False
    """Load a checkpoint of another run (another run id in its manifest, e.g. a folder copied from another
    run, or one named by its path) or one reached through a symbolic link (default: refuse, naming both runs).
    For starting a new run from another run's weights on purpose (fine-tuning); its saves are this run's.
    recipes/train.py: ``--allow_other_run_checkpoint``."""
    cast_dtypes: bool = False
    """Load a floating-point tensor whose dtype differs from what its receiver (model parameter, optimizer
    state, EMA, ...) holds, casting it and logging each cast (e.g. a precision change between runs). Default:
    refuse the checkpoint, naming the tensor. Shapes, and integer or bool dtypes, are never cast."""
    rollback_memory_budget_bytes: int | None = None
    """Keep the newest healthy checkpoint's state in host memory as well (the buffers its save was written from,
    pinned where CUDA), up to this many bytes per process, so that a rollback to it restores from memory instead
    of reading and verifying its files; the files stay the source of truth for a relaunch. None: an eighth of the
    machine's memory shared by the node's processes; 0: off. Costs one more host copy of the state beside the
    async save's. Full-state (single process, DDP) and async sharded (FSDP2: each rank's shards as staged)
    checkpoints; synchronous sharded and DeepSpeed checkpoints roll back from their files, and a state over the
    budget too: the first such rollback says so in one line. The attached form: ``attach(...,
    rollback_memory_budget_bytes=N)``."""
    rank_timeout_s: float = 1800.0
    """How long the writer waits for a rank that is alive but has not finished writing (its collectives'
    timeout) before giving up on a checkpoint. A rank that dies is noticed within seconds regardless."""
    sharded: bool | None = None
    """Save models and optimizers as sharded DCP checkpoints (every rank writes its own shards; see
    ``vidstab/checkpoint/dcp_backend.py``). None: when a registered model has DTensor parameters (FSDP2).
    Loading follows what the checkpoint's manifest says, whatever this is set to."""
    on_replica_mismatch: str = "repair"
    """After a load, replicated state (guard, recovery, scheduler, trainer state) is hashed on every rank and
    compared: ``"repair"`` replaces a copy that differs from rank 0's by rank 0's, ``"refuse"`` raises
    :class:`CheckpointError` naming it (see ``vidstab/checkpoint/consistency.py``)."""
    checksum: str = "crc32"
    """Per-file checksum recorded in the manifest and verified on load: ``"crc32"`` or ``"sha256"``.
    CRC-32 detects truncation, all single-bit flips and burst errors up to 32 bits, which is what a
    checkpoint is defended against here -- torn writes and bit rot -- as zip, gzip and PNG do; at
    ~5 GB/s per core it costs far less than the write. ``"sha256"`` gives a cryptographic digest (about
    4x slower) for checkpoints that cross trust boundaries. The manifest names the algorithm per file,
    so either kind of checkpoint loads whatever this is set to."""


@dataclass
class CheckpointInfo:
    """A checkpoint folder as listed (manifest read, files not verified)."""

    path: str
    """Absolute path of the folder."""
    name: str
    """Folder name, e.g. ``step_000100``."""
    step: int
    """Optimizer step the checkpoint was taken at, as the script counted it (its folder's name)."""
    healthy: bool
    """``healthy`` as passed to ``save`` and parameters finite: usable as a rollback target."""
    time: float
    """Unix time the manifest was written."""
    manifest: dict = field(repr=False, default_factory=dict)
    """The parsed manifest."""

    @property
    def trajectory_step(self) -> int:
        """The trajectory's step of the checkpoint (the steps its weights took): ``step`` unless in-place rollbacks
        made the two differ (the manifest's ``trajectory_step``; see :mod:`vidstab.step_numbering`)."""
        return trajectory_step_of(dict(self.manifest, step=self.step))


def trajectory_step_of(manifest: dict) -> int:
    """The trajectory's step of the checkpoint whose (checked) manifest is ``manifest``: its ``trajectory_step``,
    or its ``step`` where it records none (a folder written before it was recorded, when the two were one)."""
    trajectory = manifest.get("trajectory_step")
    return int(manifest["step"] if trajectory is None else trajectory)
