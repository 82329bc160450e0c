"""Entry points: every check that has an input (:func:`run_audit`), and a trainer's ``--audit`` hook."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .config import _first, _flatten, audit_training_config, load_config_file
from .data import DEFAULT_ABSMAX_THRESHOLD, audit_tensors
from .findings import AuditReport, finding
from .loss_source import audit_loss_source
from .model import audit_model
from .sources import VideoReader, audit_latent_cache, audit_video_folder


def run_audit(
    *,
    latents: str | Path | None = None,
    data_dir: str | Path | None = None,
    video_reader: VideoReader | None = None,
    latents_reader: Callable[[Path], Iterable[tuple[str, torch.Tensor]]] | None = None,
    samples: Iterable[tuple[str, torch.Tensor]] | None = None,
    model: torch.nn.Module | None = None,
    example_inputs: tuple | Mapping | None = None,
    dry_run_fn: Callable[[], Any] | None = None,
    config: Mapping[str, Any] | str | Path | None = None,
    loss_fn: Any = None,
    precision: str | None = None,
    num_frames: int = 16,
    resolution: int = 64,
    absmax_threshold: float = DEFAULT_ABSMAX_THRESHOLD,
) -> AuditReport:
    """Run every check that has an input: a latent cache folder, a video folder, an iterable of
    ``(id, tensor)`` samples, a model (with ``example_inputs`` or ``dry_run_fn``), a training config (dict
    or YAML/JSON path) and a loss function. ``precision`` defaults to the config's ``mixed_precision``."""
    report = AuditReport()
    cfg: Mapping[str, Any] | None = None
    if config is not None:
        try:
            cfg = config if isinstance(config, Mapping) else load_config_file(config)
        except (OSError, ValueError) as err:
            report.extend([finding("config.read", "block", f"cannot read config {str(config)!r}: {err}")])
    if precision is None and cfg is not None:
        precision = str(_first(_flatten(cfg), "mixed_precision", "precision")[1] or "no")
    precision = precision or "no"

    if latents is not None:
        report.extend(audit_latent_cache(latents, reader=latents_reader, absmax_threshold=absmax_threshold))
    if data_dir is not None:
        if video_reader is None:
            raise ValueError("auditing a video folder needs a decoder: pass video_reader= (e.g. "
                             "vidstab.reference.data.video_folder_dataset with skip_bad_samples=True)")
        report.extend(audit_video_folder(data_dir, video_reader, num_frames, resolution,
                                         absmax_threshold=absmax_threshold))
    if samples is not None:
        report.extend(audit_tensors(samples, absmax_threshold=absmax_threshold))
    if model is not None:
        report.extend(audit_model(model, example_inputs, dry_run_fn=dry_run_fn, precision=precision))
    if cfg is not None:
        report.extend(audit_training_config(cfg))
    if loss_fn is not None:
        report.extend(audit_loss_source(loss_fn))
    return report


def audit_before_training(
    model: torch.nn.Module,
    sample_latents: torch.Tensor,
    sample_ids: Iterable[str],
    training_config: Mapping[str, Any],
    dry_run_fn: Callable[[], Any] | None = None,
) -> AuditReport:
    """The trainer's ``--audit`` hook: audit some training latents ``[N, ...]`` (named by ``sample_ids``),
    the model (a forward via ``dry_run_fn``, e.g. the loss on one micro-batch; else guessed inputs) and the
    training config. The caller decides what to do with ``report.blocking`` (the reference trainer stops)."""
    ids = [str(i) for i in sample_ids]
    if len(ids) != sample_latents.shape[0]:
        raise ValueError(f"{len(ids)} sample ids for {sample_latents.shape[0]} latents")
    report = AuditReport()
    report.extend(audit_tensors(zip(ids, sample_latents), name="latents"))
    precision = str(_first(_flatten(training_config), "mixed_precision", "precision")[1] or "no")
    report.extend(audit_model(model, dry_run_fn=dry_run_fn, precision=precision))
    report.extend(audit_training_config(training_config))
    return report
