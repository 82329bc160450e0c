"""3. Training configuration: warm-up, fp16 loss scaling, AdamW LR, clipping, prediction type."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .findings import finding

# Prediction types the reference objective (and diffusers' schedulers) understand.
KNOWN_PREDICTION_TYPES = ("epsilon", "v_prediction", "flow_matching", "sample")

# AdamW on a transformer above this LR diverges more often than not.
HIGH_ADAMW_LR = 1e-3


def _flatten(cfg: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{leaf_key: value}`` (the innermost key wins; sections like ``optimizer:`` vanish)."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out.setdefault(str(key), value)
    return out


def _first(flat: Mapping[str, Any], *keys: str) -> tuple[str | None, Any]:
    for key in keys:
        if key in flat:
            return key, flat[key]
    return None, None


def audit_training_config(cfg: Mapping[str, Any]) -> list[dict]:
    """Check a training configuration (a dict, nested sections allowed) against the preflight checklist.

    Keys read (first one present wins): ``lr_warmup_steps | warmup_steps``; ``mixed_precision | precision``;
    ``weight_dtype | dtype``; loss scaling ``grad_scaler | use_grad_scaler | loss_scaling`` (bool) or
    ``loss_scale`` (number/"dynamic"); ``learning_rate | lr``; ``optimizer``; ``max_grad_norm | grad_clip``;
    ``prediction_type``.

    - no LR warm-up (0 or missing) -> warn: the first thousands of steps have the noisiest gradients;
    - fp16 without loss scaling -> block: small gradients underflow to 0 and large ones overflow.
      ``mixed_precision: fp16`` under Accelerate gets a GradScaler automatically, so it blocks only when
      scaling is switched off explicitly, or when the weights themselves are fp16 with no scaler named;
    - AdamW with an LR above 1e-3 -> warn;
    - ``max_grad_norm`` missing or 0 -> warn (no clipping);
    - unknown ``prediction_type`` -> block (the target would be wrong); missing -> info.
    """
    flat = _flatten(cfg)
    findings: list[dict] = []

    key, warmup = _first(flat, "lr_warmup_steps", "warmup_steps", "num_warmup_steps")
    if not warmup:
        findings.append(finding(
            "config.warmup", "warn",
            "no LR warm-up (" + (f"{key} = {warmup}" if key else "lr_warmup_steps not set") + "): the first few "
            "thousand steps have the noisiest gradients; warm up linearly (e.g. lr_warmup_steps: 1000)",
            key=key, value=warmup,
        ))

    _, precision = _first(flat, "mixed_precision", "precision")
    _, weight_dtype = _first(flat, "weight_dtype", "dtype", "param_dtype")
    scaler_key, scaler = _first(flat, "grad_scaler", "use_grad_scaler", "loss_scaling", "loss_scale")
    fp16_mixed = str(precision).lower() in ("fp16", "float16", "half")
    fp16_weights = str(weight_dtype).lower() in ("fp16", "float16", "half", "torch.float16")
    scaling_off = scaler_key is not None and (scaler in (False, None, 0, "none", "off", "false", "no"))
    if (fp16_mixed or fp16_weights) and (scaling_off or (fp16_weights and scaler_key is None and not fp16_mixed)):
        findings.append(finding(
            "config.fp16_scaling", "block",
            "fp16 without loss scaling: gradients below 6e-8 flush to zero and overflows go unnoticed; "
            "use mixed_precision: fp16 with Accelerate's GradScaler (the default) or bf16",
            mixed_precision=precision, weight_dtype=weight_dtype, scaler=scaler,
        ))
    elif fp16_mixed:
        findings.append(finding(
            "config.fp16_scaling", "info",
            "fp16 mixed precision with dynamic loss scaling (Accelerate's GradScaler); overflow steps are skipped "
            "by the scaler and recorded by vidstab",
        ))

    _, lr = _first(flat, "learning_rate", "lr")
    _, optimizer = _first(flat, "optimizer", "optimizer_type", "optim")
    is_adamw = optimizer is None or "adam" in str(optimizer).lower()
    try:
        lr_value = float(lr) if lr is not None else None
    except (TypeError, ValueError):
        lr_value = None
    if lr_value is not None and is_adamw and lr_value > HIGH_ADAMW_LR:
        findings.append(finding(
            "config.lr", "warn",
            f"learning rate {lr_value:g} is high for AdamW on a transformer (> {HIGH_ADAMW_LR:g}); "
            "diffusion transformers usually train at 1e-4 or below",
            lr=lr_value, optimizer=optimizer,
        ))

    key, clip = _first(flat, "max_grad_norm", "grad_clip", "clip_grad_norm")
    if not clip:
        findings.append(finding(
            "config.grad_clip", "warn",
            "no gradient clipping (" + (f"{key} = {clip}" if key else "max_grad_norm not set") + "); set "
            "max_grad_norm (e.g. 1.0): vidstab also reads the pre-clip norm it returns",
            key=key, value=clip,
        ))

    _, pred = _first(flat, "prediction_type")
    if pred is None:
        findings.append(finding("config.prediction_type", "info", "prediction_type not set (the trainer's default applies)"))
    elif pred not in KNOWN_PREDICTION_TYPES:
        findings.append(finding(
            "config.prediction_type", "block",
            f"unknown prediction_type {pred!r}; expected one of {', '.join(KNOWN_PREDICTION_TYPES)}",
            value=pred,
        ))
    checked = {"learning_rate": lr, "lr_warmup_steps": warmup, "mixed_precision": precision, "max_grad_norm": clip,
               "prediction_type": pred}
    findings.append(finding(
        "config.summary", "info", "checked: " + ", ".join(f"{k}={v}" for k, v in checked.items()), **checked,
    ))
    return findings


def load_config_file(path: str | Path) -> dict:
    """A YAML or JSON training config as a dict (``yaml.safe_load``: no arbitrary objects)."""
    import yaml

    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
