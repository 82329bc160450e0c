"""Which signal changed first: the cause an escalation names, in the triage order of the field.

A rollback or an abort triggered by ``consecutive_skips`` or ``repeated_spikes`` describes a symptom
(skips, spikes). Escalation detectors keep a short timeline of the findings that led there and name the
earliest signal family that moved, checked in the order a practitioner triages a diverging run: the
data first (non-finite or rescaled inputs), then the learning rate and numerical precision, then the
model's structure (gradient, parameter and loss growth). See docs/ARCHITECTURE.md, "Diagnoses".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Signal families in triage order, and the detectors that watch each one.
TRIAGE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data", ("input_scale", "input_range", "nonfinite_input")),
    ("learning rate / precision", ("lr_bound", "lr_jump", "update_ratio", "loss_scale", "clip_rate")),
    ("structure", ("nonfinite_params", "param_growth", "grad_growth", "grad_spike", "loss_spike", "nonfinite",
                   "exception")),
)
#: Escalation detectors: they describe the run of findings, never its cause.
ESCALATIONS = frozenset({"consecutive_skips", "repeated_spikes", "skip_rate", "trend"})


def family(detector: str) -> str | None:
    """The triage family of a detector's findings (``None`` for escalations and unknown detectors)."""
    for fam, members in TRIAGE:
        if detector in members:
            return fam
    return None


@dataclass
class Timeline:
    """The findings of the last ``horizon`` steps, oldest first: ``(step, signal)`` pairs.

    ``nonfinite`` findings caused by inputs are recorded as the signal ``nonfinite_input`` (data), the
    others as ``nonfinite`` (structure).
    """

    horizon: int = 200
    events: deque = field(default_factory=deque)

    def add(self, step: int, findings: list) -> None:
        """Record this step's non-escalation findings."""
        for f in findings:
            if f.detector in ESCALATIONS:
                continue
            signal = f.detector
            if signal == "nonfinite" and f.figures.get("input_nonfinite", 0):
                signal = "nonfinite_input"
            self.events.append((int(step), signal))
        self.prune(step)

    def prune(self, step: int) -> None:
        """Drop the findings that are ``horizon`` or more steps older than ``step``."""
        while self.events and self.events[0][0] <= step - self.horizon:
            self.events.popleft()

    def clear(self) -> None:
        self.events.clear()

    def first_change(self) -> tuple[str, str, int] | None:
        """``(family, signal, step)`` of the cause: among the families that moved in the horizon, the first
        in triage order, and its earliest finding. ``None`` when nothing was recorded."""
        for fam, members in TRIAGE:
            hits = [(st, sig) for st, sig in self.events if sig in members]
            if hits:
                st, sig = min(hits)
                return fam, sig, st
        return None

    def explain(self) -> str:
        """One clause for a message: ``"first change: data (input_scale at step 312); also: ..."``."""
        cause = self.first_change()
        if cause is None:
            return "no earlier finding names a cause"
        fam, sig, st = cause
        others = sorted({(min(s for s, g in self.events if g == sig2), sig2) for _, sig2 in self.events if sig2 != sig})
        also = "; later or lower in triage order: " + ", ".join(f"{g}@{s}" for s, g in others[:4]) if others else ""
        return f"first change: {fam} ({sig} at step {st}){also}"

    def explain_with(self, step: int, findings: list) -> str:
        """:meth:`explain` as if this step's ``findings`` were already recorded (nothing is changed)."""
        copy = Timeline(self.horizon, deque(self.events))
        copy.add(step, findings)
        return copy.explain()

    def state_dict(self) -> dict:
        return {"events": [list(e) for e in self.events]}

    def load_state_dict(self, d: dict) -> None:
        self.events = deque((int(a), str(b)) for a, b in d.get("events", []))
