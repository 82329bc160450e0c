"""What a replay found: one run of the step (:class:`RunResult`) and the whole report (:class:`ReplayReport`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ...files.strict_json import to_json_safe
from ..terminal import printable


@dataclass


class RunResult:
    """One forward + backward of the loss on (part of) the captured batch."""

    label: str
    """What was run, e.g. ``"fp32"``, ``"without clip-1"``, ``"bf16 autocast"``, ``"update at lr"``."""
    loss: float
    """Mean of the loss function's output (``nan``/``inf`` when non-finite)."""
    loss_finite: bool
    """Whether every element of the loss function's output was finite."""
    grad_norm: float | None
    """Global L2 norm of the parameter gradients (``None`` when no backward ran)."""
    grads_finite: bool | None
    """Whether every parameter gradient was finite (``None`` when no backward ran)."""
    note: str = ""
    """Free text shown in the table (bitwise comparison, loss after an update ...)."""
    error: str | None = None
    """The exception the run raised, when replaying an ``exception`` incident (counts as a failure)."""

    @property
    def finite(self) -> bool:
        """Loss and gradients finite (and nothing raised)."""
        return self.error is None and self.loss_finite and self.grads_finite is not False


@dataclass


class ReplayReport:
    """Everything a replay found; :meth:`to_dict` is the JSON report, :meth:`to_text` the printout."""

    bundle: str
    """The bundle folder."""
    step: int
    """Optimizer step of the incident."""
    rank: int
    """Rank that captured it."""
    sample_ids: list[str]
    """Samples of the micro-batch."""
    recorded: dict
    """What the guard recorded: detector, verdict, message, figures, lr, precision."""
    kind: str
    """``nonfinite`` | ``spike`` (a finite gradient-norm figure) | ``loss_spike`` | ``exception`` | ``unknown``."""
    device: str
    """Device of the replay."""
    model: str
    """How the model was rebuilt (import path)."""
    checkpoint: str | None
    """Weights file loaded, or ``None`` for a fresh initialisation."""
    checkpoint_step: int | None
    """Step of those weights when known."""
    reproduced: bool | None
    """Whether the failure reproduces (``None``: nothing recorded to compare with)."""
    reproduction: str
    """One sentence: what was compared."""
    deterministic: bool
    """Two identical fp32 replays gave bitwise-identical loss and gradients."""
    runs: list[RunResult] = field(default_factory=list)
    """Every run made, in order."""
    localization: dict | None = None
    """:func:`vidstab.evidence.localize.locate_nonfinite` on the failing run, else ``None``."""
    data: dict = field(default_factory=dict)
    """Triage step 1: input statistics, leave-one-out, culprits, ``implicated``."""
    precision: dict = field(default_factory=dict)
    """Triage step 2a: fp32 vs the run's mixed precision, ``implicated``."""
    lr: dict = field(default_factory=dict)
    """Triage step 2b: one update at lr and at lr/10, ``implicated``."""
    structure: dict = field(default_factory=dict)
    """Triage step 3: the localised module, largest gradients, ``implicated``."""
    notes: list[str] = field(default_factory=list)
    """Caveats (fresh init, checkpoint older than the incident, non-determinism ...)."""
    verdict: str = ""
    """One paragraph for a human."""
    json_path: str | None = None
    """Where the JSON report was written."""

    def to_dict(self) -> dict:
        """The JSON report (strict JSON after :func:`vidstab.evidence.capture.to_json_safe`)."""
        d = asdict(self)
        d["runs"] = [dict(asdict(r), finite=r.finite) for r in self.runs]
        return to_json_safe(d)

    def to_text(self) -> str:
        """Human-readable report: header, table of runs, triage, verdict."""
        rec = self.recorded
        lines = [
            f"vidstab replay: {self.bundle}",
            f"  incident: step {self.step}, rank {self.rank}, {len(self.sample_ids)} samples; "
            f"detector {rec.get('detector')} ({rec.get('verdict')}): {rec.get('message')}",
            f"  model: {self.model}; weights: {self.checkpoint or 'fresh initialisation'}"
            + (f" (step {self.checkpoint_step})" if self.checkpoint_step is not None else "")
            + f"; device {self.device}",
            "",
            f"  {'run':<34} {'loss':>12} {'grad norm':>12}  finite  note",
        ]
        for r in self.runs:
            lines.append(
                f"  {r.label[:34]:<34} {_fmt(r.loss):>12} {_fmt(r.grad_norm):>12}  {'yes' if r.finite else 'NO ':<6}  {r.note}"
            )
        lines.append("")
        for title, section in (("1. data", self.data), ("2a. precision", self.precision), ("2b. lr", self.lr),
                               ("3. structure", self.structure)):
            flag = "IMPLICATED" if section.get("implicated") else "not implicated"
            lines.append(f"  {title}: {flag} - {section.get('summary', '')}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        lines += ["", "Verdict: " + self.verdict]
        if self.json_path:
            lines.append(f"(JSON report: {self.json_path})")
        return "\n".join(printable(line) for line in lines)  # names and ids come from the bundle: no escapes


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.6g}"
