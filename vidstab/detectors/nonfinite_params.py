"""Non-finite parameters (measured every ``param_norm_every`` steps) -> ROLLBACK."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats


@dataclass
class NonFiniteParamsConfig(DetectorConfig):
    """Configuration of the ``nonfinite_params`` detector."""

    action: str = "rollback"
    """``warn | skip | rollback``. Rollback: once the weights hold NaN/Inf, skipping steps cannot help;
    only a checkpoint can."""


class NonFiniteParamsDetector(Detector):
    """Fires when the global parameter norm is NaN/Inf."""

    name = "nonfinite_params"
    needs = "param_norm"

    def observe(self, s: StepStats) -> Finding | None:
        if s.param_norm is None or math.isfinite(s.param_norm):
            return None
        return self.finding(f"non-finite parameters (param norm {s.param_norm})", {"param_norm": s.param_norm})
