"""``replay(bundle)``: deterministic settings and forked RNGs around one triage, and the JSON report."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ...files.atomic import write_json_atomic
from ...evidence.capture import read_incident
from .base import ABSMAX_LIMIT, REPORT_FILE, ReplayError
from ..trusted_import import trusted
from ...recovery.quarantine import QuarantineList
from .rebuild import MAX_PARAMS, _load_weights, _resolve_checkpoint, build_model, import_object
from .report import ReplayReport
from .runner import _Replayer
from .triage import _triage


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic fp32 algorithms and forked global RNGs for the block; the caller's settings and RNG
    streams (torch CPU and the device's CUDA stream, via ``torch.random.fork_rng``) are put back after."""
    det_before = torch.are_deterministic_algorithms_enabled()
    warn_only_before = torch.is_deterministic_algorithms_warn_only_enabled()
    tf32_before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    bench_before = torch.backends.cudnn.benchmark
    cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
            torch.backends.cudnn.benchmark = False
            yield
    finally:
        torch.use_deterministic_algorithms(det_before, warn_only=warn_only_before)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
        torch.backends.cudnn.benchmark = bench_before


def replay(
    bundle_dir: str | os.PathLike,
    device: str = "cpu",
    json_path: str | os.PathLike | None = None,
    *,
    checkpoint: str | os.PathLike | None = None,
    optimizer: str = "auto",
    absmax_limit: float = ABSMAX_LIMIT,
    fresh_init: bool = False,
    trust: Iterable[str] = (),
    max_params: int | None = None,
) -> ReplayReport:
    """Replay one incident bundle and triage it; write the JSON report and return it.

    Args:
        bundle_dir: the bundle folder (``RUN_DIR/vidstab/incidents/step...``).
        device: where to run (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        json_path: where to write the JSON report (default ``<bundle>/replay_report.json``).
        checkpoint: a checkpoint folder or ``.safetensors`` file overriding the bundle's checkpoint.
        optimizer: ``"adamw"``, ``"sgd"`` or ``"auto"`` (the bundle's ``extra.optimizer`` if it names SGD,
            else AdamW) for the LR test's single update.
        absmax_limit: per-sample absmax above which an input is called out of range.
        fresh_init: ignore the bundle's checkpoint and replay on a seeded fresh initialisation (for a bundle
            copied away from its run folder: data problems still show, weight-dependent ones do not).
        trust: modules (``"my_project"`` trusts it and its submodules) or ``"module:attr"`` objects the
            bundle may name besides vidstab's own (:mod:`vidstab.tools.trusted_import`); anything else is
            refused with :class:`UntrustedCodeError` before it is imported.
        max_params: the most parameters the rebuilt model may have (default ``vidstab.files.limits.Limits.params``,
            ``VIDSTAB_MAX_PARAMS``); a larger one is refused before its weights are allocated.

    Raises:
        UntrustedCodeError: the bundle names code not trusted (nothing was imported or run).
        ReplayError / IncidentError: the bundle cannot be replayed; the message says why.
    """
    inc = read_incident(bundle_dir)
    dev = torch.device(device)
    if dev.type == "cuda":
        # cuBLAS needs this for deterministic algorithms; it must be set before cuBLAS initialises.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    cap = MAX_PARAMS.set(max_params)
    try:
        return _replay(inc, dev, json_path, checkpoint, optimizer, absmax_limit, fresh_init, trust)
    finally:
        MAX_PARAMS.reset(cap)


def _replay(inc: Any, dev: torch.device, json_path: Any, checkpoint: Any, optimizer: str, absmax_limit: float,
            fresh_init: bool, trust: Iterable[str]) -> ReplayReport:
    meta = inc.meta
    spec = meta.get("model")
    loss_spec = meta.get("loss")
    model_name = (spec or {}).get("class") or (spec or {}).get("factory") or "?"
    seed = meta.get("seed") if isinstance(meta.get("seed"), int) else 0
    with deterministic(dev), trusted(trust):
        # Checked in this order so the first thing a user must fix is named first: model, loss, weights.
        torch.manual_seed(seed)  # a fresh initialisation (no checkpoint) is then reproducible too
        model = build_model(spec)
        if not loss_spec or not loss_spec.get("fn"):
            raise ReplayError(
                "the bundle records no loss function ('loss' is null in incident.json); record "
                "'loss_fn': 'module:function' (loss = fn(model, batch, **loss_fn_kwargs)) in the model spec"
            )
        loss_fn = import_object(loss_spec["fn"], "loss.fn")
        if not callable(loss_fn):
            raise ReplayError(f"loss.fn {loss_spec['fn']!r} is not callable")
        weights, ckpt_step, notes = (None, None, []) if fresh_init else _resolve_checkpoint(inc, checkpoint)
        if weights is not None:
            loaded = _load_weights(model, weights)  # a frozen-base checkpoint: over the rebuilt, verified base
            if loaded:
                notes.append(loaded)
        else:
            why = "--fresh-init was asked for" if fresh_init else "the bundle names no checkpoint"
            notes.append(f"{why}: replayed on a fresh initialisation, so the result says "
                         "little about the trained weights (pass --checkpoint PATH)")
        if ckpt_step is not None and ckpt_step != inc.step:
            notes.append(f"the weights are from step {ckpt_step}, {inc.step - ckpt_step} step(s) before the incident: "
                         f"bad data reproduces on them, a weight-dependent spike may not")
        r = _Replayer(model, loss_fn, dict(loss_spec.get("kwargs") or {}), inc.tensors, dev, seed,
                      catch_errors=str(meta.get("detector")) == "exception")
        report = _triage(inc, r, model_name, str(dev), weights, ckpt_step, notes, optimizer, absmax_limit)

    culprits = [c for c in (report.data or {}).get("culprits") or [] if not str(c).startswith("#")]
    if culprits and (inc.run_dir / "vidstab").is_dir():  # leave-one-out named them: out of the run's later data
        added = QuarantineList(inc.run_dir).add(culprits, "named by vidstab replay's leave-one-out", step=inc.step,
                                                bundle=str(inc.path), rank=meta.get("rank"), source="replay")
        if added:
            report.notes.append(f"quarantined {', '.join(added)} in {inc.run_dir} (vidstab quarantine lists and clears it)")
    out = Path(json_path) if json_path is not None else inc.path / REPORT_FILE
    try:
        report.json_path = str(out)
        write_json_atomic(out, report.to_dict())  # strict JSON; a reader never sees half a report
    except OSError as e:
        report.json_path = None
        report.notes.append(f"could not write the JSON report to {out}: {e}")
    return report
