"""What one guarded optimizer step decided: :class:`StepResult`, returned by ``guard.step``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..detectors import Finding, Verdict


@dataclass
class StepResult:
    """What ``guard.step`` decided. Identical on every rank except ``incident``/``incidents``."""

    step: int
    """Optimizer step counter of this step (``guard.step_count`` before it advanced)."""
    applied: bool
    """The optimizer step changed the weights."""
    skipped: bool
    """vidstab skipped the step (SKIP/ROLLBACK verdict, or this rank's optimizer ran out of memory: then the verdict
    is still every rank's and the others judge it at the next step). An fp16 overflow is ``applied=False,
    skipped=False``."""
    micro: bool
    """A non-sync micro-step: nothing was judged or applied."""
    verdict: Verdict = Verdict.OK
    """Worst finding of the step."""
    findings: list[Finding] = field(default_factory=list)
    """All findings of the step, in detector order."""
    grad_norm: float = math.nan
    """Global pre-clip gradient norm."""
    loss: float = math.nan
    """Mean finite loss over ranks and micro-steps."""
    rollback: str | None = None
    """Why a detector asks for a rollback (``"detector: message"``), else ``None``."""
    stop: bool = False
    """Some rank called ``guard.request_stop()``: every rank sees it at the same step."""
    bad_ranks: list[int] = field(default_factory=list)
    """Ranks named by the findings (bad data, exceptions)."""
    incident: Path | None = None
    """First incident bundle written by THIS rank for this step."""
    overflow: bool = False
    """fp16 GradScaler overflow (the scaler skipped the update and lowered the scale)."""
    incidents: list[Path] = field(default_factory=list)
    """All incident bundles written by this rank for this step."""
    rerun: "object | None" = None
    """What re-running a skipped step on the same weights found (:class:`vidstab.recovery.rerun.RerunVerdict`), else None."""
