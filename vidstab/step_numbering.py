"""The step as the user sees it: the one producer of every step number a message, an event or a line states.

A step is numbered as the script counts it (the guard's count of the loop's optimizer steps, the event log's
``step``). An in-place rollback (``attach(..., rollback_every=N)``) winds the weights back while the loop's count
goes on, so from then on the *trajectory* (the steps the weights actually took; what the rollback checkpoints
and recovery's "got past the failure point" count) lags behind by the steps the rollbacks undid: it is named
beside the script's step wherever the two differ: every event the guard's log writes about the step being taken
gets it there (``EventLog.numbering``), an event about a stored step carries the one stored. The explicit form and
the reference trainer rewind their own counter on a rollback: there the two are always the same.
"""

from __future__ import annotations

from typing import Any


class StepNumbering:
    """The script's step and the trajectory's; owned by the guard (``guard.numbering``), advanced by the
    in-place rollbacks (:attr:`lost`)."""

    def __init__(self) -> None:
        self.lost = 0
        """Optimizer steps the in-place rollbacks undid: the script's count minus the trajectory's."""

    def trajectory(self, step: int) -> int:
        """The trajectory's number of the script's ``step``."""
        return int(step) - self.lost

    def script(self, trajectory: int) -> int:
        """The script's number of the trajectory's step ``trajectory`` (as of now)."""
        return int(trajectory) + self.lost

    def label(self, step: int, trajectory: int | None = None) -> str:
        """``step N``, with ``(trajectory step T)`` beside it where the two differ (``trajectory``: when not
        the current offset's, e.g. a step stored earlier)."""
        return step_label(step, self.trajectory(step) if trajectory is None else trajectory)

    def fields(self, step: int, trajectory: int | None = None) -> dict[str, Any]:
        """An event's ``trajectory_step`` field for the script's ``step``, where the two differ (else none)."""
        return trajectory_fields(step, self.trajectory(step) if trajectory is None else trajectory)


def step_label(step: int, trajectory: int | None = None) -> str:
    """``step N`` or ``step N (trajectory step T)``: how every message states a step."""
    if trajectory is None or int(trajectory) == int(step):
        return f"step {int(step)}"
    return f"step {int(step)} (trajectory step {int(trajectory)})"


def trajectory_fields(step: int, trajectory: int | None, key: str = "trajectory_step") -> dict[str, Any]:
    """``{key: trajectory}`` where the trajectory's step differs from the script's ``step``, else none: how an
    event carries the trajectory step beside its ``step`` (or beside another step field, under another ``key``)."""
    if trajectory is None or int(trajectory) == int(step):
        return {}
    return {key: int(trajectory)}


def numbering_of(guard: Any) -> StepNumbering:
    """The guard's numbering (a fresh, identity one for an object that keeps none)."""
    numbering = getattr(guard, "numbering", None)
    return numbering if isinstance(numbering, StepNumbering) else StepNumbering()
