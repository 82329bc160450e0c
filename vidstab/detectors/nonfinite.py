"""Non-finite loss on any rank, or a non-finite global gradient norm -> SKIP by default."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats


@dataclass
class NonFiniteConfig(DetectorConfig):
    """Configuration of the ``nonfinite`` detector."""

    action: str = "skip"
    """``warn | skip | rollback``. Skip by default: one poisoned batch must not reach the weights, and a
    single bad sample is not a reason to throw away progress (consecutive skips escalate to rollback)."""


class NonFiniteDetector(Detector):
    """Names the ranks whose loss or inputs were non-finite (the quiet error hides on non-zero ranks).

    Under fp16 a non-finite gradient norm with finite losses and inputs everywhere is a normal
    GradScaler overflow (``stats.overflow``): the scaler handles it and this detector stays silent.
    """

    name = "nonfinite"

    def observe(self, s: StepStats) -> Finding | None:
        if s.overflow:
            return None
        if not (s.nonfinite_loss_ranks or s.nonfinite_input_ranks) and (math.isfinite(s.grad_norm) or not s.grad_norm_known):
            return None  # the healthy step: nothing non-finite anywhere
        ranks = sorted(set(s.nonfinite_loss_ranks) | set(s.nonfinite_input_ranks))
        what = []
        if s.nonfinite_loss_ranks:
            what.append(f"loss on rank(s) {s.nonfinite_loss_ranks}")
        if s.nonfinite_input_ranks:
            what.append(f"inputs on rank(s) {s.nonfinite_input_ranks}")
        if s.grad_norm_known and not math.isfinite(s.grad_norm):
            what.append(f"gradient norm {s.grad_norm}")
        return self.finding(
            "non-finite " + ", ".join(what),
            {"grad_norm": s.grad_norm, "input_nonfinite": float(s.input_nonfinite)},
            ranks,
        )
