"""Advice a message gives, in the form the user is in.

A message that tells the user what to change names the change as *their* code or command line spells it: the
attached form (``vidstab.attach(..., rollback_every=N)``) configures recovery with
``attach(..., recovery=RecoveryConfig(...))``, the explicit form with ``Recovery(..., config=RecoveryConfig(...))``
(``Recovery(..., reset=True)``), the reference trainer with its flags (``--reset_recovery``, ``--max_retries N``).
"""

from __future__ import annotations

from typing import Any

FORMS = ("attached", "explicit", "trainer")
"""The forms a run can be in: ``vidstab.attach``, ``Guard`` + ``CheckpointManager`` + ``Recovery``, ``recipes/train.py``."""

TRAINER_FLAGS = {"reset": "--reset_recovery", "max_retries": "--max_retries"}
"""The reference trainer's flags for the recovery settings a message may advise."""


def recovery_setting(form: str, **settings: Any) -> str:
    """How a user in ``form`` sets these :class:`~vidstab.RecoveryConfig` fields, e.g.
    ``recovery_setting("attached", reset=True)`` -> ``attach(..., recovery=RecoveryConfig(reset=True))``."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, not {form!r}")
    args = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    if form == "trainer":
        missing = [k for k in settings if k not in TRAINER_FLAGS]
        if missing:
            raise ValueError(f"recipes/train.py has no flag for RecoveryConfig.{', '.join(missing)}")
        return " ".join(TRAINER_FLAGS[k] if v is True else f"{TRAINER_FLAGS[k]} {v}" for k, v in settings.items())
    if form == "attached":
        return f"attach(..., recovery=RecoveryConfig({args}))"
    if set(settings) == {"reset"}:
        return f"Recovery(..., {args})"
    return f"Recovery(..., config=RecoveryConfig({args}))"
