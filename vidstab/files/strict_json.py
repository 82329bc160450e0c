"""Strict JSON for every file vidstab writes: ONE convention for non-finite numbers.

JSON has no NaN or Infinity. Everywhere vidstab writes JSON -- the event log
(``vidstab/events-rank{R}.jsonl``), incident bundles (``incident.json``), checkpoint manifests and state
files, ``replay_report.json``, the audit's ``--json`` report -- a non-finite float is the string ``"nan"``,
``"inf"`` or ``"-inf"``, and ``null`` means "no value". It is lossless (NaN and +-inf stay apart, which is
what tells a 0/0 from an overflow; :func:`json_float` reads the string back as the float) and every file is
dumped with ``allow_nan=False``, so it is standard JSON any tool can read. docs/ARCHITECTURE.md,
"Strict JSON". The checkpoint state codec (``optimizer.json``, ``scheduler.json``, ... in
:mod:`vidstab.files.statedict_io`) round-trips exact Python values, where a string must stay a string, so it wraps
the same spelling in a tag: ``{"__float__": "nan"}``.

Old files: event logs written before this convention spelled a non-finite float ``null``. Readers take
both: :func:`json_float` gives ``None`` for ``null``, and the report counts a ``null`` where a number is
always logged (``loss``, ``loss_rank``) as non-finite, as it did then.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from typing import Any, Mapping

import torch

__all__ = ["json_float", "to_json_safe", "from_json_safe", "dumps_strict"]


def json_float(v: Any) -> float | None:
    """Inverse of the non-finite spelling: ``"nan"``/``"inf"``/``"-inf"`` and numbers -> float; else None."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(v)
    return None


def to_json_safe(obj: Any) -> Any:
    """Convert ``obj`` to strict-JSON-compatible data.

    Non-finite floats -> ``"nan"``/``"inf"``/``"-inf"``; 0-d tensors and numpy scalars -> numbers;
    other tensors -> lists (small metadata only); enums -> their name; paths -> strings; tuples/sets ->
    lists; dataclasses -> dicts; dict keys -> strings. Anything else -> ``str(obj)``, never a pickle.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)  # "nan", "inf", "-inf"
    if isinstance(obj, torch.Tensor):
        return to_json_safe(obj.detach().cpu().item() if obj.numel() == 1 and obj.ndim == 0 else obj.detach().cpu().tolist())
    if isinstance(obj, Mapping):
        return {str(k): to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_json_safe(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_json_safe({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        try:
            return to_json_safe(obj.item())
        except (TypeError, ValueError):
            pass
    return str(obj)


def from_json_safe(obj: Any) -> Any:
    """Read back what :func:`to_json_safe` spelled: ``"nan"``/``"inf"``/``"-inf"`` anywhere in ``obj``
    (nested lists and dicts) -> floats. For data whose strings are never those words (numeric tables)."""
    if isinstance(obj, str):
        return float(obj) if obj in ("nan", "inf", "-inf") else obj
    if isinstance(obj, dict):
        return {k: from_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json_safe(v) for v in obj]
    return obj


def dumps_strict(obj: Any, **dumps_kwargs: Any) -> str:
    """``json.dumps`` of :func:`to_json_safe` (``obj``) with ``allow_nan=False``: strict JSON, always."""
    return json.dumps(to_json_safe(obj), allow_nan=False, **dumps_kwargs)
