"""A caller-reported exception on some rank's micro-step -> ROLLBACK by default."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats


@dataclass
class ExceptionConfig(DetectorConfig):
    """Configuration of the ``exception`` detector (``guard.backward(error=exc)``)."""

    action: str = "rollback"
    """``warn | skip | rollback``. Rollback by default: after an exception inside forward/backward
    (e.g. a CUDA error, an assertion in the model) the in-memory state can no longer be trusted."""


class ExceptionDetector(Detector):
    """Every rank learns which ranks failed, through the per-rank detail of the step, at the same step."""

    name = "exception"
    needs = "exception_ranks"

    def observe(self, s: StepStats) -> Finding | None:
        if not s.exception_ranks:
            return None
        return self.finding(
            f"exception during forward/backward on rank(s) {s.exception_ranks}",
            {"ranks_failed": float(len(s.exception_ranks))},
            s.exception_ranks,
        )
