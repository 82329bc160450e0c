"""Non-finite parameters (measured every ``param_norm_every`` steps) -> ROLLBACK."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import ACTIONS, Detector, Finding, StepStats, check


@dataclass
class NonFiniteParamsConfig:
    """Configuration of the ``nonfinite_params`` detector."""

    enabled: bool = True
    """Judge the parameter norm when it is measured."""
    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: once the weights hold NaN/Inf, skipping steps cannot help;
    only a checkpoint can."""

    def validate(self, prefix: str = "nonfinite_params") -> None:
        check(self.action in ACTIONS, f"{prefix}.action", f"must be one of {ACTIONS}", self.action)


class NonFiniteParamsDetector(Detector):
    """Fires when the global parameter norm is NaN/Inf."""

    name = "nonfinite_params"

    def observe(self, s: StepStats) -> Finding | None:
        if s.param_norm is None or math.isfinite(s.param_norm):
            return None
        return self.finding(f"non-finite parameters (param norm {s.param_norm})", {"param_norm": s.param_norm})
