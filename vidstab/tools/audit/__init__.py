"""Preflight audit: find what will make a run unstable before it costs a GPU-week.

The checklist (data, VAE latents, custom losses, attention, LR warm-up) as small functions, each returning a
list of *findings*: plain dicts ``{"check", "severity", "message", "details"}`` with ``severity`` one of

- ``"info"``: a measurement worth reading (latent range percentiles, how many attention calls use SDPA);
- ``"warn"``: probably a problem, training may still work (no warm-up, manual softmax attention);
- ``"block"``: training will fail or is pointless (NaN in the data, fp16 without loss scaling).

:func:`run_audit` runs the checks it is given inputs for and returns an :class:`AuditReport`;
:func:`audit_before_training` is the entry point for a trainer's ``--audit`` flag. ``vidstab audit`` (see
:mod:`vidstab.tools.cli`) is the command-line face of the same functions.

Everything here reads files (safetensors, JSON, YAML) and never unpickles anything; it imports no trainer
code (a video decoder or a cache reader of a trainer's own format is passed in) and only the model and loss
the user names (:mod:`vidstab.tools.trusted_import`).

Files, one concern each: ``findings`` (finding, AuditReport), ``data`` (samples), ``sources`` (safetensors
shards, injected video reader), ``model`` (dry-run forward), ``config`` (training config), ``loss_source``
(source scan), ``run`` (entry points).
"""

from .config import HIGH_ADAMW_LR, KNOWN_PREDICTION_TYPES, audit_training_config, load_config_file
from .data import DEFAULT_ABSMAX_THRESHOLD, DEFAULT_CONSTANT_STD, DEFAULT_OUTLIER_Z, audit_tensors
from .findings import SEVERITIES, AuditReport, finding
from .loss_source import audit_loss_source
from .model import ACTIVATION_LIMIT_FP16, ACTIVATION_LIMIT_FP32, audit_model, guess_example_inputs
from .run import audit_before_training, run_audit
from .sources import VideoReader, audit_latent_cache, audit_video_folder, iter_latent_cache

__all__ = [
    "SEVERITIES", "DEFAULT_ABSMAX_THRESHOLD", "DEFAULT_CONSTANT_STD", "DEFAULT_OUTLIER_Z", "ACTIVATION_LIMIT_FP32",
    "ACTIVATION_LIMIT_FP16", "KNOWN_PREDICTION_TYPES", "HIGH_ADAMW_LR", "finding", "AuditReport", "audit_tensors",
    "iter_latent_cache", "audit_latent_cache", "VideoReader", "audit_video_folder", "audit_model",
    "guess_example_inputs", "audit_training_config", "load_config_file", "audit_loss_source", "run_audit",
    "audit_before_training",
]
