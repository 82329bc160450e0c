"""The guard's state as read back from a file (``vidstab_guard.json`` beside the script's own ``save_state``, the
guard's ``vidstab.json`` in a checkpoint): every field checked before anything is applied.

A field of the wrong kind (a string, ``null``, a list where a count belongs, a non-finite or non-positive LR
multiplier, a negative count, a number no JSON reader holds exactly) is a :class:`~vidstab.CheckpointError` naming
the file, the field and what was expected, as a malformed checkpoint manifest is; the guard is left as it was and
nothing on disk is touched.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..checkpoint.config import CheckpointError

RESUME_REFUSED_EXIT_CODE = 2
"""The exit code of an attached script whose ``accelerator.load_state`` vidstab refused (as a launch of the reference
trainer that cannot start)."""


class ResumeRefused(CheckpointError, SystemExit):
    """The attached form's refusal of the script's own ``accelerator.load_state`` (a malformed ``vidstab_guard.json``,
    a folder the script's ``save_state`` could not make resumable): the script ends with
    :data:`RESUME_REFUSED_EXIT_CODE` and no traceback (``SystemExit``), the message said once on the main process;
    ``except vidstab.CheckpointError`` still catches it. Raised before anything is loaded."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = RESUME_REFUSED_EXIT_CODE


MAX_COUNT = 2**53
"""The largest count or step read back: beyond it JSON readers (and floats) no longer hold integers exactly."""

_COUNTS = ("skipped_total", "overflow_total", "incidents_written")
_DEFAULTS = {"skipped_total": 0, "overflow_total": 0, "incidents_written": 0, "localized": False,
             "lr_multiplier": 1.0, "base_lrs": [], "clip_flags": [], "last_anomaly_step": -(10**9), "detectors": {},
             "steps_lost": 0}


def checked_guard_state(d: Any, source: str) -> dict[str, Any]:
    """``d`` (what :meth:`vidstab.Guard.state_dict` wrote, read back from ``source``) with every field checked and
    the missing optional ones filled in; ``steps_lost`` (the in-place rollbacks' offset, ``vidstab_guard.json``
    only) too. Raises :class:`~vidstab.CheckpointError` naming ``source`` and the first field that is wrong."""
    if not isinstance(d, Mapping):
        raise CheckpointError(f"{source}: unreadable guard state (a JSON {type(d).__name__}, not an object)")
    if "step_count" not in d:
        raise CheckpointError(f"{source}: unreadable guard state (no 'step_count')")
    out = dict(_DEFAULTS, **d)  # a null is no value vidstab writes: checked like any other

    def bad(field: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{source}: unreadable guard state ({field!r} is {str(out[field])[:60]!r}; expected "
                               f"{expected})")

    def integer(field: str, low: int) -> int:
        v = out[field]
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= MAX_COUNT:
            raise bad(field, f"an integer from {low} to {MAX_COUNT}")
        return v

    if out.get("schema", 1) != 1 or isinstance(out.get("schema"), bool):
        raise bad("schema", "1")
    for field in ("step_count", *_COUNTS, "steps_lost"):
        integer(field, 0)
    integer("last_anomaly_step", -MAX_COUNT)
    if out["steps_lost"] > out["step_count"]:
        raise bad("steps_lost", f"at most 'step_count' ({out['step_count']}): the steps in-place rollbacks undid")
    if not isinstance(out["localized"], bool):
        raise bad("localized", "true or false")
    if not _finite(out["lr_multiplier"]) or out["lr_multiplier"] <= 0:
        raise bad("lr_multiplier", "a finite number > 0")
    if not isinstance(out["base_lrs"], list) or not all(_finite(x) and x >= 0 for x in out["base_lrs"]):
        raise bad("base_lrs", "a list of finite learning rates >= 0")
    if not isinstance(out["clip_flags"], list) or not all(x in (0, 1) for x in out["clip_flags"]):
        raise bad("clip_flags", "a list of 0 and 1")
    if not isinstance(out["detectors"], dict) or not all(isinstance(v, dict) for v in out["detectors"].values()):
        raise bad("detectors", "an object of detector states (objects)")
    out["lr_multiplier"] = float(out["lr_multiplier"])
    out["base_lrs"] = [float(x) for x in out["base_lrs"]]
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
