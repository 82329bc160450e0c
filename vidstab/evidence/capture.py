"""Incident bundles: the evidence of a bad step, written atomically and read back with validation.

A bundle is a folder ``RUN_DIR/vidstab/incidents/step{STEP:06d}-rank{R}[-m{MICRO}]/`` with

* ``batch.safetensors``: every tensor of the micro-batch the guard saw (keys kept, bitwise), and
* ``incident.json``: who/when/why (step, rank, sample ids, the detector's finding, LR, precision, seed),
  per-sample input statistics, the checkpoint to start from, and how to rebuild the model and
  recompute the loss, so ``vidstab replay`` can re-run the step on a laptop.

Nothing is pickled: tensors go to safetensors, metadata to strict JSON. JSON has no NaN/Inf, so
non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (``json.dumps`` runs
with ``allow_nan=False``, so the file is standard JSON any tool can read); :func:`json_float` turns
them back into floats.

Schema (version 1) of ``incident.json`` -- the contract in ``docs/ARCHITECTURE.md`` plus detail::

    schema, step, micro_step, rank, world_size     ints
    sample_ids         list[str], one per sample along dim 0 of the batch
    bad_sample_ids     samples whose inputs hold non-finite values or whose absmax is an outlier
    bad_reasons        {sample_id: [one sentence per reason]}
    sample_stats       [{"sample_id", "index", "tensors": {key: stats}}] per sample
    input_stats        {key: stats} over the whole micro-batch
    lr, precision, seed
    detector, verdict, message, figures, finding_ranks   the finding that triggered the capture
    checkpoint         checkpoint folder relative to the run folder (absolute if outside it), or null
    checkpoint_weights that checkpoint's manifest entry for model.safetensors (bytes + checksum), for a
                       sharded one {"sharded": {shard: entry}} (:func:`weights_entry`), or null
    model              {"class": "module:Class", "config": {...}} | {"factory": "module:fn", "kwargs": {...}} | null
    loss               {"fn": "module:fn", "kwargs": {...}} | null   (loss = fn(model, batch, **kwargs))
    objective          the loss kwargs again, under the contract's name
    localization       locate_nonfinite()'s result, or null
    tensors            keys stored in batch.safetensors;  skipped_keys: non-tensor batch entries
    versions           {"torch", "accelerate", "vidstab", "python"};  time (unix);  extra {...}

``stats`` is :func:`vidstab.evidence.localize.tensor_stats`: shape, dtype, min/max/absmax/mean/std over the
finite values, and ``nonfinite``/``nan``/``inf`` counts.
"""

from __future__ import annotations

import enum
import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..files.atomic import atomic_folder, write_atomic
from ..files.limits import TooLarge, env_name, limits, not_a_regular_file, read_json_file
from .localize import tensor_stats
from .replay_record import OUTPUT_GRAD_KEY
from ..files.strict_json import dumps_strict, json_float, to_json_safe  # json_float, to_json_safe: re-exported for bundle readers

__all__ = [
    "SCHEMA_VERSION",
    "INCIDENTS_DIR",
    "Incident",
    "IncidentError",
    "write_incident",
    "read_incident",
    "list_incidents",
    "incident_dir_name",
    "sample_report",
    "to_json_safe",
    "json_float",
]

SCHEMA_VERSION = 1
"""Version of ``incident.json``; readers accept this version and older ones."""
INCIDENTS_DIR = Path("vidstab") / "incidents"
"""Where bundles live, relative to the run folder."""
META_FILE = "incident.json"
BATCH_FILE = "batch.safetensors"
MAX_SAMPLE_ID = 1000  # characters: a quarantine line holding one stays one atomic append
REQUIRED_FIELDS = ("schema", "step", "micro_step", "rank", "world_size", "sample_ids", "tensors")
"""Fields a reader cannot do without; everything else is optional evidence."""
OUTLIER_FACTOR = 10.0
"""A sample is an absmax outlier when its absmax exceeds this many times the median of the others'."""
OUTLIER_FLOOR = 1.0
"""... and exceeds this absolute value (tiny tensors vary by large factors without meaning anything)."""

_NAME_RE = re.compile(r"^step(\d+)-rank(\d+)(?:-m(\d+))?(?:-(\d+))?$")


class IncidentError(ValueError):
    """A bundle is missing, incomplete or corrupt; the message names the file or field."""


@dataclass
class Incident:
    """One bundle read back from disk."""

    path: Path
    """The bundle folder."""
    meta: dict[str, Any]
    """``incident.json`` as written (non-finite floats are the strings ``"nan"``/``"inf"``/``"-inf"``)."""
    tensors: dict[str, torch.Tensor]
    """The micro-batch from ``batch.safetensors`` (CPU tensors, original dtypes)."""

    @property
    def run_dir(self) -> Path:
        """The run folder the bundle belongs to: ``RUN_DIR/vidstab/incidents/<bundle>``."""
        return self.path.parent.parent.parent

    @property
    def step(self) -> int:
        """Optimizer step of the incident."""
        return int(self.meta["step"])

    @property
    def rank(self) -> int:
        """Rank that wrote the bundle."""
        return int(self.meta["rank"])

    @property
    def sample_ids(self) -> list[str]:
        """Sample ids of the micro-batch, in batch order."""
        return [str(s) for s in self.meta["sample_ids"]]


# ----------------------------------------------------------------------------------------------------
# JSON helpers (the convention is vidstab/files/strict_json.py's)


def _dumps(meta: dict) -> str:
    return dumps_strict(meta, indent=1, sort_keys=False) + "\n"


# ----------------------------------------------------------------------------------------------------
# Per-sample evidence


def _batch_size(batch: Mapping[str, torch.Tensor], sample_ids: Sequence[str]) -> int | None:
    """The micro-batch size: ``len(sample_ids)`` when some tensor has that leading dim, else the first tensor's."""
    leading = [t.shape[0] for t in batch.values() if isinstance(t, torch.Tensor) and t.ndim >= 1]
    if not leading:
        return None
    if sample_ids and len(sample_ids) in leading:
        return len(sample_ids)
    return leading[0]


def sample_report(
    batch: Mapping[str, torch.Tensor],
    sample_ids: Sequence[str] = (),
    *,
    absmax_limit: float | None = None,
) -> dict[str, Any]:
    """Per-sample statistics of a micro-batch and the samples that look bad.

    A tensor is per-sample when its leading dim equals the batch size. A sample is bad when any of its
    per-sample values is non-finite, or when -- for tensors with a per-sample shape (ndim >= 2, e.g.
    latents, not per-sample scalars such as timesteps, which legitimately differ by orders of
    magnitude) -- its finite absmax exceeds ``OUTLIER_FACTOR`` x the median of the other samples' (and
    ``OUTLIER_FLOOR``), or exceeds ``absmax_limit`` when one is given.

    Returns ``{"batch_size", "sample_ids", "sample_stats", "input_stats", "bad_sample_ids", "bad_reasons"}``;
    ``sample_ids`` falls back to ``"#i"`` for samples without an id.
    """
    bsz = _batch_size(batch, sample_ids)
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    input_stats = {k: tensor_stats(v) for k, v in tensors.items()}
    if bsz is None:
        return {"batch_size": None, "sample_ids": list(sample_ids), "sample_stats": [], "input_stats": input_stats,
                "bad_sample_ids": [], "bad_reasons": {}}
    ids = [str(sample_ids[i]) if i < len(sample_ids) else f"#{i}" for i in range(bsz)]
    per_sample = {k: v for k, v in tensors.items() if v.ndim >= 1 and v.shape[0] == bsz}
    stats = [{"sample_id": ids[i], "index": i, "tensors": {k: tensor_stats(v[i]) for k, v in per_sample.items()}}
             for i in range(bsz)]
    reasons: dict[str, list[str]] = {}
    for i, s in enumerate(stats):
        for k, st in s["tensors"].items():
            if st["nonfinite"]:
                reasons.setdefault(ids[i], []).append(
                    f"{k}: {st['nonfinite']} non-finite values ({st['nan']} NaN, {st['inf']} Inf) of {st['numel']}"
                )
    for k, v in per_sample.items():
        if v.ndim < 2 or not v.is_floating_point():
            continue
        absmax = [s["tensors"][k]["absmax"] for s in stats]
        for i, a in enumerate(absmax):
            if not isinstance(a, float):
                continue
            if absmax_limit is not None and a > absmax_limit:
                reasons.setdefault(ids[i], []).append(f"{k}: absmax {a:.4g} > limit {absmax_limit:g}")
                continue
            others = [b for j, b in enumerate(absmax) if j != i and isinstance(b, float)]
            if others:
                med = statistics.median(others)
                if a > OUTLIER_FLOOR and a > OUTLIER_FACTOR * med:
                    reasons.setdefault(ids[i], []).append(
                        f"{k}: absmax {a:.4g} is {a / max(med, 1e-30):.3g}x the median of the other samples ({med:.4g})"
                    )
    bad = [sid for sid in ids if sid in reasons]
    return {"batch_size": bsz, "sample_ids": ids, "sample_stats": stats, "input_stats": input_stats,
            "bad_sample_ids": bad, "bad_reasons": reasons}


# ----------------------------------------------------------------------------------------------------
# Writing


def incident_dir_name(step: int, rank: int, micro_step: int = 0) -> str:
    """``step{STEP:06d}-rank{R}``, with ``-m{MICRO}`` for a micro-step other than 0."""
    name = f"step{int(step):06d}-rank{int(rank)}"
    return f"{name}-m{int(micro_step)}" if micro_step else name


def _finding_dict(finding: Any) -> dict[str, Any]:
    """Detector, verdict, message, figures (+ ranks) from a ``Finding``, a dict or ``None``."""
    if finding is None:
        return {"detector": None, "verdict": None, "message": None, "figures": {}}
    if isinstance(finding, Mapping):
        get = finding.get
    else:  # a detectors.base.Finding (or any object with those attributes); read raw to keep NaN figures
        def get(k: str, default: Any = None) -> Any:
            return getattr(finding, k, default)
    verdict = get("verdict")
    out = {
        "detector": get("detector"),
        "verdict": verdict.name if isinstance(verdict, enum.Enum) else verdict,
        "message": get("message"),
        "figures": dict(get("figures") or {}),
    }
    if get("ranks") is not None:
        out["finding_ranks"] = list(get("ranks"))
    return out


def _split_model_spec(model_spec: Mapping[str, Any] | None) -> tuple[dict | None, dict | None]:
    """Split the caller's model spec into the ``model`` and ``loss`` sections of incident.json."""
    if model_spec is None:
        return None, None
    spec = dict(model_spec)
    loss = None
    if "loss_fn" in spec:
        loss = {"fn": spec.pop("loss_fn"), "kwargs": dict(spec.pop("loss_fn_kwargs", None) or {})}
    else:
        spec.pop("loss_fn_kwargs", None)
    if "class" not in spec and "factory" not in spec:
        raise ValueError("model_spec needs 'class' ('module:Class' + 'config') or 'factory' ('module:function' + 'kwargs')")
    return spec, loss


def _relative_checkpoint(run_dir: Path, checkpoint: str | os.PathLike | None) -> str | None:
    if checkpoint is None:
        return None
    p = Path(checkpoint)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return p.as_posix()  # outside the run folder: keep it absolute


def _weights_entry(run_dir: Path, checkpoint: str | os.PathLike | None) -> dict | None:
    if checkpoint is None:
        return None
    return weights_entry(Path(checkpoint) if Path(checkpoint).is_absolute() else run_dir / checkpoint)


def weights_entry(folder: str | os.PathLike) -> dict | None:
    """What identifies the model weights of the checkpoint ``folder`` without reading them: the manifest
    entry (size + checksum) of ``model.safetensors``, or for a sharded (DCP) checkpoint
    ``{"sharded": {shard file: entry, ...}}``; None when the manifest lists neither (or is damaged).
    Recorded in a bundle and compared by replay, which refuses a checkpoint rewritten since."""
    from ..checkpoint.config import CheckpointError
    from ..checkpoint.dcp_backend import DCP_DIR
    from ..checkpoint.layout import manifest_entry, read_manifest

    entry = manifest_entry(folder, "model.safetensors")
    if entry is not None:
        return entry
    try:
        files = read_manifest(os.fspath(folder))["files"]
    except CheckpointError:
        return None
    shards = {f: dict(e) for f, e in files.items() if f.startswith(DCP_DIR + "/") and isinstance(e, dict)}
    return {"sharded": shards} if shards else None


def _versions() -> dict[str, str | None]:
    from .. import __version__ as vidstab_version

    try:
        import accelerate

        acc = accelerate.__version__
    except ImportError:  # vidstab can capture without accelerate installed (plain torch loop)
        acc = None
    return {"torch": torch.__version__, "accelerate": acc, "vidstab": vidstab_version, "python": platform.python_version()}


def write_incident(
    run_dir: str | os.PathLike,
    *,
    step: int,
    micro_step: int,
    rank: int,
    world_size: int,
    batch: Mapping[str, torch.Tensor],
    sample_ids: Sequence[str],
    finding: Any,
    lr: float | None,
    precision: str,
    seed: int | None,
    checkpoint: str | os.PathLike | None,
    model_spec: Mapping[str, Any] | None,
    localization: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """Write one incident bundle atomically and return its folder.

    The bundle is built in ``incidents/.tmp-<name>-<random>`` (files fsynced) and renamed into place, so a
    reader never sees half a bundle. If a bundle of the same name exists (the same step failing again
    after a rollback), the new one gets a ``-2``, ``-3``... suffix instead of overwriting the evidence.

    Args:
        run_dir: the run folder (``OUTPUT_DIR``).
        step, micro_step, rank, world_size: where the incident happened.
        batch: the micro-batch tensors (every tensor is stored, detached and copied to CPU; non-tensor
            entries are listed under ``skipped_keys``).
        sample_ids: one id per sample along dim 0.
        finding: a ``detectors.base.Finding`` or a dict with ``detector, verdict, message, figures``.
        lr: learning rate at the step; precision: ``"no" | "fp16" | "bf16" | "fp8"``; seed: the run seed.
        checkpoint: the checkpoint folder to replay from (stored relative to ``run_dir``).
        model_spec: how to rebuild the model: ``{"class": "module:Class", "config": {...}}`` (a diffusers
            ``ConfigMixin``) or ``{"factory": "module:function", "kwargs": {...}}``, optionally with
            ``"loss_fn": "module:function"`` and ``"loss_fn_kwargs": {...}``
            (``loss = loss_fn(model, batch, **loss_fn_kwargs)``).
        localization: the result of :func:`vidstab.evidence.localize.locate_nonfinite`, if it ran.
        extra: anything else JSON-able (optimizer name, loss scale, data position ...).
    """
    run_dir = Path(run_dir)
    incidents = run_dir / INCIDENTS_DIR
    incidents.mkdir(parents=True, exist_ok=True)
    model_section, loss_section = _split_model_spec(model_spec)

    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            # clone: safetensors refuses tensors sharing storage, and views must not drag their base along.
            tensors[str(k)] = v.detach().to("cpu", copy=True).contiguous()
        else:
            skipped.append(str(k))
    # The output gradient (vidstab.evidence.replay_record) is evidence about the step, not a sample's input.
    report = sample_report({k: v for k, v in tensors.items() if k != OUTPUT_GRAD_KEY}, [str(s) for s in sample_ids])

    meta: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "step": int(step),
        "micro_step": int(micro_step),
        "rank": int(rank),
        "world_size": int(world_size),
        "sample_ids": [str(s) for s in sample_ids],
        "bad_sample_ids": report["bad_sample_ids"],
        "bad_reasons": report["bad_reasons"],
        "lr": lr,
        "precision": precision,
        "seed": seed,
        **_finding_dict(finding),
        "checkpoint": _relative_checkpoint(run_dir, checkpoint),
        # The weights' manifest entry (size + checksum): replay refuses a checkpoint rewritten since (a
        # rollback may save the same step again with other weights).
        "checkpoint_weights": _weights_entry(run_dir, checkpoint),
        "model": model_section,
        "loss": loss_section,
        "objective": loss_section["kwargs"] if loss_section else None,
        "localization": localization,
        "tensors": list(tensors),
        "skipped_keys": skipped,
        "input_stats": report["input_stats"],
        "sample_stats": report["sample_stats"],
        "versions": _versions(),
        "time": time.time(),
        "extra": extra or {},
    }
    text = _dumps(meta)  # serialise before touching the disk: a bad field fails without leftovers

    base = incident_dir_name(step, rank, micro_step)
    with atomic_folder(incidents, base, exists="number") as folder:
        save_file(tensors, str(folder.tmp / BATCH_FILE), metadata={"format": "pt", "vidstab_schema": str(SCHEMA_VERSION)})
        (folder.tmp / META_FILE).write_text(text, encoding="utf-8")
    return folder.path


def update_incident(path: str | os.PathLike, **fields: Any) -> None:
    """Add ``fields`` to a written bundle's ``incident.json`` (evidence learned after it was written: the in-job
    rerun's verdict), replacing the file atomically."""
    meta_path = Path(path) / META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta.update(fields)
    write_atomic(meta_path, _dumps(meta))


# ----------------------------------------------------------------------------------------------------
# Reading


def read_incident(path: str | os.PathLike) -> Incident:
    """Read and validate a bundle (its folder, or its ``incident.json``).

    Raises :class:`IncidentError` naming the missing or corrupt file or field: a missing folder, a
    missing/unparseable ``incident.json``, a missing required field, a schema newer than this reader, a
    missing/truncated ``batch.safetensors``, or a tensor listed in ``tensors`` but absent from the file.
    """
    path = Path(path)
    if path.name == META_FILE:
        path = path.parent
    if not path.is_dir():
        raise IncidentError(f"incident bundle {path} does not exist (expected a folder with {META_FILE} and {BATCH_FILE})")
    meta_path = path / META_FILE
    why = not_a_regular_file(meta_path)  # a FIFO or a device is named, never opened (it would block or flood)
    if why is not None:
        raise IncidentError(f"{meta_path} is {why}: {path} is not a complete incident bundle")
    try:
        meta = read_json_file(meta_path)
    except TooLarge as e:
        raise IncidentError(str(e)) from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise IncidentError(f"{meta_path} is corrupt (not valid JSON: {e})") from None
    if not isinstance(meta, dict):
        raise IncidentError(f"{meta_path} is corrupt: expected a JSON object, got {type(meta).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in meta]
    if missing:
        raise IncidentError(f"{meta_path} lacks required field(s) {missing}")
    if not isinstance(meta["schema"], int) or isinstance(meta["schema"], bool):
        raise IncidentError(f"{meta_path}: field 'schema' must be an int, got {meta['schema']!r}")
    if meta["schema"] > SCHEMA_VERSION:
        raise IncidentError(
            f"{meta_path}: schema {meta['schema']} is newer than this vidstab reads ({SCHEMA_VERSION}); upgrade vidstab"
        )
    for f in ("step", "micro_step", "rank", "world_size"):
        if not isinstance(meta[f], int) or isinstance(meta[f], bool):
            raise IncidentError(f"{meta_path}: field {f!r} must be an int, got {meta[f]!r}")
    if not isinstance(meta["sample_ids"], list):
        raise IncidentError(f"{meta_path}: field 'sample_ids' must be a list, got {type(meta['sample_ids']).__name__}")
    if not isinstance(meta["tensors"], list):
        raise IncidentError(f"{meta_path}: field 'tensors' must be a list, got {type(meta['tensors']).__name__}")

    batch_path = path / BATCH_FILE
    why = not_a_regular_file(batch_path)
    if why is not None:
        raise IncidentError(f"{batch_path} is {why}: the bundle has no batch tensors")
    try:
        size, cap = batch_path.stat().st_size, limits().batch_bytes
        if size > cap:
            raise IncidentError(f"{batch_path}: {size} bytes, more than the {cap} allowed "
                                f"({env_name('batch_bytes')}); refused unread")
        tensors = load_file(str(batch_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise IncidentError(f"{batch_path} is corrupt or truncated ({type(e).__name__}: {e})") from e
    absent = [k for k in meta["tensors"] if k not in tensors]
    if absent:
        raise IncidentError(f"{batch_path} lacks tensor(s) {absent} listed in {META_FILE}")
    _check_sample_ids(meta, tensors, meta_path)
    return Incident(path=path, meta=meta, tensors=tensors)


def _check_sample_ids(meta: dict, tensors: Mapping[str, torch.Tensor], meta_path: Path) -> None:
    """A bundle names at most one id per sample of its batch (the tensors' largest leading dimension), each a
    short string or integer, and its bad samples among them: anything else would quarantine samples it never held."""
    rows = max((int(t.shape[0]) for t in tensors.values() if t.ndim >= 1), default=None)
    ids, bad = meta["sample_ids"], meta.get("bad_sample_ids") or []
    if not isinstance(bad, list):
        raise IncidentError(f"{meta_path}: field 'bad_sample_ids' must be a list, got {type(bad).__name__}")
    for field, listed in (("sample_ids", ids), ("bad_sample_ids", bad)):
        if rows is not None and len(listed) > rows:
            raise IncidentError(f"{meta_path}: {len(listed)} {field} for a batch of {rows} sample(s) in {BATCH_FILE}; "
                                "a bundle names at most one id per sample: refused")
        odd = next((i for i, x in enumerate(listed) if isinstance(x, bool) or not isinstance(x, (str, int))
                    or len(str(x)) > MAX_SAMPLE_ID), None)
        if odd is not None:
            raise IncidentError(f"{meta_path}: {field}[{odd}] is not a sample id (a string or integer of at most "
                                f"{MAX_SAMPLE_ID} characters): refused")
    named = {str(x) for x in ids}
    stray = next((str(x) for x in bad if str(x) not in named and not str(x).startswith("#")), None)
    if stray is not None:
        raise IncidentError(f"{meta_path}: bad sample {stray!r} is not one of the bundle's sample_ids: refused")


def _sort_key(p: Path) -> tuple:
    m = _NAME_RE.match(p.name)
    if not m:
        return (math.inf, p.name)
    step, rank, micro, rep = (int(g) if g else 0 for g in m.groups())
    return (step, micro, rank, rep, p.name)


def incident_step(path: str | os.PathLike) -> int | None:
    """The step a bundle folder's name says (``step000123-rank1...`` -> 123), or None for another name."""
    m = _NAME_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_incidents(run_dir: str | os.PathLike) -> list[Path]:
    """Complete bundles of a run (folders holding ``incident.json``), ordered by step, micro-step, rank.

    Half-written bundles (``.tmp-*``) are never listed. An absent incidents folder gives ``[]``. A bundle whose
    ``incident.json`` is there but not a regular file is listed: reading it names what it is.
    """
    incidents = Path(run_dir) / INCIDENTS_DIR
    if not incidents.is_dir():
        return []
    # lexists: a bundle whose incident.json is a FIFO or a device is listed (its readers name what it is).
    found = [p for p in incidents.iterdir()
             if p.is_dir() and not p.name.startswith(".") and os.path.lexists(p / META_FILE)]
    return sorted(found, key=_sort_key)
