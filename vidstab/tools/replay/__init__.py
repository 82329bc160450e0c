"""Replay an incident bundle small, seeded and deterministic, and triage it: data, then LR/precision, then structure.

``vidstab replay BUNDLE`` (or ``python scripts/replay.py BUNDLE``) rebuilds the model the bundle names,
loads the checkpoint it points to, feeds it the captured micro-batch, and re-runs forward + backward in
fp32 with deterministic algorithms, twice. It then works through the causes in the order the
field guides give -- cheapest to fix and most common first:

1. **Data**: are the inputs finite and in range (per-sample statistics; a normalised latent with
   absmax > 50 is suspicious), and which sample breaks the step (leave-one-out over the batch)?
2. **Precision and LR**: does the step fail only under the run's fp16/bf16 autocast, and does one
   optimizer update at the run's LR (but not at a tenth of it) blow the loss up?
3. **Structure**: which module first produced a non-finite output from finite inputs, or first
   produced a non-finite gradient (:mod:`vidstab.evidence.localize`).

and writes a one-paragraph verdict, a table, and ``replay_report.json`` beside the bundle.

What a replay can and cannot tell: the weights come from the bundle's checkpoint, which may be some
steps older than the incident. A NaN caused by bad data reproduces on any weights; a gradient spike
that depends on the exact weights of that step may not -- the report says how many steps lie between.
The recorded gradient norm covers the whole optimizer step (all micro-batches and ranks); the replay
sees one micro-batch of one rank, so "within 10%" is exact only without accumulation on one rank.

Only trusted code is imported: vidstab's own classes and what ``--trust`` names
(:mod:`vidstab.tools.trusted_import`); a bundle naming anything else is refused before anything runs.

Exit codes of :func:`main`: 0 when a report was produced (whether or not the failure reproduced),
2 when the bundle cannot be replayed (the message names what is missing).

Files, one concern each: ``base`` (limits, errors), ``report`` (the report types), ``rebuild`` (model, loss
and weights from the bundle), ``runner`` (running variants of the step), ``triage`` (reproduce, then the
stages in order), ``stages`` (data, precision, LR, structure), ``verdict``, ``api`` (:func:`replay`),
``cli`` (:func:`main`).
"""

from .api import replay
from .base import ABSMAX_LIMIT, EXIT_CANNOT_REPLAY, EXIT_OK, REPORT_FILE, SPIKE_TOLERANCE, ReplayError, UntrustedCodeError
from .cli import main
from .rebuild import build_model, import_object
from .report import ReplayReport, RunResult

__all__ = [
    "ReplayError",
    "UntrustedCodeError",
    "RunResult",
    "ReplayReport",
    "replay",
    "build_model",
    "import_object",
    "main",
    "ABSMAX_LIMIT",
    "SPIKE_TOLERANCE",
    "REPORT_FILE",
    "EXIT_OK",
    "EXIT_CANNOT_REPLAY",
]
